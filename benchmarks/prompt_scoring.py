"""What scoring a prompt costs on a single-sequence cache (issue #18): the prefill of one prompt in one piece under
the full cache, policies that score as they read (snapkv, keydiff) and kvzip, which reads the prompt twice
(`cache/reconstruct.py`). Random weights in a model's shape, on CUDA; the median of 5 timed prefills after 2.

    PYTHONPATH=src python3 benchmarks/prompt_scoring.py --shape smollm2 --context 4096 --budget 1024 --out $OUT

--profile prints, per policy, where one more prefill's GPU time goes (torch.profiler, by kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from engine_throughput import models  # benchmarks/ is on the path as the script's folder
from kvbound.cache import parse_policy, sequence_cache
from kvbound.engine.generate import prefill


def timed_prefill(model, spec: str, ids, budget: int) -> float:
    """Milliseconds of one prefill of `ids` in one piece into a fresh cache under `spec`."""
    pol = parse_policy(spec, budget=budget)
    times = []
    for i in range(7):
        cache = sequence_cache(model.config, pol, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefill(model, cache, ids, len(ids))
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profiled_prefill(model, spec: str, ids, budget: int):
    """Print the GPU time of one prefill under `spec` by operator, the largest first."""
    from torch.profiler import ProfilerActivity, profile
    cache = sequence_cache(model.config, parse_policy(spec, budget=budget), device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(model, cache, ids, len(ids))
        torch.cuda.synchronize()
    print(f"===== {spec}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--policies", default="full,snapkv,keydiff,kvzip,kvzip:alpha=0.2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="also profile one prefill per policy")
    args = ap.parse_args()
    _, model = models(args.shape, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (args.context,), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    rows = {spec: timed_prefill(model, spec, ids, args.budget) for spec in args.policies.split(",")}
    full = rows.get("full")
    print(f"{args.shape}, {args.context}-token prompt in one piece, budget {args.budget}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'policy':24s} {'prefill ms':>10s} {'x full':>7s}")
    for spec, ms in rows.items():
        print(f"{spec:24s} {ms:10.1f} {ms / full if full else float('nan'):7.2f}")
    for spec in args.policies.split(",") if args.profile else ():
        profiled_prefill(model, spec, ids, args.budget)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"prompt_scoring_{args.shape}.json"), "w") as f:
            json.dump(dict(vars(args), device=torch.cuda.get_device_name(), prefill_ms=rows), f, indent=1)


if __name__ == "__main__":
    main()
