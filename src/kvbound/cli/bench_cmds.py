"""`kvbound bench`: offline throughput and open-loop serving of the engine."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import KvboundError
from ..eval.bench import poisson_arrivals, random_prompts, run_offline, run_open_loop, serve_report
from ..eval.plots import serve_timeline
from .options import (add_cache_args, add_engine_args, add_model_args, engine_policy, load_model, make_engine,
                      positive_int)


def cmd_throughput(args):
    from ..engine import SamplingParams
    engine_policy(args)
    model, tok, dtype = load_model(args)
    engine = make_engine(args, model, tok, dtype)
    prompts = random_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
    res = run_offline(engine, prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    res.update(input_len=args.input_len, output_len=args.output_len)
    print(f"{res['requests']} requests x ({args.input_len} in, {args.output_len} out), policy {res['policy']}")
    print(f"elapsed {res['elapsed_s']:.2f} s   {res['requests_per_s']:.2f} req/s   "
          f"{res['output_tokens_per_s']:.1f} output tok/s   {res['total_tokens_per_s']:.1f} total tok/s   "
          f"peak running {res['peak_running']}   preemptions {res['preemptions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def cmd_serve(args):
    """Open loop: requests arrive on a Poisson clock whether or not the engine keeps up."""
    from ..engine import SamplingParams
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
    done, steps, t0 = run_open_loop(engine, arrivals, prompts, params)
    config = {k: getattr(args, k) for k in ("rate", "duration", "input_len", "output_len", "seed", "max_num_seqs",
                                            "max_num_batched_tokens", "policy", "budget")}
    res = serve_report(arrivals, done, steps, t0, config, args.spike_ms)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"json: {args.json}")
    if args.plot:
        serve_timeline(res, steps, args.plot)
        print(f"plot: {args.plot}")
    return res


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
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=cmd_throughput)

    p = bsub.add_parser("serve", help="open loop: Poisson arrivals; TTFT, TPOT, spikes, phases")
    common(p)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--spike-ms", type=float, default=None, help="a step slower than this is a spike "
                   "(default: 3x the median step)")
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    p.add_argument("--plot", default=None, help="write the timeline plot to this PNG file")
    p.set_defaults(func=cmd_serve)
