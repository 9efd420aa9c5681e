"""Flags shared by the subcommands, and turning them into the packages' objects."""
from __future__ import annotations

import argparse

import torch

from ..errors import KvboundError


def positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def int_list(s):
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def float_list(s):
    try:
        return [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def add_model_args(p):
    p.add_argument("--model", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")


def add_cache_args(p, policy_default="full"):
    g = p.add_argument_group("KV cache")
    g.add_argument("--policy", default=policy_default,
                   help="full | window | h2o | h2o-balanced | h2o-heavy | a spec like "
                        "'h2o:sink=4,heavy=128,recent=124,score=ema,granularity=layer'")
    g.add_argument("--budget", type=positive_int, default=None, help="KV tokens kept per layer (bounded policies)")
    g.add_argument("--score", choices=["cumulative", "ema", "normalized"], default=None, help="h2o score")
    g.add_argument("--ema-decay", type=float, default=None, help="h2o ema decay in (0, 1) (default 0.95)")
    g.add_argument("--granularity", choices=["kv-head", "layer"], default=None, help="h2o eviction granularity")
    g.add_argument("--evict-every", type=positive_int, default=None, help="evict once every N tokens")
    g.add_argument("--pin-prefix", type=int, default=0, help="never evict the first N prompt tokens")
    g.add_argument("--prefill-chunk", type=positive_int, default=512, help="prefill chunk length")
    g.add_argument("--kv-bits", default=None, help="8 | 4 | heavy=8,recent=4 (quantized KV)")
    g.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    g.add_argument("--quantized-kv-start", type=int, default=0, help="keep full precision until N tokens")
    g.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of unquantized K/V (default: the model's dtype)")


def cache_options(args):
    """The eval harness's cache settings from the KV-cache flags."""
    from ..eval.strategies import CacheOptions
    return CacheOptions(kv_dtype=getattr(torch, args.kv_dtype) if args.kv_dtype else None, kv_bits=args.kv_bits,
                        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
                        prefill_chunk=args.prefill_chunk)


def policy_defaults(args) -> dict:
    return dict(score=args.score, ema_decay=args.ema_decay, granularity=args.granularity,
                evict_every=args.evict_every)


def make_policy(args, spec=None, budget=None):
    from ..cache import parse_policy
    if args.pin_prefix < 0:
        raise KvboundError(f"--pin-prefix must be >= 0, got {args.pin_prefix}")
    pinned = ((0, args.pin_prefix),) if args.pin_prefix else ()
    return parse_policy(spec or args.policy, budget if budget is not None else args.budget, pinned=pinned,
                        **policy_defaults(args))


def load_model(args):
    from ..models import load
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
    return getattr(torch, args.kv_dtype) if args.kv_dtype else model_dtype


def add_engine_args(p):
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool blocks (default: "
                   "--kv-cache-tokens / --block-size)")
    g.add_argument("--kv-cache-tokens", type=positive_int, default=16384)
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
