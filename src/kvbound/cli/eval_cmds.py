"""`kvbound eval`: perplexity, sweeps, needle and RULER-style retrieval under bounded caches."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..eval.data import token_samples
from ..eval.needle import Needle, found_lists, needle_grid, needle_runs, spread_depths
from ..eval.perplexity import engine_perplexity, perplexity, print_ppl_table
from ..eval.plots import heatmap, needle_heatmap, ppl_bars, sweep_lines
from ..eval.ruler import BUDGETS_OF
from ..eval.strategies import DEFAULT_STRATEGIES, parse_strategies, split_strategies, with_baseline
from ..errors import KvboundError
from .options import (add_cache_args, add_model_args, cache_options, float_list, int_list, load_model, nonneg_int,
                      output_file, pinned_spans, policy_defaults, positive_int)


def strategies_for(args, names, budget):
    return parse_strategies(names, budget, cache_options(args), pinned=pinned_spans(args), **policy_defaults(args))


def cmd_ppl(args):
    names = with_baseline(args.strategies)
    strategies = strategies_for(args, names, args.budget)
    model, tok, dtype = load_model(args)
    samples, files = token_samples(tok, args.text, args.samples, args.seq_len, args.sample_offset)
    res = scored(args, model, samples, strategies, dtype)
    print_ppl_table(res, f"{args.samples} x {args.seq_len} tokens" + (f" after {args.sample_offset}" if
                    args.sample_offset else "") + f", prefill {args.prefill}, budget {args.budget}"
                    + (", through the engine" if args.engine else ""))
    config = {k: getattr(args, k) for k in ("samples", "sample_offset", "seq_len", "prefill", "budget", "model",
                                            "kv_group_size")}
    config["files"] = files
    if args.json:
        Path(args.json).write_text(json.dumps({"strategies": res, "config": config}, indent=2))
    if args.plot:
        ppl_bars(res, args.plot, f"budget {args.budget}, {args.samples}x{args.seq_len} tokens")
    return res


def scored(args, model, samples, strategies, dtype) -> dict:
    """Perplexities through the serving engine (--engine) or the harness's own caches."""
    if args.engine:
        return engine_perplexity(model, samples, strategies, cache_options(args), args.prefill)
    return perplexity(model, samples, strategies, cache_options(args), args.prefill, args.device, dtype)


def cmd_sweep(args):
    names = with_baseline(args.strategies)
    plans = {}
    for val in args.values:  # every value checked before the first one runs
        if args.over == "seq-len" and val <= args.prefill:
            raise KvboundError(f"--values: a sequence length must be more than --prefill ({args.prefill}), got {val}")
        plans[val] = strategies_for(args, names, val if args.over == "budget" else args.budget)
    model, tok, dtype = load_model(args)
    rows = {}
    for val, strategies in plans.items():
        seq_len = val if args.over == "seq-len" else args.seq_len
        samples, _ = token_samples(tok, args.text, args.samples, seq_len, args.sample_offset)
        rows[val] = scored(args, model, samples, strategies, dtype)
        print_ppl_table(rows[val], f"{args.over} = {val}")
    print(f"\nΔ% vs baseline over {args.over}")
    print(f"{args.over:>8} " + " ".join(f"{s:>14}" for s in names))
    for val, res in rows.items():
        print(f"{val:>8} " + " ".join(f"{res[s]['delta_pct']:>+14.2f}" for s in names))
    if args.json:
        Path(args.json).write_text(json.dumps({"over": args.over, "rows": {str(k): v for k, v in rows.items()}},
                                              indent=2))
    if args.plot:
        fixed = f"budget {args.budget}" if args.over != "budget" else f"seq-len {args.seq_len}"
        sweep_lines(rows, names, args.over, args.plot, f"{args.samples} samples, {fixed}")
        print(f"plot: {args.plot}")
    return rows


class depth_list(list):
    """--depths: comma-separated numbers; a list of this type tells that the flag was given."""

    def __init__(self, s):
        super().__init__(float_list(s))
        for depth in self:
            if not 0.0 <= depth <= 1.0:
                raise argparse.ArgumentTypeError(f"a depth must be in [0, 1], got {depth:g}")


class PartialJSON:
    """`--json` written while a long evaluation runs (at most every `every` seconds, marked partial), so what
    finished survives a run cut short; the command writes the whole file at the end."""

    def __init__(self, path, every: float = 30.0):
        self.path, self.every, self.last = path, every, time.monotonic()

    def __call__(self, records_so_far):
        if self.path and time.monotonic() - self.last >= self.every:
            Path(self.path).write_text(json.dumps({"partial": True, "results": records_so_far()}, indent=2))
            self.last = time.monotonic()


