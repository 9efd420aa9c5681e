"""Diagnose steady-state bounded decode on the GPU: per step, whether a CUDA graph ran and how long it took.

PYTHONPATH=src:benchmarks python benchmarks/diag_steady.py [--seqs 256] [--context 512]
"""
import argparse
import time

import torch

from engine_throughput import models, prompts
from kvbound.engine import LLMEngine
from kvbound.generate import SamplingParams
from kvbound.policies import H2OPolicy, FullPolicy

ap = argparse.ArgumentParser()
ap.add_argument("--seqs", type=int, default=256)
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--full", action="store_true")
args = ap.parse_args()
_, model = models("smollm2", torch.bfloat16)
pol = FullPolicy() if args.full else H2OPolicy(sink=4, heavy=128, recent=124)
eng = LLMEngine(model, None, policy=pol, num_blocks=11650, max_num_seqs=args.seqs, max_num_batched_tokens=8192,
                prefill_chunk=512)
for p in prompts(args.seqs, args.context, model.config.vocab_size, 1):
    eng.add_request(p, SamplingParams(max_tokens=1024, ignore_eos=True))
while eng.scheduler.waiting or any(s.to_feed() > 1 for s in eng.scheduler.running):
    eng.step()
ran = []
orig = eng.graphs.run
eng.graphs.run = lambda batch: (lambda out: (ran.append(out is not None), out)[1])(orig(batch))
sched = eng.scheduler.schedule
parts = {"schedule": 0.0, "graph": 0.0}


def timed_schedule():
    t = time.perf_counter()
    out = sched()
    parts["schedule"] += time.perf_counter() - t
    return out


eng.scheduler.schedule = timed_schedule
for i in range(24):
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.step(only_finished=True)
    torch.cuda.synchronize()
    print(f"step {i}: graph {ran[-1]} {1e3 * (time.perf_counter() - t):.2f} ms, running {len(eng.scheduler.running)}")
print("schedule total ms", 1e3 * parts["schedule"])
import cProfile, pstats  # noqa: E402
pr = cProfile.Profile()
pr.enable()
for _ in range(8):
    eng.step(only_finished=True)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
