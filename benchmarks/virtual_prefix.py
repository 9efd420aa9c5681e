"""Requests sharing a long system prompt, on the paged pool and on virtual storage (issue #20).

`--requests` prompts share a `--prefix`-token system prompt, each followed by `--suffix` tokens of its own.
The first request runs alone, so its prefix is in the prefix cache; then all the others run at once. Reported
per storage: the KV memory in use once every request is admitted (paged: the blocks held, the prefix once;
virtual: the pages committed, whose shared prefix pages are mapped into every stripe once), the prefill rate
of the batch, and the decode step. Random weights in a real shape.

    PYTHONPATH=src:benchmarks python3 benchmarks/virtual_prefix.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvbound.engine import LLMEngine, SamplingParams
from workloads import SHAPES, build, sync


def run(model, storage: str, args, device) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    system = torch.randint(1, vocab, (args.prefix,), generator=gen).tolist()
    prompts = [system + torch.randint(1, vocab, (args.suffix,), generator=gen).tolist() for _ in range(args.requests)]
    need = args.requests * -(-(args.prefix + args.suffix + args.max_tokens) // 16) + 64
    eng = LLMEngine(model, num_blocks=need, max_num_seqs=args.requests, max_num_batched_tokens=8192,
                    prefill_chunk=2048, kv_storage=storage)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    eng.add_request(prompts[0], params)
    while eng.has_unfinished():
        eng.step()
    for p in prompts[1:]:
        eng.add_request(p, params)
    t0 = sync(device)
    while any(s.to_feed() > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    t1 = sync(device)
    pool = eng.pool
    in_use = pool.committed_bytes if storage == "virtual" else sum(r > 0 for r in pool.ref) * pool.block_bytes
    steps = 0
    while eng.has_unfinished() and steps < 16:
        eng.step(only_finished=True)
        steps += 1
    t2 = sync(device)
    res = dict(storage=storage, kv_in_use_gib=in_use / 2**30, prefill_tok_s=(len(prompts) - 1) * args.suffix / (t1 - t0),
               step_ms=1000 * (t2 - t1) / max(1, steps), hit_tokens=eng.scheduler.stats["prefix_hit_tokens"],
               blocks_copied=pool.copies,
               pages_shared=pool.pages.counts["shared"] if pool.pages is not None else 0)
    eng.close()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--requests", type=int, default=33)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build(args.shape, device, torch.bfloat16)
    rows = [run(model, storage, args, device) for storage in ("paged", "virtual", "paged", "virtual")]
    print(f"{args.requests} requests: a {args.prefix}-token shared prefix + {args.suffix} tokens each, {args.shape} "
          f"on {torch.cuda.get_device_name()}")
    print(f"{'storage':<8} {'KV in use GiB':>14} {'prefill tok/s':>14} {'step ms':>8} {'hit tokens':>11} "
          f"{'blocks copied':>14} {'pages shared':>13}")
    for r in rows:
        print(f"{r['storage']:<8} {r['kv_in_use_gib']:>14.3f} {r['prefill_tok_s']:>14.0f} {r['step_ms']:>8.2f} "
              f"{r['hit_tokens']:>11} {r['blocks_copied']:>14} {r['pages_shared']:>13}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"virtual_prefix_{args.shape}.json"), "w") as f:
            json.dump(dict(vars(args), rows=rows, device=torch.cuda.get_device_name()), f, indent=2)


if __name__ == "__main__":
    main()