def cmd_needle(args):
    if args.pin_prefix:
        raise KvboundError("eval needle: --pin-prefix has no effect; --pin-question pins the instruction span")
    if args.text and args.haystack:
        raise KvboundError("eval needle: --haystack and --text name the same thing; give one")
    if args.samples is not None and isinstance(args.depths, depth_list):
        raise KvboundError("eval needle: give --depths or --samples (depths spread evenly), not both")
    depths = spread_depths(args.samples) if args.samples is not None else args.depths
    needle = Needle.custom(args.needle, args.question, args.answer)
    model, tok, dtype = load_model(args)
    results = needle_runs(model, tok, with_baseline(args.strategies), args.context, depths, args.budget_frac,
                          cache_options(args), args.pin_question, args.max_tokens, args.device, dtype,
                          args.haystack or args.text, needle, finished=PartialJSON(args.json), **policy_defaults(args))
    strategies, cols, grid = needle_grid(results)
    print(f"\nneedle found (of {len(depths)} depths) per context / budget fraction")
    print(f"{'strategy':<22} " + " ".join(f"{f'{c}@{f:g}':>10}" for c, f in cols))
    for s, row in zip(strategies, grid):
        print(f"{s:<22} " + " ".join(f"{v * len(depths):>8.0f}/{len(depths)}" for v in row))
    if args.json:
        Path(args.json).write_text(json.dumps({"found": found_lists(results), "results": results}, indent=2))
        print(f"json: {args.json}")
    if args.plot:
        needle_heatmap(strategies, cols, grid, args.plot)
        print(f"plot: {args.plot}")
    return results


