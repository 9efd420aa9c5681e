"""Engine start-up on the lent GPU: the seconds from `LLMEngine(...)` to the end of each policy's first requests,
and what they go to (Triton compiles, CUDA graph captures), with Triton's on-disk cache empty and then warm.

Every GPU run of the engine (serve, generate, eval --engine) pays this once per process. Random weights in a real
shape, a word-level tokenizer; each policy runs the same batch twice: the first pays its compiles and graphs, the
second is the steady cost of the same work.

PYTHONPATH=src python benchmarks/engine_startup.py --shape smollm2 --out $OUT
Prints a table last; --out DIR writes engine_startup_<shape>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PHASES = ("engine", "first", "again")


def instrument():
    """Seconds and counts of Triton compiles (JIT specializations this process builds or loads from disk) and
    of CUDA graph captures, the captures' own time net of the compiles inside their warm-up runs."""
    from triton.runtime.jit import JITFunction
    from kvbound.engine.cuda_graphs import DecodeGraphs
    tally = dict(compile_s=0.0, compiles=0, capture_s=0.0, captures=0)
    inner = {"compile": 0.0}
    do_compile, capture = JITFunction._do_compile, DecodeGraphs._capture

    def timed_compile(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return do_compile(self, *a, **k)
        finally:
            dt = time.perf_counter() - t0
            tally["compile_s"] += dt
            tally["compiles"] += 1
            inner["compile"] += dt

    def timed_capture(self, *a, **k):
        before, t0 = inner["compile"], time.perf_counter()
        try:
            return capture(self, *a, **k)
        finally:
            tally["capture_s"] += time.perf_counter() - t0 - (inner["compile"] - before)
            tally["captures"] += 1

    JITFunction._do_compile, DecodeGraphs._capture = timed_compile, timed_capture
    return tally


def child(args):
    import torch
    tally = instrument()
    from kvbound.cache.policies import parse_policy
    from kvbound.engine import LLMEngine, SamplingParams
    from kvbound.eval.bench import random_prompts
    from kvbound.models import load
    from serve_gpu import random_model_dir  # benchmarks/ is on the path as the script's folder

    rows = []

    def phase(name, policy, fn):
        torch.cuda.synchronize()
        before, t0 = dict(tally), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        row = {"phase": name, "policy": policy, "s": time.perf_counter() - t0}
        row.update({k: tally[k] - before[k] for k in tally})
        rows.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as d:
        random_model_dir(d, args.shape)
        model, tok = load(d, device="cuda", dtype=torch.bfloat16)
    holder = {}
    phase("engine", "", lambda: holder.setdefault("eng", LLMEngine(
        model, tok, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)))
    eng = holder["eng"]
    prompts = random_prompts(args.batch, args.prompt_len, model.config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def run(policy):
        for p in prompts:
            eng.add_request(p, params, policy)
        while eng.has_unfinished():
            eng.step(only_finished=True)

    for spec in args.policies.split(","):
        policy = parse_policy(spec, args.budget)
        phase("first", spec, lambda: run(policy))
        phase("again", spec, lambda: run(policy))
    with open(args.child_out, "w") as f:
        json.dump(rows, f)


def table(runs):
    """One row per (phase, policy): seconds with the cache empty and warm, each with its compiles and captures."""
    lines = ["| phase | policy | cold cache s | compiles (s) | captures (s net) | warm cache s | compiles (s) |",
             "|---|---|---|---|---|---|---|"]
    for cold, warm in zip(runs["cold"], runs["warm"]):
        lines.append(f"| {cold['phase']} | {cold['policy'] or '-'} | {cold['s']:.2f} | {cold['compiles']} "
                     f"({cold['compile_s']:.2f}) | {cold['captures']} ({cold['capture_s']:.2f}) | {warm['s']:.2f} | "
                     f"{warm['compiles']} ({warm['compile_s']:.2f}) |")
    for key in ("cold", "warm"):
        total = sum(r["s"] for r in runs[key] if r["phase"] != "again")
        lines.append(f"\n{key} cache: {total:.1f} s from the engine's construction to the end of every policy's "
                     f"first batch, {sum(r['compile_s'] for r in runs[key]):.1f} s of it in Triton compiles")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-0.6b", "8b"))
    ap.add_argument("--policies", default="full,window,h2o-heavy,observed")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_out:
        return child(args)
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        for key in ("cold", "warm"):  # the second process finds the first one's kernels on disk
            out = os.path.join(cache, f"{key}.json")
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child-out", out], env=env, check=True)
            with open(out) as f:
                runs[key] = json.load(f)
    import torch
    res = {"device": torch.cuda.get_device_name(), "args": vars(args), "runs": runs}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"engine_startup_{args.shape}.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{args.shape} on {res['device']}, bf16, random weights; {args.batch} requests x {args.prompt_len} "
          f"prompt tokens x {args.max_tokens} out, max_num_seqs {args.max_num_seqs}, budget {args.budget}\n")
    print(table(runs))


if __name__ == "__main__":
    main()
