"""`kvbound serve` on the lent GPU against the offline engine, side by side in one run (issue #16).

Random weights in SmolLM2's (or Qwen3-0.6B's, or Llama-3.1-8B's) shape, written as a Hugging Face directory
(serve_gpu.py), so the server is started exactly as a user would start it (`python -m kvbound serve --model DIR`, its own process), and
the load comes from `kvbound bench serve`'s HTTP client (eval/http_bench.py) in this process.

  saturation  N requests of random token-id prompts: the offline engine (LLMEngine in this process, the
              same flags, all N added at once) against the server with --max-num-seqs requests in flight
              (a closed loop), whole responses and streamed. Output tok/s.
  long        Poisson arrivals of short requests; in a second run one in --long-every is a long prompt.
              Inter-token latency p50 / p99 of the streams in both, and the timeline plot of the second:
              decode-first chunked prefill keeps p99 bounded while long prompts keep arriving.

  random      (--random-lengths) nano-vllm's 256 requests of U[100, 1024] tokens in and out, offline and
              served in a burst.
Each served run prints the server's engine steps and the time per step spent outside them (from /metrics);
--profile samples the server and its engine process with py-spy (if installed) during the streamed burst.

PYTHONPATH=src:benchmarks python benchmarks/serve_http.py --out $OUT [--shape smollm2|qwen3-0.6b|8b] [--random-lengths]
Prints a table last; writes serve_http_<shape>.json and serve_http_<shape>_long.png under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from engine_throughput import sync_time  # benchmarks/ is on the path as the script's folder
from serve_gpu import SHAPES, random_model_dir
from kvbound.engine import LLMEngine, SamplingParams
from kvbound.eval.bench import poisson_arrivals, random_prompts, run_offline, serve_report
from kvbound.eval.http_bench import run_http
from kvbound.eval.plots import serve_timeline
from kvbound.models import load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args) -> list[str]:
    return ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            *(["--no-async-scheduling"] if args.sync else [])]


def start_server(model_dir, args):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvbound", "serve", "--model", model_dir, "--port", str(port),
                             "--log-level", "warning", "--max-waiting", str(4 * args.num_prompts),
                             *engine_flags(args)], stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)


def closed_loop(engine, prompts, params, concurrency, delay_s=0.0) -> float:
    """In process: `concurrency` requests in flight, the next added `delay_s` after one ends (a client's round
    trip: arrivals then spread out, so that steps mix prefill pieces with decodes, as a server's do)."""
    it, due = iter(prompts), []
    for p in list(zip(range(concurrency), it)):
        engine.add_request(p[1], params)
    start = time.perf_counter()
    while engine.has_unfinished() or due:
        now = time.perf_counter()
        while due and due[0][0] <= now:
            engine.add_request(due.pop(0)[1], params)
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[0][0] - now))
            continue
        for _ in engine.step(only_finished=True):
            p = next(it, None)
            if p is not None:
                due.append((time.perf_counter() + delay_s * (0.5 + random.random()), p))
        due.sort(key=lambda x: x[0])
    torch.cuda.synchronize()
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def offline_random_tok_s(model_dir, prompts, outs, args) -> float:
    """All requests at once, each with its own output length (nano-vllm's workload)."""
    model, tok = load(model_dir, device="cuda", dtype=torch.bfloat16)
    with LLMEngine(model, tok, max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   async_scheduling=False if args.sync else None) as engine:
        for p, n in list(zip(prompts, outs))[:16]:  # warm-up
            engine.add_request(p, SamplingParams(max_tokens=min(n, 8), ignore_eos=True))
        while engine.has_unfinished():
            engine.step(only_finished=True)
        start = sync_time()
        for p, n in zip(prompts, outs):
            engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        while engine.has_unfinished():
            engine.step(only_finished=True)
        elapsed = sync_time() - start
    del model
    torch.cuda.empty_cache()
    return sum(outs) / elapsed


def offline_tok_s(model_dir, prompts, args, loops: bool = True) -> tuple[float, float | None, float | None]:
    """(all added at once, a closed loop of --max-num-seqs, the same with 2-6 ms round trips) output tok/s of
    the engine in this process; without `loops`, the first alone."""
    model, tok = load(model_dir, device="cuda", dtype=torch.bfloat16)
    with LLMEngine(model, tok, max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   async_scheduling=False if args.sync else None) as engine:
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        run_offline(engine, prompts[:16], params)  # warm-up: kernels compiled
        steps = engine.scheduler.stats["steps"]
        res = run_offline(engine, prompts, params)
        steps = engine.scheduler.stats["steps"] - steps
        print(f"[offline] wall {res['elapsed_s']:.2f} s, {steps} engine steps, "
              f"{len(prompts) * args.output_len / steps:.0f} tokens a step", flush=True)
        loop = closed_loop(engine, prompts, params, args.max_num_seqs) if loops else None
        spread = closed_loop(engine, prompts, params, args.max_num_seqs, 0.004) if loops else None
    del model
    torch.cuda.empty_cache()
    return res["output_tokens_per_s"], loop, spread


