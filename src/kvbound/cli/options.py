"""Flags shared by the subcommands, and turning them into the packages' objects."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import KvboundError


def int_at_least(low: int, what: str):
    """An argparse type: an integer >= low; `what` names it in the error."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


positive_int = int_at_least(1, "a positive integer")
nonneg_int = int_at_least(0, "an integer >= 0")


def finite_float(strict: bool):
    """An argparse type: a finite number > 0 (strict) or >= 0."""
    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not (v > 0 if strict else v >= 0) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} 0, got {s}")
        return v
    return parse


positive_float, nonneg_float = finite_float(True), finite_float(False)

UNITS = {"": 1.0, "g": 1.0, "gib": 1.0, "gb": 1e9 / 2 ** 30, "m": 2 ** -10, "mib": 2 ** -10, "mb": 1e6 / 2 ** 30,
         "t": 2.0 ** 10, "tib": 2.0 ** 10, "tb": 1e12 / 2 ** 30}  # a size's unit, in GiB


def memory_size(strict: bool):
    """An argparse type: a memory size in GiB, as a number (GiB) or with a unit (512MiB, 4GiB, 4G, 8GB)."""
    number = finite_float(strict)

    def parse(s):
        text = s.strip()
        digits = text.rstrip("BbIiGgMmTt")
        unit = UNITS.get(text[len(digits):].lower())
        if unit is None or not digits:
            raise argparse.ArgumentTypeError(f"expected a size such as 4, 4GiB or 512MiB, got {s!r}")
        return number(digits) * unit
    return parse


positive_gib, nonneg_gib = memory_size(True), memory_size(False)


def int_list(s):
    try:
        values = [int(x) for x in s.split(",") if x]
        if not values:
            raise ValueError(s)
        return values
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def output_file(s):
    """An argparse type: a file to write, in a folder that exists, checked before any long run starts."""
    folder = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{'is a folder' if os.path.isdir(s) else 'no such folder'}: "
                                         f"{s if os.path.isdir(s) else folder}")
    return s


def device_name(s):
    """An argparse type: a torch device such as cpu, cuda or cuda:1."""
    try:
        torch.device(s)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:1, got {s!r}") from None
    return s


def float_list(s):
    try:
        values = [float(x) for x in s.split(",") if x]
        if not values:
            raise ValueError(s)
        return values
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def default_threads() -> int:
    """CPU threads for torch: the cores this process may use, less those other work keeps busy (the load
    average), at least 1. Oversubscribed cores make every thread wait: on a busy 2-core machine the
    default of 2 threads took 50 s where 1 took 1.9 s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, cores - busy)


def add_model_args(p):
    p.add_argument("--model", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch (default: the "
                   "cores this process may use, less those busy with other work by the load average)")


def add_cache_args(p, with_policy=True):
    """with_policy=False where --strategies names the policies (eval)."""
    g = p.add_argument_group("KV cache")
    if with_policy:
        g.add_argument("--policy", default="full",
                       help="full | window | h2o | h2o-balanced | h2o-heavy | a spec like "
                            "'h2o:sink=4,heavy=128,recent=124,score=ema,granularity=layer' (default: %(default)s)")
    g.add_argument("--budget", type=positive_int, default=None, help="KV tokens kept per layer (bounded policies; "
                   "default: %(default)s)")
    g.add_argument("--score", choices=["cumulative", "ema", "normalized", "observed"], default=None,
                   help="h2o score")
    g.add_argument("--ema-decay", type=float, default=None, help="h2o ema decay in (0, 1) (default 0.95)")
    g.add_argument("--granularity", choices=["kv-head", "layer"], default=None, help="h2o eviction granularity")
    g.add_argument("--evict-every", type=positive_int, default=None, help="evict once every N tokens")
    g.add_argument("--ada-alpha", type=float, default=None, help="AdaKV budgets for h2o-family policies: a layer's "
                   "heads share its budget, each sure of this fraction of its own share, in [0, 1] (adakv: 0.2)")
    g.add_argument("--pyramid-beta", type=float, default=None, help="PyramidKV budgets for h2o-family policies: "
                   "heavy hitters fall with depth from 2-1/beta to 1/beta of their share, beta >= 1 (pyramidkv: 20)")
    g.add_argument("--pin-prefix", type=nonneg_int, default=0, help="never evict the first N prompt tokens")
    g.add_argument("--prefill-chunk", type=positive_int, default=512, help="prefill chunk length")
    g.add_argument("--kv-bits", default=None, help="8 | 4 | heavy=4,recent=8 (quantized KV; mixed: recent tokens and "
                   "sinks at 8-bit precision, the rest at 4 bits)")
    g.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    g.add_argument("--quantized-kv-start", type=nonneg_int, default=0, help="with --kv-bits: keep full precision "
                   "until the cache holds N tokens")
    g.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of unquantized K/V (default: the model's dtype)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="fp8: the engine's pool stores float8 e4m3 K/V with a scale per token and head (vLLM's flag)")


def check_cache_args(args):
    """Flags that would be silently ignored are refused instead."""
    if args.quantized_kv_start and args.kv_bits is None:
        raise KvboundError(f"--quantized-kv-start {args.quantized_kv_start} has no effect without --kv-bits")


def pinned_spans(args) -> tuple:
    return ((0, args.pin_prefix),) if args.pin_prefix else ()


def cache_options(args):
    """The eval harness's cache settings from the KV-cache flags."""
    from ..eval.strategies import CacheOptions
    check_cache_args(args)
    if args.kv_cache_dtype != "auto":
        raise KvboundError(f"--kv-cache-dtype {args.kv_cache_dtype}: fp8 KV lives in the engine's pool (generate, "
                           "bench, serve); the eval harness's caches take --kv-bits")
    return CacheOptions(kv_dtype=getattr(torch, args.kv_dtype) if args.kv_dtype else None, kv_bits=args.kv_bits,
                        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
                        prefill_chunk=args.prefill_chunk)


