"""`kvbound` command line: generate, info, eval (ppl / sweep / needle)."""
from __future__ import annotations

import argparse
import sys

import torch

from .config import KvboundError


def _positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _int_list(s):
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _float_list(s):
    try:
        return [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def add_model_args(p):
    p.add_argument("--model", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for torch")


def add_cache_args(p, policy_default="full"):
    g = p.add_argument_group("KV cache")
    g.add_argument("--policy", default=policy_default,
                   help="full | window | h2o | h2o-balanced | h2o-heavy | a spec like "
                        "'h2o:sink=4,heavy=128,recent=124,score=ema,granularity=layer'")
    g.add_argument("--budget", type=_positive_int, default=None, help="KV tokens kept per layer (bounded policies)")
    g.add_argument("--score", choices=["cumulative", "ema", "normalized"], default=None, help="h2o score")
    g.add_argument("--ema-decay", type=float, default=None, help="h2o ema decay in (0, 1) (default 0.95)")
    g.add_argument("--granularity", choices=["kv-head", "layer"], default=None, help="h2o eviction granularity")
    g.add_argument("--evict-every", type=_positive_int, default=None, help="evict once every N tokens")
    g.add_argument("--pin-prefix", type=int, default=0, help="never evict the first N prompt tokens")
    g.add_argument("--prefill-chunk", type=_positive_int, default=512, help="prefill chunk length")
    g.add_argument("--kv-bits", default=None, help="8 | 4 | heavy=8,recent=4 (quantized KV)")
    g.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    g.add_argument("--quantized-kv-start", type=int, default=0, help="keep full precision until N tokens")
    g.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of unquantized K/V (default: the model's dtype)")


def policy_defaults(args) -> dict:
    return dict(score=args.score, ema_decay=args.ema_decay, granularity=args.granularity,
                evict_every=args.evict_every)


def make_policy(args, spec=None, budget=None):
    from .policies import parse_policy
    if args.pin_prefix < 0:
        raise KvboundError(f"--pin-prefix must be >= 0, got {args.pin_prefix}")
    pinned = ((0, args.pin_prefix),) if args.pin_prefix else ()
    return parse_policy(spec or args.policy, budget if budget is not None else args.budget, pinned=pinned,
                        **policy_defaults(args))


def load_model(args):
    from .loader import load
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise KvboundError(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if args.threads:
        torch.set_num_threads(args.threads)
    # Tiny attention probabilities and activations go subnormal, and x86 CPUs compute on subnormals
    # many times slower: flushing them to zero made a decode step 15-30% faster here.
    torch.set_flush_denormal(True)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    model, tok = load(args.model, device=args.device, dtype=dtype)
    return model, tok, dtype


def kv_dtype(args, model_dtype):
    return getattr(torch, args.kv_dtype) if getattr(args, "kv_dtype", None) else model_dtype


def cmd_generate(args):
    """Through the engine (LLMEngine) with one request; quantized KV (--kv-bits) uses the single-sequence
    path, since the paged pool stores K/V unquantized."""
    from .generate import SamplingParams
    from .quant import parse_kv_bits
    from .tokenizer import StreamDecoder
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    policy = make_policy(args)
    bits = parse_kv_bits(args.kv_bits)
    model, tok, dtype = load_model(args)
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(prompt)
    if bits is None:
        from .engine import LLM
        need = policy.budget + policy.evict_every if policy.budget is not None else len(ids) + args.max_tokens
        llm = LLM(model, tokenizer=tok, policy=policy, num_blocks=-(-need // 16), block_size=16,
                  prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.prefill_chunk,
                  kv_dtype=kv_dtype(args, dtype))
        tokens = llm.stream(ids, params)
    else:
        from .cache import KVCache
        from .generate import generate_ids
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
    from .cache import KVCache
    from .quant import parse_kv_bits
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
    if policy.budget is not None:
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
    g.add_argument("--max-tokens", type=_positive_int, default=64)
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

    from .evaluate import add_eval_parser
    add_eval_parser(sub)
    from .bench import add_bench_parser
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


if __name__ == "__main__":
    sys.exit(main())
