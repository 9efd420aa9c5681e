"""Decode steps whose rows run under several policies, on the lent GPU: full caches beside bounded ones, several
budgets side by side (a server whose requests bring their own KV bound; `eval ... --engine`, which runs every
strategy in one batch). Decode tokens/s with all rows decoding, how many of those steps replayed a CUDA graph,
and `eval ppl --engine`'s scoring rate (teacher tokens, logprobs every step) over the same policies.

Random weights in a real shape. Runs against whichever kvbound is on the path, so two trees compare side by side:
PYTHONPATH=src python benchmarks/mixed_policies.py --shape smollm2 --tag new --out $OUT
PYTHONPATH=old/src python benchmarks/mixed_policies.py --shape smollm2 --tag old --out $OUT
Prints a table last; --out DIR writes mixed_policies_<shape>_<tag>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

MIXES = {  # name -> the policies of its requests, in turn
    "full": ["full"],
    "h2o": ["h2o-heavy"],
    "full + h2o": ["full", "h2o-heavy"],
    "full + window + h2o + observed": ["full", "window", "h2o-heavy", "observed"],
    "h2o at 4 budgets": ["h2o:sink=4,heavy=124,recent=128", "h2o:sink=4,heavy=252,recent=256",
                         "h2o:sink=4,heavy=60,recent=64", "h2o:sink=4,heavy=188,recent=192"],
    "keydiff, head budgets (AdaKV)": ["keydiff:alpha=0.2"],
    "full + 7 bounded (eval ruler's)": ["full", "window", "h2o-heavy", "observed", "tova", "snapkv", "knorm",
                                        "keydiff"],
}


def counted_graph_steps():
    """Counts of decode steps the CUDA graphs ran, of those they passed to the eager path, and of captures."""
    from kvbound.engine.cuda_graphs import DecodeGraphs
    tally = {"graph": 0, "eager": 0, "captures": 0}
    run, capture = DecodeGraphs.run, DecodeGraphs._capture

    def counted(self, *a, **k):
        logits = run(self, *a, **k)
        tally["eager" if logits is None else "graph"] += 1
        return logits

    def counted_capture(self, *a, **k):
        tally["captures"] += 1
        return capture(self, *a, **k)

    DecodeGraphs.run, DecodeGraphs._capture = counted, counted_capture
    return tally


def decode_rate(model, mix, args, tally):
    """Decode tokens/s over the steps where every running row decodes (less those that captured a graph: each
    engine captures a policy's graphs when first used), and the share of all its steps (prefill included) in graphs."""
    from kvbound.cache.policies import parse_policy
    from kvbound.engine import LLMEngine, SamplingParams
    from kvbound.eval.bench import random_prompts
    policies = [parse_policy(spec, args.budget) for spec in mix]
    eng = LLMEngine(model, None, max_num_seqs=args.requests, max_num_batched_tokens=8192,
                    kv_cache_tokens=args.requests * (args.prompt_len + args.max_tokens + 64))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i, p in enumerate(random_prompts(args.requests, args.prompt_len, model.config.vocab_size)):
        eng.add_request(p, params, policies[i % len(policies)])
    tokens, seconds, before = 0, 0.0, dict(tally)
    while eng.has_unfinished():
        decoding = not eng.scheduler.waiting and all(s.to_feed() == 1 for s in eng.scheduler.running)
        rows, captures = len(eng.scheduler.running), tally["captures"]
        t0 = time.perf_counter()
        eng.step(only_finished=True)
        if decoding and rows and tally["captures"] == captures:
            tokens, seconds = tokens + rows, seconds + time.perf_counter() - t0
    torch.cuda.synchronize()
    eng.close()
    steps = {k: tally[k] - before[k] for k in ("graph", "eager")}
    return tokens / seconds, steps["graph"] / max(1, steps["graph"] + steps["eager"])


def ppl_rate(model, args):
    """`eval ppl --engine`'s tokens scored per second: the baseline and `--ppl-strategies`, one batch."""
    from kvbound.eval.perplexity import engine_perplexity
    from kvbound.eval.strategies import CacheOptions, parse_strategies
    from kvbound.eval.bench import random_prompts
    options = CacheOptions()
    strategies = parse_strategies(["baseline", *args.ppl_strategies.split(",")], args.budget, options)
    samples = random_prompts(args.ppl_samples, args.ppl_len, model.config.vocab_size, seed=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine_perplexity(model, samples, strategies, options, prefill=args.budget, progress=False)
    torch.cuda.synchronize()
    return len(strategies) * args.ppl_samples * (args.ppl_len - args.budget) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-0.6b", "8b"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES), help="the mixes to run")
    ap.add_argument("--ppl-samples", type=int, default=4, help="0: no eval ppl --engine rate")
    ap.add_argument("--ppl-len", type=int, default=1024)
    ap.add_argument("--ppl-strategies", default="window,h2o-heavy,observed", help="beside the baseline")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kvbound
    from kvbound.models import load
    from serve_gpu import random_model_dir  # benchmarks/ is on the path as the script's folder
    tally = counted_graph_steps()
    with tempfile.TemporaryDirectory() as d:
        random_model_dir(d, args.shape)
        model, _ = load(d, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for name in args.mixes:
        mix = MIXES[name]
        decode_rate(model, mix, args, tally)  # warm: compiles and graph captures
        rate, graphed = decode_rate(model, mix, args, tally)
        rows[name] = {"decode_tok_s": rate, "graph_share": graphed}
        print(json.dumps({name: rows[name]}), flush=True)
    ppl = ppl_rate(model, args) and ppl_rate(model, args) if args.ppl_samples else None
    res = {"device": torch.cuda.get_device_name(), "kvbound": os.path.dirname(kvbound.__file__), "args": vars(args),
           "decode": rows, "ppl_tok_s": ppl}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"mixed_policies_{args.shape}_{args.tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{args.shape} on {res['device']}, bf16, random weights, kvbound from {res['kvbound']}; "
          f"{args.requests} requests x {args.prompt_len} prompt tokens x {args.max_tokens} out, budget {args.budget}")
    print("| requests' policies (in turn) | decode tok/s | steps in graphs (prefill runs eagerly) |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['decode_tok_s']:,.0f} | {r['graph_share']:.0%} |")
    if ppl is not None:
        print(f"eval ppl --engine (baseline, {args.ppl_strategies.replace(',', ', ')}; {args.ppl_samples} x "
              f"{args.ppl_len} tokens): {ppl:,.0f} tokens scored/s")


if __name__ == "__main__":
    main()