def policy_defaults(args) -> dict:
    return dict(score=args.score, ema_decay=args.ema_decay, granularity=args.granularity,
                evict_every=args.evict_every, alpha=args.ada_alpha, beta=args.pyramid_beta)


def make_policy(args):
    """The policy of --policy and its options; options an unbounded cache would ignore are refused."""
    from ..cache import parse_policy
    check_cache_args(args)
    policy = parse_policy(args.policy, args.budget, pinned=pinned_spans(args), exact=True, **policy_defaults(args))
    if not policy.bounded:
        given = [f"--{k.replace('_', '-')}" for k in ("budget", "pin_prefix", "score", "ema_decay", "granularity",
                                                       "evict_every", "ada_alpha", "pyramid_beta")
                 if getattr(args, k) or k in ("ada_alpha", "pyramid_beta") and getattr(args, k) is not None]
        if given:
            raise KvboundError(f"{', '.join(given)} has no effect with --policy {args.policy} (an unbounded cache): "
                               "choose a bounded policy (window, h2o) or drop it")
    return policy


def load_model(args):
    from ..models import load
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise KvboundError(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads or default_threads())
    # Tiny attention probabilities and activations go subnormal, and x86 CPUs compute on subnormals
    # many times slower: flushing them to zero made a decode step 15-30% faster here.
    torch.set_flush_denormal(True)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    model, tok = load(args.model, device=args.device, dtype=dtype)
    return model, tok, dtype


def kv_dtype(args, model_dtype):
    return getattr(torch, args.kv_dtype) if args.kv_dtype else model_dtype


def engine_policy(args):
    """The engine's default policy, checked before the model loads; options the engine cannot honour fail."""
    engine_kv_bits(args)
    check_pool_size(args)
    return make_policy(args)


def engine_kv_bits(args) -> int | str | None:
    """--kv-bits / --kv-cache-dtype for the engine: one width (8, 4 or "fp8"), or heavy=4,recent=8 (a 4-bit pool,
    each sequence's window at 8-bit precision); a full-precision start runs on a single-sequence cache."""
    from ..cache import parse_kv_bits
    bits = parse_kv_bits(args.kv_bits)
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        if bits is not None:
            raise KvboundError(f"give --kv-bits ({args.kv_bits}) or --kv-cache-dtype ({args.kv_cache_dtype}), "
                               "not both")
        return "fp8"
    if bits is not None and getattr(args, "quantized_kv_start", 0):
        raise KvboundError(f"--kv-bits {args.kv_bits}: the engine's block pool packs from the first token; "
                           "--quantized-kv-start runs through `kvbound generate` / `kvbound eval`")
    return bits


def pool_blocks(args, config, kv_dtype) -> int | None:
    """--num-blocks, or the blocks that --kv-cache-memory GiB (or --gpu-memory-utilization) holds (None:
    --kv-cache-tokens decides)."""
    check_pool_size(args)
    gib = utilization_kv_gib(args, config) if getattr(args, "gpu_memory_utilization", None) else args.kv_cache_memory
    if gib is None:
        return args.num_blocks
    bits = engine_kv_bits(args)
    per_block = args.block_size * token_bytes(config, kv_dtype, bits, args.kv_group_size)
    budget = int(gib * 2**30)
    if isinstance(bits, dict):  # mixed widths: each sequence's window residuals come out of the same bytes
        from ..cache.quant import check_mixed_policy, ring_bytes
        policy = engine_policy(args)
        check_mixed_policy(policy)
        rings = ring_bytes(config, policy, args.kv_group_size) * (args.max_num_seqs + 1)
        budget -= rings
        print(f"KV pool: {rings / 2**30:.2f} GiB of {gib:.3g} go to the window residuals of {args.max_num_seqs} "
              "sequences (--max-num-seqs)", file=sys.stderr)
    blocks = budget // per_block
    if blocks < 1:
        raise KvboundError(f"--kv-cache-memory {gib:.3g} GiB holds no block of {per_block:,} bytes")
    return blocks


