"""`kvbound bench throughput` (offline) and `kvbound bench serve` (open loop, Poisson arrivals).

Prompts are random token ids of a fixed length (vLLM's random dataset); every request generates exactly
`--output-len` tokens (EOS ignored), so runs are comparable across policies and machines.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .config import KvboundError
from .engine import LLMEngine
from .generate import SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def engine_policy(args):
    """The engine's default policy, checked before the model loads; options the engine cannot honour fail."""
    from .cli import make_policy
    if args.kv_bits is not None:
        raise KvboundError(f"--kv-bits {args.kv_bits}: the engine's block pool stores K/V unquantized "
                           "(quantized KV runs through `kvbound generate` / `kvbound eval`)")
    return make_policy(args)


def make_engine(args, model, tok, dtype):
    from .cli import kv_dtype
    return LLMEngine(model, tok, policy=engine_policy(args), block_size=args.block_size, num_blocks=args.num_blocks,
                     kv_cache_tokens=args.kv_cache_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs, prefill_chunk=args.prefill_chunk,
                     kv_dtype=kv_dtype(args, dtype))


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def cmd_throughput(args):
    from .cli import load_model
    engine_policy(args)
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    prompts = random_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    peak = 0
    bar = tqdm(total=args.num_prompts, desc="throughput", unit="req")
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step(only_finished=True)
        peak = max(peak, len(engine.scheduler.running))
        bar.update(sum(o.finished for o in outs))
    if torch.cuda.is_available() and str(engine.device).startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    bar.close()
    n_out = args.num_prompts * args.output_len
    res = {"requests": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
           "policy": engine.default_policy.describe(), "elapsed_s": elapsed,
           "requests_per_s": args.num_prompts / elapsed, "output_tokens_per_s": n_out / elapsed,
           "total_tokens_per_s": (n_out + args.num_prompts * args.input_len) / elapsed,
           "peak_running": peak, **engine.scheduler.stats}
    print(f"{res['requests']} requests x ({args.input_len} in, {args.output_len} out), policy {res['policy']}")
    print(f"elapsed {elapsed:.2f} s   {res['requests_per_s']:.2f} req/s   {res['output_tokens_per_s']:.1f} output tok/s"
          f"   {res['total_tokens_per_s']:.1f} total tok/s   peak running {peak}   preemptions {res['preemptions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def cmd_serve(args):
    """Open loop: requests arrive on a Poisson clock whether or not the engine keeps up."""
    from .cli import load_model
    if args.rate <= 0 or args.duration <= 0:
        raise KvboundError(f"--rate and --duration must be > 0, got {args.rate} and {args.duration}")
    engine_policy(args)
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    arrivals = poisson_arrivals(args.rate, args.duration, args.seed)
    if not arrivals:
        raise KvboundError(f"no request arrives in {args.duration} s at {args.rate}/s: raise --rate or --duration")
    prompts = random_prompts(len(arrivals), args.input_len, model.config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    done, steps, sent = {}, [], 0
    cuda = str(engine.device).startswith("cuda")
    bar = tqdm(total=len(arrivals), desc="serve", unit="req")
    t0 = time.perf_counter()
    while sent < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while sent < len(arrivals) and arrivals[sent] <= now:
            engine.add_request(prompts[sent], params, request_id=str(sent))
            sent += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        if cuda:
            torch.cuda.synchronize()
        s1 = time.perf_counter()
        steps.append({"t": s0 - t0, "ms": 1000 * (s1 - s0), "running": len(engine.scheduler.running)})
        for o in outs:
            if o.finished:
                done[int(o.request_id)] = o
                bar.update(1)
    bar.close()
    res = serve_report(arrivals, done, steps, t0, args)
    Path(args.json).write_text(json.dumps(res, indent=2))
    serve_plot(res, steps, args.plot)
    print(f"json: {args.json}  plot: {args.plot}")
    return res


def serve_report(arrivals, done, steps, t0, args) -> dict:
    reqs = []
    for i, a in enumerate(arrivals):
        o = done[i]
        times = [t - t0 for t in o.token_times]
        reqs.append({"arrival": a, "ttft": times[0] - a,
                     "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
                     "tokens": len(times), "token_times": times})
    end = max(s["t"] + s["ms"] / 1000 for s in steps)
    median_step = pct([s["ms"] for s in steps], 50)
    spike_ms = args.spike_ms if args.spike_ms else 3 * median_step
    phases = {"ramp": (0.0, 0.2 * args.duration), "steady": (0.2 * args.duration, args.duration),
              "tail": (args.duration, end)}
    report = {"config": {k: getattr(args, k) for k in ("rate", "duration", "input_len", "output_len", "seed",
                                                       "max_num_seqs", "max_num_batched_tokens", "policy",
                                                       "budget")},
              "requests": len(reqs), "elapsed_s": end, "spike_ms": spike_ms}
    report.update(_summary(reqs, steps, 0.0, end, spike_ms))
    report["phases"] = {name: _summary([r for r in reqs if a <= r["arrival"] < b], steps, a, b, spike_ms)
                        for name, (a, b) in phases.items()}
    print(f"{len(reqs)} requests at {args.rate}/s over {args.duration} s (drained at {end:.1f} s); "
          f"decode steps slower than {spike_ms:.1f} ms count as spikes")
    print(f"{'phase':<8} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'steps':>6} {'spikes':>7} {'spike s':>8}")
    for name, s in [("all", report)] + list(report["phases"].items()):
        print(f"{name:<8} {s['n']:>5} {s['output_tokens_per_s']:>10.1f} {1000 * s['ttft_p50']:>7.0f}ms "
              f"{1000 * s['ttft_p99']:>7.0f}ms {1000 * s['tpot_p50']:>7.1f}ms {1000 * s['tpot_p99']:>7.1f}ms "
              f"{s['steps']:>6} {s['spikes']:>7} {s['spike_time_s']:>8.2f}")
    for r in reqs:
        del r["token_times"]
    report["per_request"] = reqs
    return report


def _summary(reqs, steps, a, b, spike_ms) -> dict:
    """Latencies of the requests that arrived in [a, b), and the engine's output and steps inside [a, b)."""
    window = [s for s in steps if a <= s["t"] < b]
    spikes = [s for s in window if s["ms"] > spike_ms]
    tokens = sum(1 for r in reqs for t in r.get("token_times", []) if a <= t < b)
    return {"n": len(reqs), "output_tokens_per_s": tokens / (b - a) if b > a else float("nan"),
            "ttft_p50": pct([r["ttft"] for r in reqs], 50), "ttft_p99": pct([r["ttft"] for r in reqs], 99),
            "tpot_p50": pct([r["tpot"] for r in reqs if r["tpot"] == r["tpot"]], 50),
            "tpot_p99": pct([r["tpot"] for r in reqs if r["tpot"] == r["tpot"]], 99),
            "steps": len(window), "step_ms_p50": pct([s["ms"] for s in window], 50),
            "step_ms_p99": pct([s["ms"] for s in window], 99), "spikes": len(spikes),
            "spike_time_s": sum(s["ms"] for s in spikes) / 1000}


def serve_plot(res, steps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    t = [s["t"] for s in steps]
    ax1.plot(t, [s["running"] for s in steps], lw=1)
    ax1.set_ylabel("running sequences")
    ax2.plot(t, [s["ms"] for s in steps], lw=0.8, label="step time")
    spikes = [s for s in steps if s["ms"] > res["spike_ms"]]
    ax2.scatter([s["t"] for s in spikes], [s["ms"] for s in spikes], color="red", s=8, label="spike", zorder=3)
    ax2.axhline(res["spike_ms"], color="red", lw=0.6, ls="--")
    ax2.set_ylabel("step ms")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right", fontsize=8)
    for ax in (ax1, ax2):
        for x in (0.2 * res["config"]["duration"], res["config"]["duration"]):
            ax.axvline(x, color="gray", lw=0.6, ls=":")
    ax1.set_title(f"{res['requests']} requests at {res['config']['rate']}/s (ramp | steady | tail)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_bench_parser(sub):
    from .cli import _positive_int, add_cache_args, add_model_args
    b = sub.add_parser("bench", help="engine benchmarks: offline throughput, open-loop serving")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)

    def common(p):
        add_model_args(p)
        add_cache_args(p)
        add_engine_args(p)
        p.add_argument("--input-len", type=_positive_int, default=128)
        p.add_argument("--output-len", type=_positive_int, default=64)
        p.add_argument("--seed", type=int, default=0)

    p = bsub.add_parser("throughput", help="offline: all requests at once, tokens per second")
    common(p)
    p.add_argument("--num-prompts", type=_positive_int, default=64)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_throughput)

    p = bsub.add_parser("serve", help="open loop: Poisson arrivals; TTFT, TPOT, spikes, phases")
    common(p)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--spike-ms", type=float, default=None, help="a step slower than this is a spike "
                   "(default: 3x the median step)")
    p.add_argument("--json", default="serve.json")
    p.add_argument("--plot", default="serve.png")
    p.set_defaults(func=cmd_serve)


def add_engine_args(p):
    from .cli import _positive_int
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=_positive_int, default=16)
    g.add_argument("--num-blocks", type=_positive_int, default=None, help="KV pool blocks (default: "
                   "--kv-cache-tokens / --block-size)")
    g.add_argument("--kv-cache-tokens", type=_positive_int, default=16384)
    g.add_argument("--max-num-seqs", type=_positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
