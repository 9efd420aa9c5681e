"""cProfile of the engine's decode steps on the GPU (random SmolLM2-shape weights): where a step's time goes.

PYTHONPATH=src python benchmarks/profile_engine.py --seqs 64
"""
import argparse
import cProfile
import pstats

import torch

from engine_throughput import models, prompts, run_engine, sync_time

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="smollm2")
ap.add_argument("--seqs", type=int, default=64)
ap.add_argument("--policy", default=None)
args = ap.parse_args()
hf, ours = models(args.shape, torch.bfloat16)
del hf
pol = None
if args.policy:
    from kvbound.policies import parse_policy
    pol = parse_policy(args.policy)
reqs = prompts(args.seqs, 128, ours.config.vocab_size)
run_engine(ours, reqs[:4], 8, policy=pol)
pr = cProfile.Profile()
pr.enable()
t0 = sync_time()
out = run_engine(ours, reqs, 64, policy=pol)
t1 = sync_time()
pr.disable()
print("seconds", t1 - t0, "result", out[:4])
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
