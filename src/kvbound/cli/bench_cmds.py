"""`kvbound bench`: offline throughput and open-loop serving of the engine."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import KvboundError
from ..eval.bench import poisson_arrivals, random_prompts, run_offline, run_open_loop, serve_report
from ..eval.plots import serve_timeline
from .options import (add_cache_args, add_engine_args, add_model_args, engine_policy, load_model, make_engine,
                      output_file, positive_int)


def cmd_throughput(args):
    from ..engine import SamplingParams
    engine_policy(args)
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    prompts = random_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
    res = run_offline(engine, prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    res.update(input_len=args.input_len, output_len=args.output_len)
    print(f"{res['requests']} requests x ({args.input_len} in, {args.output_len} out), policy {res['policy']}")
    print(engine.describe_pool())
    print(f"elapsed {res['elapsed_s']:.2f} s   {res['requests_per_s']:.2f} req/s   "
          f"{res['output_tokens_per_s']:.1f} output tok/s   {res['total_tokens_per_s']:.1f} total tok/s   "
          f"peak running {res['peak_running']}   preemptions {res['preemptions']}")
    if res["preemptions"]:
        print(f"swap: {res['swapped_out_blocks']} blocks out, {res['swapped_in_blocks']} in; "
              f"{res['recomputed_tokens']} tokens computed again after preemptions")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


ENGINE_FLAGS = ("model", "dtype", "block_size", "num_blocks", "kv_cache_tokens", "kv_cache_memory",
                "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "kv_bits",
                "kv_cache_dtype", "kv_group_size", "kv_storage", "swap_space", "kv_offloading_size", "kv_dtype",
                "score", "ema_decay", "granularity", "evict_every", "pin_prefix", "threads")


def parse_slo(spec: str | None) -> dict | None:
    """--goodput 'ttft:500,tpot:50' (milliseconds; also e2e) -> {"ttft": 0.5, "tpot": 0.05}."""
    if not spec:
        return None
    slo = {}
    for item in spec.replace(" ", ",").split(","):
        if not item:
            continue
        key, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in ("ttft", "tpot", "e2e") or not value > 0:
            raise KvboundError(f"--goodput {spec!r}: expected ttft:MS, tpot:MS or e2e:MS with MS > 0, got {item!r}")
        slo[key] = value / 1000
    return slo


def cmd_serve(args):
    """Open loop: requests arrive on a Poisson clock whether or not the server keeps up (or, with
    --max-concurrency, a fixed number in flight). In process, or against --url."""
    if args.max_concurrency is None and (args.rate <= 0 or args.duration <= 0):
        raise KvboundError(f"--rate and --duration must be > 0, got {args.rate} and {args.duration}")
    slo = parse_slo(args.goodput)
    if args.url:
        reqs, steps, config = serve_over_http(args)
    else:
        reqs, steps, config = serve_in_process(args)
    res = serve_report(reqs, steps, config, args.spike_ms, slo, "gap" if args.url else "step")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"json: {args.json}")
    if args.plot:
        serve_timeline(res, steps, args.plot)
        print(f"plot: {args.plot}")
    return res


def arrival_plan(args) -> list[float] | None:
    if args.max_concurrency is not None:
        return None
    arrivals = poisson_arrivals(args.rate, args.duration, args.seed)
    if not arrivals:
        raise KvboundError(f"no request arrives in {args.duration} s at {args.rate}/s: raise --rate or --duration")
    return arrivals


def run_config(args, arrivals) -> dict:
    keys = ("input_len", "output_len", "seed", "policy", "budget") + (() if args.url else (
        "max_num_seqs", "max_num_batched_tokens"))
    config = {k: getattr(args, k) for k in keys}
    if arrivals is None:
        config.update(concurrency=args.max_concurrency, rate=None, duration=0.0)
    else:
        config.update(rate=args.rate, duration=args.duration)
    return {**config, "url": args.url}


def serve_in_process(args):
    from ..engine import SamplingParams
    if args.max_concurrency is not None:
        raise KvboundError("--max-concurrency needs --url (in process, requests arrive on the Poisson clock)")
    if args.prompts_file:
        raise KvboundError("--prompts-file needs --url (in process, prompts are random token ids)")
    engine_policy(args)
    arrivals = arrival_plan(args)
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    prompts = random_prompts(len(arrivals), args.input_len, model.config.vocab_size, args.seed)
    reqs, steps = run_open_loop(engine, arrivals, prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    return reqs, steps, run_config(args, arrivals)


def serve_over_http(args):
    """Streaming /v1/completions against --url; --policy / --budget travel as the request's kv_policy /
    kv_budget (kvbound's extension), flags of a local engine are refused."""
    from ..eval.http_bench import file_prompts, run_http, text_prompts
    given = [f"--{k.replace('_', '-')}" for k in ENGINE_FLAGS if getattr(args, k) != args.parser.get_default(k)]
    if given:
        raise KvboundError(f"{', '.join(given)}: no effect with --url (the server's own settings decide)")
    arrivals = arrival_plan(args)
    n = len(arrivals) if arrivals is not None else args.num_prompts
    prompts = file_prompts(args.prompts_file, n) if args.prompts_file else text_prompts(n, args.input_len, args.seed)
    body = {"max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.policy != "full":
        body["kv_policy"] = args.policy
    if args.budget is not None:
        body["kv_budget"] = args.budget
    reqs, steps = run_http(args.url, prompts, body, arrivals, args.max_concurrency, args.api_key, args.served_model)
    return reqs, steps, run_config(args, arrivals)


def http_url(s):
    """--url's argparse type: http(s)://host[:port], checked before any request is timed."""
    parts = urlsplit(s)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {s!r}")
    return s


def add_bench_parser(sub):
    b = sub.add_parser("bench", help="engine benchmarks: offline throughput, open-loop serving")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)

    def common(p):
        add_model_args(p)
        add_cache_args(p)
        add_engine_args(p)
        p.add_argument("--input-len", type=positive_int, default=128)
        p.add_argument("--output-len", type=positive_int, default=64)
        p.add_argument("--seed", type=int, default=0)

    p = bsub.add_parser("throughput", help="offline: all requests at once, tokens per second")
    common(p)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--json", type=output_file, default=None, help="write the results as JSON to this file")
    p.set_defaults(func=cmd_throughput)

    p = bsub.add_parser("serve", help="open loop: Poisson arrivals (or a fixed concurrency), in process or "
                        "against an OpenAI-compatible --url; TTFT, TPOT, ITL, goodput, spikes, phases")
    common(p)
    p.add_argument("--url", type=http_url, default=None, help="an OpenAI-compatible server (kvbound's, vLLM's, "
                   "llama.cpp's), e.g. "
                   "http://127.0.0.1:8000; without it the engine runs in this process")
    p.add_argument("--api-key", default=None, help="with --url: sent as Authorization: Bearer KEY")
    p.add_argument("--served-model", default=None, help="with --url: the model name to ask for (default: the "
                   "first of /v1/models)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, help="with --url: keep N requests in "
                   "flight (closed loop over --num-prompts) instead of Poisson arrivals")
    p.add_argument("--num-prompts", type=positive_int, default=64, help="with --max-concurrency: requests to send")
    p.add_argument("--prompts-file", default=None, help="with --url: prompts, one per line or JSON lines with a "
                   "\"prompt\" field (default: runs of the package's text of about --input-len tokens)")
    p.add_argument("--goodput", default=None, metavar="SLO", help="service-level objectives in ms, e.g. "
                   "'ttft:500,tpot:50' (also e2e): goodput counts the requests that meet all of them")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--spike-ms", type=float, default=None, help="a step slower than this is a spike "
                   "(default: 3x the median step)")
    p.add_argument("--json", type=output_file, default=None, help="write the report as JSON to this file")
    p.add_argument("--plot", type=output_file, default=None, help="write the timeline plot to this PNG file")
    p.set_defaults(func=cmd_serve, parser=p)