def engine_counters(url) -> dict:
    """The server's engine steps, their host seconds and the tokens generated so far (from /metrics)."""
    names = {"kvbound:engine_step_seconds_count": "steps", "kvbound:engine_step_seconds_sum": "step_s",
             "kvbound:generation_tokens_total": "tokens"}
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[names[name]] = float(value)
    return found


def profiled(proc, seconds: float, out: str, name: str):
    """py-spy (when installed) samples the server and its engine process for `seconds`: collapsed stacks
    in out/name.txt, to read where a served step's time goes."""
    try:
        return subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--subprocesses", "--duration",
                                 str(int(seconds)), "--format", "raw", "--rate", "200", "--nonblocking",
                                 "-o", os.path.join(out, name + ".txt")], stdout=subprocess.DEVNULL)
    except FileNotFoundError:
        return None


def served_tok_s(url, prompts, args, stream: bool, burst: bool = False) -> float:
    """Output tok/s of the server: --max-num-seqs requests in flight, or (burst) all sent at once, as vLLM's
    benchmark does with --request-rate inf (the server's queue then keeps every batch full)."""
    body = {"max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    run_http(url, prompts[:16], body, concurrency=16)  # warm-up
    before = engine_counters(url)
    t0 = time.perf_counter()
    if burst:
        reqs, _ = run_http(url, prompts, body, arrivals=[0.0] * len(prompts))
    else:
        reqs, _ = run_http(url, prompts, body, concurrency=args.max_num_seqs)
    elapsed = time.perf_counter() - t0
    failed = [r for r in reqs if r.get("error")]
    assert not failed, failed[:3]
    report_engine(url, before, elapsed, f"stream={stream} burst={burst}")
    return sum(r["tokens"] for r in reqs) / elapsed


def report_engine(url, before, elapsed, name):
    after = engine_counters(url)
    d = {k: after[k] - before[k] for k in after}
    print(f"[{name}] wall {elapsed:.2f} s, {d['steps']:.0f} engine steps ({d['step_s']:.2f} s in step, "
          f"{d['step_s'] / elapsed:.0%} of wall), {d['tokens'] / max(d['steps'], 1):.0f} tokens a step, "
          f"{1000 * (elapsed - d['step_s']) / max(d['steps'], 1):.2f} ms a step outside it", flush=True)


def served_random_tok_s(url, prompts, outs) -> float:
    body = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    before = engine_counters(url)
    t0 = time.perf_counter()
    reqs, _ = run_http(url, prompts, body, arrivals=[0.0] * len(prompts), max_tokens=outs)
    elapsed = time.perf_counter() - t0
    report_engine(url, before, elapsed, "random lengths, stream=True burst=True")
    failed = [r for r in reqs if r.get("error")]
    assert not failed, failed[:3]
    return sum(r["tokens"] for r in reqs) / elapsed


def long_prompt_runs(url, vocab, args, out):
    """Short streamed requests on a Poisson clock, without and then with long prompts among them."""
    arrivals = poisson_arrivals(args.rate, args.duration, 1)
    short = random_prompts(len(arrivals), args.input_len, vocab, 1)
    long_ = random_prompts(len(arrivals), args.long_len, vocab, 2)
    body = {"max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    results = {}
    for name, prompts in (("short only", short),
                          ("with long", [long_[i] if i % args.long_every == 0 else p for i, p in enumerate(short)])):
        reqs, gaps = run_http(url, prompts, body, arrivals)
        config = {"rate": args.rate, "duration": args.duration, "input_len": args.input_len,
                  "output_len": args.output_len, "long_len": args.long_len if name == "with long" else None,
                  "long_every": args.long_every}
        res = serve_report(reqs, gaps, config, None, None, "gap")
        results[name] = res
        if name == "with long":
            serve_timeline(res, gaps, os.path.join(out, f"serve_http_{args.shape}_long.png"))
    return results


def stop_server(proc):
    proc.send_signal(2)
    proc.wait(60)


def burst_rows(model_dir, prompts, args, rep, random_in, random_outs) -> dict:
    """The saturation bursts (whole, streamed and random lengths) against a fresh server."""
    proc, url = start_server(model_dir, args)
    tag = f" (#{rep + 1})"
    try:
        rows = {"served, whole responses, burst" + tag: served_tok_s(url, prompts, args, stream=False, burst=True),
                "served, streamed, burst" + tag: served_tok_s(url, prompts, args, stream=True, burst=True)}
        if random_outs is not None:
            rows["served, random lengths, streamed, burst" + tag] = served_random_tok_s(url, random_in, random_outs)
        return rows
    finally:
        stop_server(proc)


def offline_again(rows, model_dir, prompts, args, rep, random_in, random_outs):
    """The offline engine again (all at once, and random lengths), between servers and after the last."""
    tag = f" (#{rep + 1})"
    rows["offline" + tag] = offline_tok_s(model_dir, prompts, args, loops=False)[0]
    if random_outs is not None:
        rows["offline, random lengths" + tag] = offline_random_tok_s(model_dir, random_in, random_outs, args)


def offline_runs(rows, name) -> list[float]:
    return [v for k, v in rows.items() if k == name or (k.startswith(name + " (#") and k[len(name) + 3].isdigit())]


def mean_of(rows, name) -> float:
    """The mean of an offline row over its runs: served rows are compared with it, as the host drifts by more
    than the gap they measure (offline 29.7k tok/s first and 32.6k last in one call)."""
    runs = offline_runs(rows, name)
    return sum(runs) / len(runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--long-every", type=int, default=10)
    ap.add_argument("--random-lengths", action="store_true", help="also 256 requests of prompt and output lengths "
                    "U[100, 1024] (nano-vllm's bench), offline and served, all sent at once")
    ap.add_argument("--profile", action="store_true", help="py-spy the server during the streamed burst")
    ap.add_argument("--repeats", type=int, default=1, help="the saturation bursts against this many fresh servers "
                    "in all, with the offline engine run again between them and after the last; served rows are "
                    "compared with the mean of the offline runs (the host drifts)")
    ap.add_argument("--skip-long", action="store_true", help="no Poisson runs with long prompts")
    ap.add_argument("--sync", action="store_true", help="the engine without async scheduling, offline and served")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        random_model_dir(d, args.shape)
        vocab = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, 0)
        rows = dict(zip(("offline", "offline, closed loop", "offline, 2-6 ms round trip"),
                        offline_tok_s(d, prompts, args)))
        random_in = random_outs = None
        if args.random_lengths:  # nano-vllm's bench: prompt and output lengths U[100, 1024]
            rng = random.Random(0)
            random_in = [[rng.randrange(1, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
            random_outs = [rng.randint(100, 1024) for _ in random_in]
            rows["offline, random lengths"] = offline_random_tok_s(d, random_in, random_outs, args)
        proc, url = start_server(d, args)
        long_runs = {}
        try:
            rows["served, whole responses"] = served_tok_s(url, prompts, args, stream=False)
            rows["served, streamed"] = served_tok_s(url, prompts, args, stream=True)
            rows["served, whole responses, burst"] = served_tok_s(url, prompts, args, stream=False, burst=True)
            spy = profiled(proc, 5, args.out, f"serve_http_{args.shape}_profile") if args.profile else None
            rows["served, streamed, burst"] = served_tok_s(url, prompts, args, stream=True, burst=True)
            if spy is not None:
                spy.wait(30)
            if random_outs is not None:
                rows["served, random lengths, streamed, burst"] = served_random_tok_s(url, random_in, random_outs)
            steps = [line for line in httpx.get(url + "/metrics").text.splitlines()
                     if line.startswith("kvbound:engine_step_seconds")]
            print("\n".join(steps))
            if not args.skip_long:
                long_runs = long_prompt_runs(url, vocab, args, args.out)
        finally:
            stop_server(proc)
        for rep in range(1, args.repeats):  # the offline engine between servers: the host drifts
            offline_again(rows, d, prompts, args, rep, random_in, random_outs)
            rows.update(burst_rows(d, prompts, args, rep, random_in, random_outs))
        if args.repeats > 1:
            offline_again(rows, d, prompts, args, args.repeats, random_in, random_outs)
    res = {"config": vars(args), "output_tok_s": rows,
           "long": {k: {m: v[m] for m in ("itl_p50", "itl_p99", "ttft_p50", "ttft_p99", "spikes", "failed",
                                          "output_tokens_per_s")} for k, v in long_runs.items()}}
    with open(os.path.join(args.out, f"serve_http_{args.shape}.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), {args.max_num_seqs} at "
          f"a time, {args.shape} shape, random weights, bf16")
    print(f"{'':<60} {'output tok/s':>12} {'x offline':>10} {'x closed loop':>14}")
    offline = mean_of(rows, "offline")
    print(f"x offline: against the mean of the {len(offline_runs(rows, 'offline'))} offline runs, one before "
          "each server and one after the last")
    for name, v in rows.items():
        base = mean_of(rows, "offline, random lengths") if "random" in name else offline
        print(f"{name:<60} {v:>12.0f} {v / base:>10.3f} {v / rows['offline, closed loop']:>14.3f}")
    if not long_runs:
        return
    print(f"\nPoisson {args.rate}/s for {args.duration} s, {args.input_len} in / {args.output_len} out; "
          f"'with long': every {args.long_every}th prompt has {args.long_len} tokens")
    print(f"{'':<12} {'ITL p50':>8} {'ITL p99':>8} {'p99/p50':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'failed':>7}")
    for name, v in res["long"].items():
        print(f"{name:<12} {v['itl_p50']:>6.1f}ms {v['itl_p99']:>6.1f}ms {v['itl_p99'] / v['itl_p50']:>8.2f} "
              f"{1000 * v['ttft_p50']:>7.0f}ms {1000 * v['ttft_p99']:>7.0f}ms {v['failed']:>7}")


if __name__ == "__main__":
    main()
