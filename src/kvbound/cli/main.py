"""`kvbound` command line: generate, info, eval (ppl / sweep / needle), bench (throughput / serve)."""
from __future__ import annotations

import argparse
import sys

import torch

from ..errors import KvboundError
from .bench_cmds import add_bench_parser
from .eval_cmds import add_eval_parser
from .options import add_cache_args, add_model_args, kv_dtype, load_model, make_policy, positive_int


def cmd_generate(args):
    """Through the engine (LLMEngine) with one request; quantized KV (--kv-bits) uses the single-sequence
    path, since the paged pool stores K/V unquantized."""
    from ..cache import KVCache, parse_kv_bits
    from ..engine import LLM, SamplingParams, generate_ids
    from ..models.tokenizer import StreamDecoder
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    policy = make_policy(args)
    bits = parse_kv_bits(args.kv_bits)
    model, tok, dtype = load_model(args)
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(prompt)
    if bits is None:
        need = policy.capacity if policy.bounded else len(ids) + args.max_tokens
        llm = LLM(model, tokenizer=tok, policy=policy, num_blocks=-(-need // 16), block_size=16,
                  prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.prefill_chunk,
                  kv_dtype=kv_dtype(args, dtype))
        tokens = llm.stream(ids, params)
    else:
        cache = KVCache(model.config, policy, device=args.device, dtype=kv_dtype(args, dtype), kv_bits=bits,
                        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start)
        tokens = generate_ids(model, ids, params, cache, tok.eos_ids, args.prefill_chunk)
    stream = StreamDecoder(tok)
    if args.echo:
        sys.stdout.write(prompt)
    for t in tokens:
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    sys.stdout.write("\n")


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
    bits = parse_kv_bits(args.kv_bits)
    policy = make_policy(args)
    cache = KVCache(cfg, policy, kv_bits=bits, kv_group_size=args.kv_group_size, dtype=torch.bfloat16)
    per = cache.store.bytes_per_token() * cfg.num_layers
    if bits is not None:
        print(f"KV bytes/token    {per:,} at kv-bits {args.kv_bits}, group {args.kv_group_size} "
              f"(data + scales + biases; {cfg.kv_bytes_per_token(2) / per:.3f}x smaller than bf16)")
    if policy.bounded:
        meta = cfg.num_layers * cfg.num_kv_heads * (4 + (4 if policy.score else 0))  # int32 positions (+ fp32 scores)
        held = policy.budget * (per + meta)
        print(f"KV bytes held     {held:,} at most per sequence under {policy.describe()} "
              f"(K/V + positions{' + scores' if policy.score else ''}); a full bf16 cache passes that at "
              f"{held // cfg.kv_bytes_per_token(2) + 1:,} tokens")


def build_parser():
    ap = argparse.ArgumentParser(prog="kvbound", description="LLM inference with a bounded KV cache")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    add_model_args(g)
    add_cache_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="architecture, parameters and KV bytes per token")
    add_model_args(i)
    add_cache_args(i)
    i.set_defaults(func=cmd_info)

    add_eval_parser(sub)
    add_bench_parser(sub)
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
