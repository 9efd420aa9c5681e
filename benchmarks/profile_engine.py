"""cProfile of the engine's decode steps on the GPU (random SmolLM2-shape weights): where a step's time goes.

PYTHONPATH=src python benchmarks/profile_engine.py --seqs 64
"""
import argparse
import cProfile
import pstats

import torch

from engine_throughput import models, prompts, run_engine, sync_time

from kvbound.policies import FullPolicy

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="smollm2")
ap.add_argument("--seqs", type=int, default=256)
ap.add_argument("--input-len", type=int, default=128)
ap.add_argument("--output-len", type=int, default=128)
ap.add_argument("--policy", default=None)
ap.add_argument("--mnbt", type=int, default=8192)
ap.add_argument("--torch-profile", action="store_true")
ap.add_argument("--steady", action="store_true")
ap.add_argument("--blocks", type=int, default=11650)
args = ap.parse_args()
hf, ours = models(args.shape, torch.bfloat16)
del hf
pol = None
if args.policy:
    from kvbound.policies import parse_policy
    pol = parse_policy(args.policy)
reqs = prompts(args.seqs, args.input_len, ours.config.vocab_size)
if not args.steady:
    run_engine(ours, reqs[:4], 8, policy=pol)
if args.steady:  # profile steady decode steps of as many `--context`-token requests as fit (--policy)
    from engine_throughput import steady_decode
    r = steady_decode(ours, pol or FullPolicy(), args.blocks, args.input_len, args.seqs, ours.config.vocab_size,
                      profile=True)
    print(r)
elif args.torch_profile:  # GPU kernel time by kernel
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = run_engine(ours, reqs, args.output_len, policy=pol, max_num_seqs=args.seqs, mnbt=args.mnbt)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
else:
    pr = cProfile.Profile()
    pr.enable()
    t0 = sync_time()
    out = run_engine(ours, reqs, args.output_len, policy=pol, max_num_seqs=args.seqs, mnbt=args.mnbt)
    t1 = sync_time()
    pr.disable()
    print("seconds", t1 - t0, "result", out[:4])
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