def check_pool_size(args):
    """One of --num-blocks / --kv-cache-memory / --gpu-memory-utilization, the last one on a GPU."""
    given = [f for f in ("num_blocks", "kv_cache_memory", "gpu_memory_utilization") if getattr(args, f, None)]
    if len(given) > 1:
        raise KvboundError(f"give one of --{' / --'.join(f.replace('_', '-') for f in given)}, not several")
    util = getattr(args, "gpu_memory_utilization", None)
    if util is None:
        return
    if not 0 < util <= 1:
        raise KvboundError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if not str(args.device).startswith("cuda") or not torch.cuda.is_available():
        raise KvboundError(f"--gpu-memory-utilization sizes the pool from GPU memory, but the device is "
                           f"{args.device}; give --kv-cache-memory GiB")


def activation_bytes(config, batched_tokens: int, seqs: int) -> int:
    """A step's activations at most, estimated: a prefill step's hidden states, q/k/v and MLP rows (bf16), the
    rows' fp32 logits and their sampling copy, and 256 MiB for CUDA graphs and kernel workspaces."""
    per_token = 4 * config.hidden_size + (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token += 3 * config.intermediate_size
    return batched_tokens * per_token * 2 + seqs * config.vocab_size * 4 * 2 + 256 * 2**20


def utilization_kv_gib(args, config) -> float:
    """vLLM's --gpu-memory-utilization: the KV pool gets that fraction of the GPU's memory, less what is in use
    now (weights, the CUDA context, other processes) and the activations' estimate (`activation_bytes`)."""
    util = args.gpu_memory_utilization
    free, total = torch.cuda.mem_get_info(torch.device(args.device))
    reserve = activation_bytes(config, args.max_num_batched_tokens, args.max_num_seqs)
    kv = util * total - (total - free) - reserve
    gib = 2.0**30
    if kv <= 0:
        raise KvboundError(f"--gpu-memory-utilization {util}: {util} x {total / gib:.1f} GiB leaves nothing for the "
                           f"KV cache after {(total - free) / gib:.2f} GiB in use and {reserve / gib:.2f} GiB for "
                           "activations")
    print(f"KV pool from --gpu-memory-utilization {util}: {util} x {total / gib:.1f} GiB - {(total - free) / gib:.2f} "
          f"GiB in use - {reserve / gib:.2f} GiB for activations = {kv / gib:.2f} GiB", file=sys.stderr)
    return kv / gib


def make_engine(args, model, tok, dtype):
    from ..engine import LLMEngine
    kv = kv_dtype(args, dtype)
    return LLMEngine(model, tok, policy=engine_policy(args), block_size=args.block_size,
                     num_blocks=pool_blocks(args, model.config, kv),
                     kv_cache_tokens=args.kv_cache_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs, prefill_chunk=args.prefill_chunk,
                     kv_dtype=kv, kv_bits=engine_kv_bits(args), kv_group_size=args.kv_group_size,
                     kv_storage=args.kv_storage, swap_space=args.swap_space,
                     kv_offloading_size=args.kv_offloading_size, async_scheduling=args.async_scheduling)


def token_bytes(config, kv_dtype, kv_bits: int | None, group_size: int) -> int:
    """Bytes of one token's K/V over all layers in the pool: at kv_dtype, or packed (codes plus an fp16 scale and
    bias per group, `cache.quant.PackedKV`); mixed widths' pool is 4-bit (the windows' residuals are per sequence)."""
    if isinstance(kv_bits, dict):
        kv_bits = kv_bits["heavy"]
    if kv_bits is None:
        return config.kv_bytes_per_token(torch.finfo(kv_dtype).bits // 8)
    from ..cache.quant import packed_head_bytes
    head = config.head_dim + 2 if kv_bits == "fp8" else packed_head_bytes(config.head_dim, kv_bits, group_size)
    return 2 * config.num_layers * config.num_kv_heads * head


def add_engine_args(p):
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--num-blocks", type=positive_int, default=None, help="KV pool blocks (default: "
                   "--kv-cache-tokens / --block-size)")
    g.add_argument("--kv-cache-tokens", type=positive_int, default=16384)
    g.add_argument("--kv-cache-memory", type=positive_gib, default=None, metavar="GiB",
                   help="size the KV pool by memory instead: GiB of K/V, or a size such as 512MiB (sets the number "
                   "of blocks)")
    g.add_argument("--kv-storage", choices=("paged", "virtual"), default="paged",
                   help="virtual: reserve the pool and commit GPU pages only under the blocks in use, giving them "
                   "back when idle (CUDA driver virtual memory; dense with the same accounting elsewhere)")
    g.add_argument("--swap-space", type=nonneg_gib, default=4.0, metavar="GiB",
                   help="host memory for preempted sequences' KV blocks, restored on resume instead of "
                   "recomputed (0: recompute)")
    g.add_argument("--kv-offloading-size", type=nonneg_gib, default=0.0, metavar="GiB",
                   help="host memory for prefix-cache blocks evicted from the pool, copied back when a request "
                   "shares their prefix instead of recomputed (0: off)")
    g.add_argument("--gpu-memory-utilization", type=positive_float, default=None, metavar="F",
                   help="size the KV pool as vLLM does: fraction F of the GPU's memory for this engine, less the "
                   "memory in use after loading and an estimate of the activations")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="read a step's tokens while the GPU runs the next one (default: on CUDA)")