def cmd_ruler(args):
    from ..eval.ruler import TASKS, ruler_runs, ruler_table
    tasks = TASKS if args.tasks == ["all"] else args.tasks
    if args.text:
        raise KvboundError("eval ruler: give the haystack with --haystack FILE ... (or --haystack noise)")
    model, tok, dtype = load_model(args)
    results = ruler_runs(model, tok, with_baseline(args.strategies), args.context, tasks, args.budget_frac,
                         cache_options(args), args.samples, args.query, args.haystack, args.max_tokens, args.device,
                         dtype, engine=args.engine, finished=PartialJSON(args.json), question_piece=args.question_piece,
                         budget_of=args.budget_of, keep_question=args.keep_question, sample_offset=args.sample_offset,
                         **policy_defaults(args))
    rows, tasks, grid = ruler_table(results)
    apart = ", in a prefill piece of its own" if args.question_piece else ""
    apart += ", kept in bounded policies' recent windows with the reply" if args.keep_question else ""
    of = {"prompt": "the prompt", "context": "the context, plus the question",
          "peak": "the context, plus the question and the reply"}[args.budget_of]
    print(f"\nruler score (mean of {args.samples} samples per task; contexts {', '.join(map(str, args.context))}; "
          f"question {args.query} the context{apart}; budget a fraction of {of})")
    print(f"{'strategy@budget':<26} " + " ".join(f"{t:>15}" for t in tasks) + f" {'mean':>6}")
    for row, cells in zip(rows, grid):
        print(f"{row:<26} " + " ".join(f"{v:>15.0%}" for v in cells) + f" {sum(cells) / len(cells):>6.0%}")
    n = args.samples * len(args.context)  # a cell's instances; scores lie in [0, 1], so their variance is <= 1/4
    print(f"a cell is a mean over {n} instances: its 95% interval is up to +/-{196 * (0.25 / n) ** 0.5:.0f} pp wide "
          "(`benchmarks/peer_kvpress.py report` compares policies instance by instance)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=2))
        print(f"json: {args.json}")
    if args.plot:
        heatmap(rows, tasks, grid, args.plot, "score")
        print(f"plot: {args.plot}")
    return results


def strategy_list(text: str) -> list[str]:
    """--strategies' argparse type: at least one strategy."""
    names = split_strategies(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated strategies, got {text!r}")
    return names


def add_eval_parser(sub):
    ev = sub.add_parser("eval", help="quality under a bounded cache: ppl, sweep, needle, ruler")
    esub = ev.add_subparsers(dest="eval_cmd", required=True)

    def common(p):
        add_model_args(p)
        add_cache_args(p, with_policy=False)
        p.set_defaults(budget=256)
        p.add_argument("--strategies", type=strategy_list, default=DEFAULT_STRATEGIES,
                       help="comma-separated: baseline, window, h2o-balanced, h2o-heavy, observed, tova, snapkv, "
                            "knorm, keydiff, adakv, pyramidkv, kvzip, specs such as "
                            "'h2o:budget=256,score=observed,alpha=0.2', +kv8/+kv4/+kvmixed (default: %(default)s)")
        p.add_argument("--json", type=output_file, default=None, help="write the results as JSON to this file")
        p.add_argument("--plot", type=output_file, default=None, help="write a plot to this PNG file")
        p.add_argument("--text", nargs="+", default=None, help="files or directories of .txt (default: the "
                       "public-domain text shipped with kvbound, in kvbound/eval/data)")

    def text_samples(p):
        p.add_argument("--samples", type=positive_int, default=10, help="(default: %(default)s)")
        p.add_argument("--sample-offset", type=nonneg_int, default=0, help="skip this many samples first, so a "
                       "later run scores text an earlier one did not (a held-out check) (default: %(default)s)")
        p.add_argument("--seq-len", type=positive_int, default=512, help="(default: %(default)s)")
        p.add_argument("--prefill", type=positive_int, default=32, help="tokens fed at once before scoring "
                       "starts (default: %(default)s)")
        p.add_argument("--engine", action="store_true", help="score through the serving engine (one continuous "
                       "batch over its paged pool, packed for +kv8 / +kv4) instead of the harness's caches")

    p = esub.add_parser("ppl", help="perplexity under a bounded cache")
    common(p)
    text_samples(p)
    p.set_defaults(func=cmd_ppl)

    p = esub.add_parser("sweep", help="perplexity over budgets or sequence lengths, with a plot")
    common(p)
    text_samples(p)
    p.add_argument("--over", choices=["budget", "seq-len"], required=True)
    p.add_argument("--values", type=int_list, required=True)
    p.set_defaults(func=cmd_sweep)

    p = esub.add_parser("needle", help="needle-in-a-haystack retrieval")
    common(p)
    p.add_argument("--context", type=int_list, default=[2048, 4096])
    p.add_argument("--depths", type=depth_list, default=[0.1, 0.5, 0.9])
    p.add_argument("--samples", type=positive_int, default=None, help="N depths spread evenly (instead of --depths)")
    p.add_argument("--haystack", nargs="+", default=None, help="text files or folders to hide the needle in "
                   "(default: the package's text)")
    p.add_argument("--needle", default=None, help="the fact to hide (with --question and --answer)")
    p.add_argument("--question", default=None, help="the question that asks for --needle")
    p.add_argument("--answer", default=None, help="a word of the answer: found = the reply contains it")
    p.add_argument("--budget-frac", type=float_list, default=[0.25, 0.5], help="comma-separated: each bounded "
                   "strategy's budget as a fraction of each --context, one run per fraction (default: 0.25,0.5)")
    p.add_argument("--pin-question", action="store_true", help="also run each bounded strategy with the "
                   "instruction+question span pinned")
    p.add_argument("--max-tokens", type=positive_int, default=24)
    p.set_defaults(func=cmd_needle, strategies=["baseline", "window", "h2o-heavy"])

    p = esub.add_parser("ruler", help="RULER-style retrieval, tracking and extraction tasks, generated locally")
    common(p)
    p.add_argument("--context", type=int_list, default=[2048, 4096])
    p.add_argument("--tasks", type=lambda s: [x for x in s.split(",") if x], default=["all"],
                   help="comma-separated of niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, "
                        "fwe, qa (default: all)")
    p.add_argument("--samples", type=positive_int, default=20, help="instances per task (default: %(default)s)")
    p.add_argument("--sample-offset", type=nonneg_int, default=0, help="number the instances from here, so a "
                   "later run adds new instances to an earlier run's JSON instead of repeating its own "
                   "(default: %(default)s)")
    p.add_argument("--budget-frac", type=float_list, default=[0.25, 0.5], help="comma-separated: each bounded "
                   "strategy's budget as a fraction of what --budget-of names, one run per fraction "
                   "(default: 0.25,0.5)")
    p.add_argument("--query", choices=["after", "before"], default="after", help="the question only after the "
                   "context, or also before it (a query-aware policy sees it) (default: %(default)s)")
    p.add_argument("--question-piece", action="store_true", help="feed the closing question as a prefill piece of "
                   "its own, so the context's evictions never see it; with --prefill-chunk at least the context, "
                   "kvpress's protocol (the context compressed once, then the question)")
    p.add_argument("--budget-of", choices=BUDGETS_OF, default="prompt", help="what --budget-frac is a "
                   "fraction of: the whole prompt; the context before the closing question with room for the "
                   "question on top (context: kvpress's cache once it has read the question); or with room for the "
                   "question and a --max-tokens reply on top (peak: kvpress's cache at its largest, what a server "
                   "reserves); kvbound never holds more (default: %(default)s)")
    p.add_argument("--keep-question", action="store_true", help="bounded policies with a recent window (h2o, snapkv, "
                   "keydiff, ...) grow it, within their budget, to hold the closing question and the reply, as kvpress "
                   "keeps both uncompressed")
    p.add_argument("--haystack", nargs="+", default=None, help="text files or folders to hide facts in, or "
                   "'noise' for RULER's repeated sentences (default: the package's text)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--engine", action="store_true", help="run through the serving engine: every (sample, strategy) "
                   "one request of a continuous batch (fast on a GPU)")
    p.set_defaults(func=cmd_ruler, strategies=["baseline", "window", "h2o-heavy"])
