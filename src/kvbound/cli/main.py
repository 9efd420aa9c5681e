"""`kvbound` command line: generate, chat, info, eval (ppl / sweep / needle), bench (throughput / serve), serve."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from ..errors import KvboundError
from .bench_cmds import add_bench_parser
from .eval_cmds import add_eval_parser
from .serve_cmd import add_serve_parser
from .options import (add_cache_args, add_model_args, engine_kv_bits, kv_dtype, load_model, make_policy,
                      positive_gib, positive_int, token_bytes)


def engine_tokens(engine, ids, params, report):
    """One request through the engine: its tokens as they come, a progress bar on stderr while a long
    prompt is prefilled, and the peak KV bytes the pool held in report["kv_bytes"]."""
    from tqdm import tqdm
    rid = engine.add_request(ids, params)
    seq = engine.requests[rid][0]
    report["kv_bytes"] = 0
    with tqdm(total=len(ids), desc="prefill", unit="tok", file=sys.stderr, leave=False,
              disable=len(ids) <= engine.scheduler.chunk) as bar:
        def on_step():
            held = engine.pool.num_blocks - engine.pool.num_free
            ring = 0 if seq.cache is None or seq.cache.ring is None else seq.cache.ring.bytes_per_row()
            report["kv_bytes"] = max(report["kv_bytes"], held * engine.pool.block_bytes + ring)
            if seq.cache is not None:
                bar.update(min(seq.cache.seen, len(ids)) - bar.n)
        yield from engine.stream(rid, on_step)


def cmd_generate(args):
    """Through the engine (LLMEngine) with one request, its pool packed with --kv-bits 8 / 4 / heavy=4,recent=8;
    --quantized-kv-start and re-indexed positions use a single-sequence cache. Speeds and peak KV memory go to
    stderr."""
    from ..cache import parse_kv_bits, sequence_cache
    from ..engine import LLMEngine, SamplingParams, generate_ids
    from ..engine.scheduler import peak_blocks
    from ..models.tokenizer import StreamDecoder
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    policy = make_policy(args)
    bits = engine_kv_bits(args) if args.kv_cache_dtype != "auto" else parse_kv_bits(args.kv_bits)
    if bits == "fp8" and args.reindex_positions:
        raise KvboundError("--kv-cache-dtype fp8 lives in the engine's pool; --reindex-positions needs a cache of "
                           "its own (float32 K/V)")
    text = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    model, tok, dtype = load_model(args)
    prompt = tok.apply_chat_template([{"role": "user", "content": text}]) if args.chat else text
    ids = tok.encode(prompt)
    if not args.reindex_positions:
        model.config.check_length(len(ids), args.max_tokens)
    report = {}
    own_cache = args.quantized_kv_start or args.reindex_positions
    if not own_cache:
        need = peak_blocks(policy, len(ids), len(ids) + args.max_tokens, 16)
        engine = LLMEngine(model, tok, policy=policy, num_blocks=need, block_size=16,
                           prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.prefill_chunk,
                           kv_dtype=kv_dtype(args, dtype), kv_bits=bits, kv_group_size=args.kv_group_size)
        tokens = engine_tokens(engine, ids, params, report)
    else:
        cache = sequence_cache(model.config, policy, device=args.device, dtype=kv_dtype(args, dtype), kv_bits=bits,
                               kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
                               rotate_keys=model.rerotate if args.reindex_positions else None)
        tokens = generate_ids(model, ids, params, cache, tok.eos_ids, args.prefill_chunk)
    stream = StreamDecoder(tok)
    if args.echo:
        sys.stdout.write(prompt)
    start, first, n = time.perf_counter(), None, 0
    for t in tokens:
        first = first or time.perf_counter()
        n += 1
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    kv = report["kv_bytes"] if "kv_bytes" in report else cache.nbytes()["held_bytes"]
    prefill_s = (first or end) - start
    print(f"prompt: {len(ids)} tokens, {len(ids) / prefill_s:.1f} tokens/s\n"
          f"generation: {n} tokens, {(n - 1) / (end - first) if n > 1 else 0.0:.1f} tokens/s\n"
          f"peak KV memory: {kv / 2**20:.2f} MiB ({policy.describe()})", file=sys.stderr)


def cmd_chat(args):
    """An interactive conversation, one line per user turn (EOF or an empty line ends it). The cache persists
    between turns under the chosen policy; the system prompt is pinned under bounded ones."""
    from ..cache import parse_kv_bits
    from ..engine import SamplingParams
    from ..engine.chat import ChatSession
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    policy = make_policy(args)
    bits = parse_kv_bits(args.kv_bits)
    if args.kv_cache_dtype != "auto":
        raise KvboundError(f"--kv-cache-dtype {args.kv_cache_dtype}: fp8 KV lives in the engine's pool (generate, "
                           "bench, serve); chat keeps one cache of its own, which takes --kv-bits")
    model, tok, dtype = load_model(args)
    session = ChatSession(model, tok, policy, args.system, params, args.prefill_chunk, device=args.device,
                          dtype=kv_dtype(args, dtype), kv_bits=bits, kv_group_size=args.kv_group_size,
                          quantized_kv_start=args.quantized_kv_start,
                          rotate_keys=model.rerotate if args.reindex_positions else None)
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if tty else "")
        except EOFError:
            break
        if not line.strip():
            break
        for piece in session.send(line):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    print(f"{session.cache.seen} tokens processed, {len(session.cache)} held per layer "
          f"({policy.describe()}), {session.cache.nbytes()['held_bytes'] / 2**20:.2f} MiB of KV", file=sys.stderr)


def cmd_info(args):
    from ..cache import KVCache, parse_kv_bits
    model, tok, dtype = load_model(args)
    cfg = model.config
    print(f"architecture      {cfg.arch}")
    print(f"layers            {cfg.num_layers}")
    print(f"hidden            {cfg.hidden_size}")
    print(f"heads (q / kv)    {cfg.num_heads} / {cfg.num_kv_heads}, head_dim {cfg.head_dim}")
    print(f"ffn               {cfg.intermediate_size}")
    print(f"vocab             {cfg.vocab_size}")
    print(f"rope theta        {cfg.rope_theta:g}" + (f", scaling {cfg.rope_scaling}" if cfg.rope_scaling else ""))
    print(f"context           {cfg.max_position_embeddings}")
    print(f"parameters        {model.num_parameters():,}")
    print(f"KV bytes/token    {cfg.kv_bytes_per_token(2):,} (bf16, all layers)")
    if args.kv_cache_dtype != "auto":
        n = token_bytes(cfg, torch.bfloat16, engine_kv_bits(args), args.kv_group_size)
        print(f"KV bytes/token    {n:,} at fp8 e4m3 (codes + a scale per token and head, the engine's pool; "
              f"{cfg.kv_bytes_per_token(2) / n:.3f}x smaller than bf16)")
    if args.kv_cache_memory is not None:
        pool = int(args.kv_cache_memory * 2**30)
        widths = {"bf16": None}
        if args.kv_cache_dtype != "auto" or args.kv_bits is not None:
            b = engine_kv_bits(args)
            name = ("4-bit (heavy=4,recent=8: each sequence's window residuals beside the pool)"
                    if isinstance(b, dict) else args.kv_cache_dtype if args.kv_cache_dtype != "auto" else f"{b}-bit")
            widths[name] = b
        held = [f"{pool // token_bytes(cfg, torch.bfloat16, b, args.kv_group_size):,} tokens at {name}"
                for name, b in widths.items()]
        print(f"KV pool           {args.kv_cache_memory:g} GiB holds {' / '.join(held)}")
    bits = parse_kv_bits(args.kv_bits)
    policy = make_policy(args)
    cache = KVCache(cfg, policy, kv_bits=bits, kv_group_size=args.kv_group_size, dtype=torch.bfloat16)
    per = {}
    if bits is not None:
        one = cache.store.bytes_per_token() * cfg.num_layers
        per = {"recent": 2 * one if cache.ring is not None else one, "heavy": one}
        lines = ([(per["recent"], "8-bit precision (recent and sink tokens: 4-bit codes and a 4-bit residual)"),
                  (one, "4 bits (older tokens)")] if cache.ring is not None else [(one, f"{bits} bits")])
        for n, what in lines:
            print(f"KV bytes/token    {n:,} at {what}, group {args.kv_group_size} "
                  f"(data + scales + biases; {cfg.kv_bytes_per_token(2) / n:.3f}x smaller than bf16)")
        if cache.ring is not None:
            print(f"KV residual ring  {cache.ring.bytes_per_row():,} bytes per sequence (sink + recent + 1 entries "
                  "per layer and KV head, beside the engine's pool)")
    if policy.bounded:
        meta = cfg.num_layers * cfg.num_kv_heads * (4 + (4 if policy.score else 0))  # int32 positions (+ fp32 scores)
        bf16 = cfg.kv_bytes_per_token(2)
        young = min(policy.budget, policy.sink + policy.recent)  # mixed widths: young tokens hold residuals too
        held = (young * per.get("recent", bf16) + (policy.budget - young) * per.get("heavy", bf16)
                + policy.budget * meta)
        print(f"KV bytes held     {held:,} at most per sequence under {policy.describe()} "
              f"(K/V + positions{' + scores' if policy.score else ''}); a full bf16 cache passes that at "
              f"{held // bf16 + 1:,} tokens")


def add_reindex_arg(p):
    p.add_argument("--reindex-positions", action="store_true",
                   help="RoPE positions count the tokens held, not the tokens processed (StreamingLLM): a bounded "
                        "cache can then run past the model's context, the evicted gaps closed. Needs a bounded "
                        "policy and float32 K/V, no --kv-bits")


class Parser(argparse.ArgumentParser):
    """A usage error is one line naming the bad value, and where to look (exit code 2), not the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser():
    from ..version import __version__
    ap = Parser(prog="kvbound", description="LLM inference with a bounded KV cache")
    ap.add_argument("--version", action="version", version=f"kvbound {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    g.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    add_model_args(g)
    add_cache_args(g)
    add_reindex_arg(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="an interactive conversation whose cache persists between turns")
    c.add_argument("--system", default=None, help="a system prompt (pinned under bounded policies)")
    c.add_argument("--max-tokens", type=positive_int, default=256, help="tokens per reply (default: %(default)s)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    c.add_argument("--seed", type=int, default=None)
    add_model_args(c)
    add_cache_args(c)
    add_reindex_arg(c)
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("info", help="architecture, parameters and KV bytes per token")
    add_model_args(i)
    add_cache_args(i)
    i.add_argument("--kv-cache-memory", type=positive_gib, default=None, metavar="GiB",
                   help="also: how many tokens an engine pool of this many GiB holds, at bf16 and at the chosen width")
    i.set_defaults(func=cmd_info)

    add_eval_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.func(args)
    except KvboundError as e:
        print(f"kvbound: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
