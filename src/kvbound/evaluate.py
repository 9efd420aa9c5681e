"""Quality harness: perplexity under a bounded cache, sweeps over budget / length, needle retrieval.

Perplexity follows a real decode: the first `prefill` tokens of a sample go in at once, then every
next token is scored from the logits under the bounded cache and fed, one at a time. All strategies
of a sample run side by side in one batch (they see the same tokens), so the weights are read once.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from .cache import KVCache, MultiCache
from .config import KvboundError
from .quant import parse_kv_bits

DEFAULT_STRATEGIES = ["baseline", "window", "h2o-balanced", "h2o-heavy"]
PACKAGE_TEXT = Path(__file__).parent / "data"
SHARED_DATA = Path("../shared/data")
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
NEEDLE_KEYS = ("dolores park", "sandwich")


# --- text ---------------------------------------------------------------------------------------
def text_files(paths) -> list[Path]:
    """*.txt files under each path, round-robin across the top-level sources so samples mix corpora."""
    if not paths:
        paths = [SHARED_DATA] if SHARED_DATA.exists() else [PACKAGE_TEXT]
    groups = []
    for p in map(Path, paths):
        if not p.exists():
            raise KvboundError(f"--text: no such file or directory: {p}")
        if p.is_file():
            groups.append([p])
            continue
        for sub in sorted(p.iterdir()):
            files = sorted(sub.rglob("*.txt")) if sub.is_dir() else ([sub] if sub.suffix == ".txt" else [])
            if files:
                groups.append(files)
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    if not out:
        raise KvboundError(f"--text: no .txt files under {', '.join(map(str, paths))}")
    return out


def token_samples(tok, paths, n: int, seq_len: int) -> tuple[list[list[int]], list[str]]:
    samples, names = [], []
    for f in text_files(paths):
        ids = tok.encode(f.read_text(errors="replace"))
        if len(ids) >= seq_len:
            samples.append(ids[:seq_len])
            names.append(str(f))
        if len(samples) == n:
            break
    if len(samples) < n:
        raise KvboundError(f"only {len(samples)} text files hold {seq_len} tokens; asked for {n} samples")
    return samples, names


# --- strategies -----------------------------------------------------------------------------------
def parse_strategies(names: list[str], budget: int, args, pinned=()) -> dict:
    """name[+kv8|+kv4|+kvmixed] -> (policy, kv_bits)."""
    from .cli import policy_defaults
    from .policies import parse_policy
    out = {}
    for name in names:
        base, _, quant = name.partition("+")
        bits = parse_kv_bits(getattr(args, "kv_bits", None))
        if quant:
            table = {"kv8": 8, "kv4": 4, "kvmixed": {"heavy": 8, "recent": 4}, "kvmixed48": {"heavy": 4, "recent": 8}}
            if quant not in table:
                raise KvboundError(f"strategy {name!r}: unknown suffix +{quant} (use +kv8, +kv4, +kvmixed)")
            bits = table[quant]
        out[name] = (parse_policy(base, budget, pinned=pinned, **policy_defaults(args)), bits)
    return out


def make_caches(model, strategies: dict, args, device, dtype) -> list[KVCache]:
    from .cli import kv_dtype
    return [KVCache(model.config, pol, device=device, dtype=kv_dtype(args, dtype), kv_bits=bits,
                    kv_group_size=getattr(args, "kv_group_size", 64),
                    quantized_kv_start=getattr(args, "quantized_kv_start", 0)) for pol, bits in strategies.values()]


# --- perplexity -----------------------------------------------------------------------------------
def perplexity(model, samples, strategies: dict, args, prefill: int, device="cpu", dtype=torch.float32,
               progress=True, samples_per_batch: int = 4) -> dict:
    """Token-by-token perplexity of every strategy. `samples_per_batch` samples (times every strategy)
    go through one forward pass per step: the step is bound by reading the weights, so a wider batch
    costs little more than a narrow one."""
    names = list(strategies)
    nll = {s: 0.0 for s in names}
    count = 0
    mem = {s: [] for s in names}
    if any(len(x) != len(samples[0]) for x in samples):
        raise KvboundError("perplexity: all samples must have the same length")
    if prefill < 1 or prefill >= len(samples[0]):
        raise KvboundError(f"--prefill must be in [1, seq-len), got {prefill}")
    steps = sum(len(x) - prefill for x in samples)
    bar = tqdm(total=steps, desc="ppl", disable=not progress, unit="tok")
    chunk = getattr(args, "prefill_chunk", 512)
    for first in range(0, len(samples), samples_per_batch):
        group = torch.tensor(samples[first:first + samples_per_batch], device=device)  # [S, L]
        ids_t = group.repeat_interleave(len(names), 0)  # row r: sample r // len(names), strategy r % len(names)
        rows, seq_len = ids_t.shape
        caches = [c for _ in range(len(group)) for c in make_caches(model, strategies, args, device, dtype)]
        multi = MultiCache(caches)
        for start in range(0, prefill, chunk):
            part = ids_t[:, start:min(prefill, start + chunk)]
            width = part.shape[1]
            logits = model(part.flatten(), multi.positions([width] * rows), multi,
                           logits_at=torch.arange(1, rows + 1) * width - 1)
            multi.advance()
        for i in range(prefill, seq_len):
            logp = torch.log_softmax(logits, -1).gather(1, ids_t[:, i:i + 1].to(logits.device))[:, 0]
            for r, lp in enumerate(logp.tolist()):
                nll[names[r % len(names)]] -= lp
            count += len(group)
            bar.update(len(group))
            if i + 1 < seq_len:
                logits = model(ids_t[:, i], multi.positions([1] * rows), multi)
                multi.advance()
        for r, c in enumerate(caches):
            mem[names[r % len(names)]].append(c.nbytes())
    bar.close()
    base = names[0]
    out = {}
    for s in names:
        ppl = math.exp(nll[s] / count)
        out[s] = {"ppl": ppl, "policy": strategies[s][0].describe(), "kv_bits": strategies[s][1],
                  "kv_held_bytes": sum(m["held_bytes"] for m in mem[s]) / len(mem[s]),
                  "kv_full_bf16_bytes": sum(m["full_bf16_bytes"] for m in mem[s]) / len(mem[s])}
        out[s]["compression_vs_full_bf16"] = out[s]["kv_full_bf16_bytes"] / out[s]["kv_held_bytes"]
    for s in names:
        out[s]["delta_pct"] = 100 * (out[s]["ppl"] / out[base]["ppl"] - 1)
    return out


def print_ppl_table(res: dict, title: str = ""):
    if title:
        print(title)
    print(f"{'strategy':<24} {'PPL':>9} {'Δ% vs ' + next(iter(res)):>16} {'KV held (KiB)':>14} {'vs full bf16':>12}")
    for s, r in res.items():
        print(f"{s:<24} {r['ppl']:>9.3f} {r['delta_pct']:>+16.2f} {r['kv_held_bytes'] / 1024:>14.1f} "
              f"{r['compression_vs_full_bf16']:>11.2f}x")


def _setup(args):
    from .cli import load_model
    model, tok, dtype = load_model(args)
    return model, tok, dtype


def _with_baseline(names):
    return names if names[0] in ("baseline", "full") else ["baseline"] + names


def cmd_ppl(args):
    names = _with_baseline(args.strategies)
    strategies = parse_strategies(names, args.budget, args)
    model, tok, dtype = _setup(args)
    samples, files = token_samples(tok, args.text, args.samples, args.seq_len)
    res = perplexity(model, samples, strategies, args, args.prefill, args.device, dtype)
    print_ppl_table(res, f"{args.samples} x {args.seq_len} tokens, prefill {args.prefill}, budget {args.budget}")
    config = {k: getattr(args, k) for k in ("samples", "seq_len", "prefill", "budget", "model", "kv_group_size")}
    config["files"] = files
    if args.json:
        Path(args.json).write_text(json.dumps({"strategies": res, "config": config}, indent=2))
    if args.plot:
        _bar_plot(res, args.plot, f"budget {args.budget}, {args.samples}x{args.seq_len} tokens")
    return res


def _bar_plot(res, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(res), [r["delta_pct"] for r in res.values()], color="tab:blue")
    ax.set_ylabel("PPL Δ% vs baseline")
    ax.set_title(title)
    plt.xticks(rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_sweep(args):
    names = _with_baseline(args.strategies)
    model, tok, dtype = _setup(args)
    rows = {}
    for val in args.values:
        budget = val if args.over == "budget" else args.budget
        seq_len = val if args.over == "seq-len" else args.seq_len
        strategies = parse_strategies(names, budget, args)
        samples, _ = token_samples(tok, args.text, args.samples, seq_len)
        rows[val] = perplexity(model, samples, strategies, args, args.prefill, args.device, dtype)
        print_ppl_table(rows[val], f"{args.over} = {val}")
    print(f"\nΔ% vs baseline over {args.over}")
    print(f"{args.over:>8} " + " ".join(f"{s:>14}" for s in names))
    for val, res in rows.items():
        print(f"{val:>8} " + " ".join(f"{res[s]['delta_pct']:>+14.2f}" for s in names))
    if args.json:
        Path(args.json).write_text(json.dumps({"over": args.over, "rows": {str(k): v for k, v in rows.items()}},
                                              indent=2))
    plot = args.plot or f"sweep_{args.over}.png"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in names[1:]:
        ax.plot(args.values, [rows[v][s]["delta_pct"] for v in args.values], marker="o", label=s)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel(args.over)
    ax.set_ylabel("PPL Δ% vs full cache")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title(f"{args.samples} samples, {'budget ' + str(args.budget) if args.over != 'budget' else 'seq-len ' + str(args.seq_len)}")
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    print(f"plot: {plot}")
    return rows


# --- needle in a haystack ----------------------------------------------------------------------
def needle_prompt(tok, context: int, depth: float, haystack_dir=None) -> tuple[list[int], int]:
    """Chat prompt of about `context` tokens: instruction + question, essays with the needle at `depth`,
    then the question again. Returns (ids, length of the instruction span to pin)."""
    root = Path(haystack_dir) if haystack_dir else (SHARED_DATA / "paul_graham_essays")
    if not root.exists():
        root = PACKAGE_TEXT
    files = sorted(root.glob("*.txt"))
    if not files:
        raise KvboundError(f"needle: no haystack .txt files in {root}")
    text_ids: list[int] = []
    for f in files:
        text_ids += tok.encode(f.read_text(errors="replace"))
        if len(text_ids) > context:
            break
    head = tok.apply_chat_template([{"role": "user", "content": "\u0000"}]).split("\u0000")[0]
    instruction = (f"Read the document below, then answer this question: {QUESTION}\n\nDocument:\n")
    tail_text = f"\n\nAnswer the question using the document. {QUESTION}"
    end = tok.apply_chat_template([{"role": "user", "content": "\u0000"}]).split("\u0000")[1]
    pre_ids = tok.encode(head + instruction)
    post_ids = tok.encode(tail_text + end + "The best thing to do in San Francisco is")
    needle_ids = tok.encode(" " + NEEDLE + " ")
    room = context - len(pre_ids) - len(post_ids) - len(needle_ids)
    if room < 16:
        raise KvboundError(f"needle: context {context} is too short")
    hay = text_ids[:room]
    at = int(len(hay) * depth)
    # move the insertion point to a sentence end so the needle is not glued into a word
    period = tok.encode(".")[0]
    while at < len(hay) and hay[at - 1] != period and at - int(len(hay) * depth) < 64:
        at += 1
    return pre_ids + hay[:at] + needle_ids + hay[at:] + post_ids, len(pre_ids)


def cmd_needle(args):
    from .cli import kv_dtype
    from .generate import SamplingParams, generate_ids
    model, tok, dtype = _setup(args)
    names = _with_baseline(args.strategies)
    variants = [False, True] if args.pin_question else [False]
    results = []
    jobs = [(c, d, f, pin) for c in args.context for f in args.budget_frac for d in args.depths for pin in variants]
    for context, depth, frac, pin in tqdm(jobs, desc="needle"):
        ids, pin_len = needle_prompt(tok, context, depth)
        budget = max(16, int(frac * context))
        strategies = parse_strategies(names, budget, args, pinned=((0, pin_len),) if pin else ())
        for name, (pol, bits) in strategies.items():
            if pin and pol.budget is None:
                continue
            cache = KVCache(model.config, pol, device=args.device, dtype=kv_dtype(args, dtype), kv_bits=bits,
                            kv_group_size=args.kv_group_size)
            out = list(generate_ids(model, ids, SamplingParams(max_tokens=args.max_tokens), cache, tok.eos_ids,
                                    args.prefill_chunk))
            answer = tok.decode(out)
            ok = any(k in answer.lower() for k in NEEDLE_KEYS)
            mem = cache.nbytes()
            results.append({"strategy": name + ("+pin" if pin else ""), "context": context, "depth": depth,
                            "budget_frac": frac, "budget": pol.budget, "found": ok, "answer": answer.strip(),
                            "kv_held_bytes": mem["held_bytes"], "kv_full_bf16_bytes": mem["full_bf16_bytes"]})
    _needle_report(results, args)
    return results


def _needle_report(results, args):
    strategies = list(dict.fromkeys(r["strategy"] for r in results))
    cols = list(dict.fromkeys((r["context"], r["budget_frac"]) for r in results))
    print(f"\nneedle found (of {len(args.depths)} depths) per context / budget fraction")
    print(f"{'strategy':<22} " + " ".join(f"{f'{c}@{f:g}':>10}" for c, f in cols))
    grid = []
    for s in strategies:
        row = []
        for c, f in cols:
            hits = [r["found"] for r in results if r["strategy"] == s and r["context"] == c and r["budget_frac"] == f]
            row.append(sum(hits) / len(hits) if hits else float("nan"))
        grid.append(row)
        print(f"{s:<22} " + " ".join(f"{v * len(args.depths):>8.0f}/{len(args.depths)}" for v in row))
    json_path = args.json or "needle.json"
    Path(json_path).write_text(json.dumps({"results": results}, indent=2))
    plot = args.plot or "needle.png"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(cols), 1 + 0.45 * len(strategies)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{c} tok\nbudget {f:g}" for c, f in cols])
    ax.set_yticks(range(len(strategies)), strategies)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="retrieved")
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    print(f"json: {json_path}  plot: {plot}")


# --- CLI ---------------------------------------------------------------------------------------
def add_eval_parser(sub):
    from .cli import _float_list, _int_list, _positive_int, add_cache_args, add_model_args
    ev = sub.add_parser("eval", help="quality under a bounded cache: ppl, sweep, needle")
    esub = ev.add_subparsers(dest="eval_cmd", required=True)

    def common(p):
        add_model_args(p)
        add_cache_args(p)
        p.set_defaults(budget=256)
        p.add_argument("--strategies", type=lambda s: [x for x in s.split(",") if x], default=DEFAULT_STRATEGIES,
                       help="comma-separated: baseline, window, h2o-balanced, h2o-heavy, specs, +kv8/+kv4/+kvmixed")
        p.add_argument("--json", default=None)
        p.add_argument("--plot", default=None)

    def text_samples(p):
        p.add_argument("--text", nargs="*", default=None, help="files or directories of .txt (default ../shared/data)")
        p.add_argument("--samples", type=_positive_int, default=10)
        p.add_argument("--seq-len", type=_positive_int, default=512)
        p.add_argument("--prefill", type=_positive_int, default=32)

    p = esub.add_parser("ppl", help="perplexity under a bounded cache")
    common(p)
    text_samples(p)
    p.set_defaults(func=cmd_ppl)

    p = esub.add_parser("sweep", help="perplexity over budgets or sequence lengths, with a plot")
    common(p)
    text_samples(p)
    p.add_argument("--over", choices=["budget", "seq-len"], required=True)
    p.add_argument("--values", type=_int_list, required=True)
    p.set_defaults(func=cmd_sweep)

    p = esub.add_parser("needle", help="needle-in-a-haystack retrieval")
    common(p)
    p.add_argument("--context", type=_int_list, default=[2048, 4096])
    p.add_argument("--depths", type=_float_list, default=[0.1, 0.5, 0.9])
    p.add_argument("--budget-frac", type=_float_list, default=[0.25, 0.5])
    p.add_argument("--pin-question", action="store_true", help="also run each bounded strategy with the "
                   "instruction+question span pinned")
    p.add_argument("--max-tokens", type=_positive_int, default=24)
    p.set_defaults(func=cmd_needle, strategies=["baseline", "window", "h2o-heavy"])
