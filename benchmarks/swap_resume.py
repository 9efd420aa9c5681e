"""Resume of a preempted long sequence: swap-in of its blocks from host memory against recomputing them.

One request of `--context` prompt tokens decodes a few tokens, is preempted (its blocks copied to host memory
with --swap-space, or dropped) and its freed blocks reused (the prefix cache forgets them, as under the memory
pressure that preempts), then resumes: the time from then to its next token, and the preemption's own cost
(the copy out). Random weights in a real shape.

    PYTHONPATH=src:benchmarks python3 benchmarks/swap_resume.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvbound.engine import LLMEngine, SamplingParams
from workloads import SHAPES, build, sync


def flush_prefix_cache(pool):
    taken = [pool.allocate() for _ in range(pool.num_free)]
    for b in taken:
        pool.decref(b)


def resume(model, context: int, swap_space: float, device) -> dict:
    eng = LLMEngine(model, num_blocks=-(-(context + 64) // 16) + 8, max_num_batched_tokens=8192,
                    prefill_chunk=2048, swap_space=swap_space, cuda_graphs=False)
    prompt = torch.randint(1, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    rid = eng.add_request(prompt.tolist(), SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(context // 2048 + 4):  # the prompt, then a few decode steps
        eng.step()
    seq = eng.requests[rid][0]
    sched = eng.scheduler
    sync(device)
    t0 = time.perf_counter()
    sched.preempt(seq)
    sync(device)
    t1 = time.perf_counter()
    flush_prefix_cache(eng.pool)  # as under the memory pressure that preempts: its freed blocks are reused
    t1b = time.perf_counter()
    before = len(seq.output)
    while len(seq.output) == before:
        eng.step()
    sync(device)
    t2 = time.perf_counter()
    out = dict(preempt_ms=1000 * (t1 - t0), resume_ms=1000 * (t2 - t1b), steps=sched.stats["steps"],
               recomputed_tokens=sched.stats["recomputed_tokens"], swapped_in_blocks=sched.stats["swapped_in_blocks"])
    eng.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    resume(model, 512, 4.0, device)  # warm the kernels
    res = {"shape": args.shape, "context": args.context, "device": str(torch.cuda.get_device_name()
                                                                       if device.type == "cuda" else "cpu")}
    for name, swap in (("recompute", 0.0), ("swap-in", 4.0), ("recompute again", 0.0), ("swap-in again", 4.0)):
        res[name] = resume(model, args.context, swap, device)
    print(f"{args.shape}, one {args.context}-token sequence preempted after a few decode steps, {res['device']}")
    print(f"{'resume by':<16} {'preempt ms':>11} {'to next token ms':>17} {'recomputed tokens':>18} {'blocks swapped in':>18}")
    for name in ("recompute", "swap-in", "recompute again", "swap-in again"):
        r = res[name]
        print(f"{name:<16} {r['preempt_ms']:>11.2f} {r['resume_ms']:>17.2f} {r['recomputed_tokens']:>18} "
              f"{r['swapped_in_blocks']:>18}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"swap_resume_{args.shape}.json"), "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
