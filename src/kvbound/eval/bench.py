"""Engine benchmarks: offline throughput (all requests at once) and open-loop serving (Poisson arrivals).

Prompts are random token ids of a fixed length (vLLM's random dataset); every request generates exactly its
`max_tokens` (EOS ignored), so runs are comparable across policies and machines.
"""
from __future__ import annotations

import math
import random
import time

import torch
from tqdm import tqdm


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_offline(engine, prompts, params) -> dict:
    """Every request at once; runs the engine dry. Returns elapsed seconds, tokens per second, peak running
    sequences and the scheduler's counters."""
    for p in prompts:
        engine.add_request(p, params)
    peak = 0
    bar = tqdm(total=len(prompts), desc="throughput", unit="req")
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step(only_finished=True)
        peak = max(peak, len(engine.scheduler.running))
        bar.update(sum(o.finished for o in outs))
    _sync(engine)
    elapsed = time.perf_counter() - start
    bar.close()
    n_in, n_out = sum(map(len, prompts)), len(prompts) * params.max_tokens
    return {"requests": len(prompts), "policy": engine.default_policy.describe(), "elapsed_s": elapsed,
            "requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_out + n_in) / elapsed, "peak_running": peak, **engine.scheduler.stats}


def run_open_loop(engine, arrivals, prompts, params):
    """Request i arrives at arrivals[i] seconds whether or not the engine keeps up. Returns (per request, in
    order: {"arrival", "token_times"} in seconds since the start; per-step records)."""
    done, steps, sent = {}, [], 0
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
        outs = engine.step()  # no sync: an async engine reads a step's tokens while the next one runs
        s1 = time.perf_counter()
        steps.append({"t": s0 - t0, "ms": 1000 * (s1 - s0), "running": len(engine.scheduler.running)})
        for o in outs:
            if o.finished:
                done[int(o.request_id)] = [t - t0 for t in o.token_times]
                bar.update(1)
    bar.close()
    return [{"arrival": a, "token_times": done[i]} for i, a in enumerate(arrivals)], steps


def serve_report(reqs, steps, config: dict, spike_ms=None, slo: dict | None = None, step_name: str = "step") -> dict:
    """Latencies and throughput over the whole run and its phases (ramp: the first 20% of the arrival
    window, steady, tail: after the last arrival); prints the table. reqs: {"arrival", "token_times"
    (seconds since the start), optionally "tokens" (when a timed piece may hold several) and "error"}.
    steps: {"t", "ms", "running"}, engine steps or (over HTTP) the gaps between streamed pieces; one slower
    than spike_ms (default 3x the median) is a spike. slo: {"ttft"/"tpot"/"e2e": seconds} for goodput."""
    rows = [_request_row(r) for r in reqs]
    ok = [r for r in rows if "error" not in r]
    end = max([s["t"] + s["ms"] / 1000 for s in steps] + [r["end"] for r in ok] + [0.0])
    spike_ms = spike_ms if spike_ms else 3 * pct([s["ms"] for s in steps], 50)
    duration = config["duration"]
    phases = {"ramp": (0.0, 0.2 * duration), "steady": (0.2 * duration, duration), "tail": (duration, end)}
    report = {"config": config, "requests": len(rows), "failed": len(rows) - len(ok), "elapsed_s": end,
              "spike_ms": spike_ms, "step_name": step_name, "slo": slo}
    report.update(_summary(ok, steps, 0.0, end, spike_ms))
    if slo:
        good = [r for r in ok if all(r[k] <= v for k, v in slo.items() if r[k] == r[k])]
        report["goodput_requests_per_s"] = len(good) / end if end else float("nan")
        report["slo_met"] = len(good)
    report["phases"] = {name: _summary([r for r in ok if a <= r["arrival"] < b], steps, a, b, spike_ms)
                        for name, (a, b) in phases.items()} if duration else {}  # no phases at a fixed concurrency
    _print_report(report, step_name)
    report["per_request"] = [{k: v for k, v in r.items() if k not in ("token_times", "itl")} for r in rows]
    return report


def _request_row(r) -> dict:
    times, a = r["token_times"], r["arrival"]
    if r.get("error") or not times:
        return {"arrival": a, "error": r.get("error") or "no output"}
    tokens = r.get("tokens") or len(times)
    itl = [1000 * (y - x) for x, y in zip(times, times[1:])]
    return {"arrival": a, "ttft": times[0] - a, "tpot": (times[-1] - times[0]) / (tokens - 1) if tokens > 1
            else float("nan"), "e2e": times[-1] - a, "end": times[-1], "tokens": tokens, "token_times": times,
            "itl": itl}


def _print_report(report, step_name):
    cfg = report["config"]
    how = f"at {cfg['rate']}/s over {cfg['duration']} s" if cfg.get("rate") else f"{cfg.get('concurrency')} at a time"
    print(f"{report['requests']} requests {how} (drained at {report['elapsed_s']:.1f} s, {report['failed']} failed); "
          f"{step_name}s slower than {report['spike_ms']:.1f} ms count as spikes")
    if report.get("slo"):
        print(f"goodput {report['goodput_requests_per_s']:.2f} req/s ({report['slo_met']} of {report['requests']} "
              f"requests met {', '.join(f'{k} <= {1000 * v:g} ms' for k, v in report['slo'].items())})")
    print(f"{'phase':<8} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {step_name + 's':>6} {'spikes':>7} {'spike s':>8}")
    for name, s in [("all", report)] + list(report["phases"].items()):
        print(f"{name:<8} {s['n']:>5} {s['output_tokens_per_s']:>10.1f} {1000 * s['ttft_p50']:>7.0f}ms "
              f"{1000 * s['ttft_p99']:>7.0f}ms {1000 * s['tpot_p50']:>7.1f}ms {1000 * s['tpot_p99']:>7.1f}ms "
              f"{s['itl_p50']:>6.1f}ms {s['itl_p99']:>6.1f}ms {s['steps']:>6} {s['spikes']:>7} {s['spike_time_s']:>8.2f}")


def _summary(rows, steps, a, b, spike_ms) -> dict:
    """Latencies of the requests that arrived in [a, b), and the output and steps inside [a, b)."""
    window = [s for s in steps if a <= s["t"] < b]
    spikes = [s for s in window if s["ms"] > spike_ms]
    tokens = sum(r["tokens"] * sum(1 for t in r["token_times"] if a <= t < b) / len(r["token_times"]) for r in rows)
    tpot = [r["tpot"] for r in rows if r["tpot"] == r["tpot"]]
    itl = [g for r in rows for g in r["itl"]]
    return {"n": len(rows), "output_tokens_per_s": tokens / (b - a) if b > a else float("nan"),
            "ttft_p50": pct([r["ttft"] for r in rows], 50), "ttft_p99": pct([r["ttft"] for r in rows], 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "steps": len(window), "step_ms_p50": pct([s["ms"] for s in window], 50),
            "step_ms_p99": pct([s["ms"] for s in window], 99), "spikes": len(spikes),
            "spike_time_s": sum(s["ms"] for s in spikes) / 1000}
