"""kvpress's presses on kvbound's RULER-style prompts, side by side with kvbound's policies (issue #18).

Three steps, because kvpress 0.5 needs transformers < 5.3 and so a virtual environment of its own:

  export  (kvbound's environment) the prompts `kvbound eval ruler` builds, as token ids: the context, the
          question part (kept out of compression, as kvpress does), the expected answers
  run     (kvpress's environment; imports no kvbound) every press at every keep fraction on those ids: the
          context goes through the model inside the press (compressed once, after its prefill), then the
          question and a greedy reply of up to 32 tokens over the compressed cache; writes the reply ids
  report  (kvbound's environment) decodes and scores the replies with `kvbound.eval.ruler.score` and prints
          one table with kvbound's rows from its ruler JSON files

The protocols differ: kvpress compresses the context once after prefilling it whole and leaves the question
uncompressed; kvbound evicts as it goes (the question included) and its budget counts the whole prompt.
`run --query-aware` is kvpress's query-aware setting instead (its leaderboard's "SnapKV with the question"):
context and question go through the press together, compressed once, and keep counts the whole prompt, as
kvbound's one-piece runs (`--prefill-chunk` at least the prompt) do. kvpress's own protocol on kvbound's side is
`eval ruler --prefill-chunk N --question-piece` (`gpu --question-piece`): the context in one piece, evicted once,
then the question in a piece of its own (the question's piece and the reply are then evicted to the budget too).
With `--budget-of context` as well, kvbound's budget is kvpress's cache once it has read the question (keep x
context + question), which kvpress's then outgrows by the reply: equal memory at that point, less after it. With
`--budget-of peak`, it is kvpress's cache at its largest (keep x context + question + a 32-token reply), the memory a
server reserves for the request in either engine: kvbound holds more than kvpress while it reads the question and
less as the reply grows.
`--keep-question` (on both `gpu` and `eval ruler`) grows kvbound's recent windows, within that budget, to hold
the question and the reply, which kvpress keeps uncompressed.

python benchmarks/peer_kvpress.py export --out prompts.json
/path/to/kvpress-venv/bin/python benchmarks/peer_kvpress.py run --prompts prompts.json \\
    --model SmolLM2.gguf --out results/peer_kvpress_replies.json
python benchmarks/peer_kvpress.py report --replies results/peer_kvpress_replies.json [more reply files] \\
    --kvbound results/ruler_smollm2_1k.json results/ruler_smollm2_1k_onepiece.json

On a GPU machine `gpu` does export, every press and kvbound's policies at both fractions in one call, each in a
process of its own (kvpress's packages only on KVPRESS_SITE, kvbound's on PYTHONPATH), and merges the replies:

PYTHONPATH=src python benchmarks/peer_kvpress.py gpu --model model.gguf --kvpress-site /tmp/site \\
    --context 4096 --samples 20 --query-aware --out-dir runs/
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import zlib

PRESSES = ("streaming_llm", "snapkv", "observed_attention", "tova", "keydiff", "expected_attention",
           "adakv_expected_attention", "adakv_keydiff")
# kvbound's policy -> kvpress's press it is compared with instance by instance over every family: the same rule, and
# decode-time H2O against ObservedAttention (issue #18's second target)
# kvpress's KVzip press, which the issue does not list: across layers and heads (its default, kvbound's
# kvzip:layers=global), or each layer's budget shared freely among its heads (`layerwise`, kvbound's kvzip:alpha=0)
KVZIP = ("kvzip", "kvzip_layerwise")
PAIRED = {"window": "streaming_llm", "snapkv": "snapkv", "observed": "observed_attention", "tova": "tova",
          "keydiff": "keydiff", "h2o-heavy": "observed_attention", "keydiff:alpha=0.2": "adakv_keydiff",
          "kvzip:alpha=0": "kvzip_layerwise", "kvzip:layers=global": "kvzip", "kvzip:layers=global,chunk=2048": "kvzip"}


def export(args):
    from kvbound.eval.ruler import TASKS, haystack_ids, question_ids, sized_prompt
    from kvbound.models import load
    _, tok = load(args.model)
    filler = haystack_ids(tok, None, args.context)
    rows = []
    for task in args.tasks.split(",") if args.tasks else TASKS:
        for i in range(args.sample_offset, args.sample_offset + args.samples):
            rng = random.Random(zlib.crc32(f"0/{task}/{args.context}/{i}".encode()))  # ruler_runs' instances
            sample, ids = sized_prompt(tok, task, args.context, "after", rng, filler)
            post = question_ids(tok, sample)
            rows.append({"task": task, "sample": i, "context_ids": ids[:-len(post)], "question_ids": post,
                         "answers": sample.answers, "eos_ids": sorted(tok.eos_ids)})
    with open(args.out, "w") as f:
        json.dump({"context": args.context, "prompts": rows}, f)
    print(f"{len(rows)} prompts of {args.context} tokens -> {args.out}")


def import_kvpress():
    """kvpress 0.5 imports `datasets` and `fire` at the top for presses and a CLI this script never uses; where they
    are missing (the GPU machine), stand-ins that raise when called let the rest import."""
    import importlib.util
    import types
    for name, attr in (("datasets", "load_dataset"), ("fire", "Fire")):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            def missing(*args, _name=name, **kwargs):
                raise ImportError(f"{_name} is not installed")
            sys.modules[name] = types.ModuleType(name)
            setattr(sys.modules[name], attr, missing)
    import kvpress
    return kvpress


def make_press(name, ratio):
    kvpress = import_kvpress()
    return {"streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
            "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
            "observed_attention": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
            "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
            "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
            "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
            "adakv_expected_attention": lambda: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(
                compression_ratio=ratio)),
            "adakv_keydiff": lambda: kvpress.AdaKVPress(kvpress.KeyDiffPress(compression_ratio=ratio)),
            "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio),
            "kvzip_layerwise": lambda: kvpress.KVzipPress(compression_ratio=ratio, layerwise=True)}[name]()


def load_model(path: str, dtype: str, attn: str, device: str):
    """transformers' model of the GGUF file; its config names a folder holding the GGUF's tokenizer
    (`tokenizer_folder`)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=getattr(torch, dtype), attn_implementation=attn)
    model.config._name_or_path = tokenizer_folder(path)
    return model.to(device).eval()


def tokenizer_folder(path: str) -> str:
    """A folder holding the GGUF file's tokenizer: KVzip's press loads one by the model's name, to frame its repeat
    instruction in the chat template."""
    import tempfile
    from transformers import AutoTokenizer
    folder = tempfile.mkdtemp(prefix="tokenizer_")
    AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(folder)
    return folder


def run(args):
    import torch
    from transformers import DynamicCache
    data = json.load(open(args.prompts))
    if args.first is not None:
        data["prompts"] = [p for p in data["prompts"] if p["sample"] < args.first]
    # instance by instance across the tasks, so a run cut short holds the first N instances of every task
    data["prompts"].sort(key=lambda p: p["sample"])
    models = {}
    out, start = [], time.time()
    presses = args.presses.split(",")
    for keep in (float(k) for k in args.keep.split(",")):
        for name in presses:
            attn = "eager" if name == "observed_attention" else "sdpa"  # ObservedAttention needs the weights
            if attn not in models:
                models[attn] = load_model(args.model, args.dtype, attn, args.device)
            model = models[attn]
            for i, p in enumerate(data["prompts"]):
                if i and p["sample"] != data["prompts"][i - 1]["sample"]:  # an instance of every task done
                    _write(args.out, data["context"], out)
                cache = DynamicCache()
                pressed = p["context_ids"] + (p["question_ids"] if args.query_aware else [])
                at = len(pressed)  # positions count the tokens processed, not the compressed cache's
                with torch.no_grad():
                    with make_press(name, 1 - keep)(model):
                        logits = model(torch.tensor([pressed], device=args.device), past_key_values=cache,
                                       logits_to_keep=1).logits[0, -1]
                    if not args.query_aware:  # the question uncompressed, after the compressed context
                        q = len(p["question_ids"])
                        logits = model(torch.tensor([p["question_ids"]], device=args.device), past_key_values=cache,
                                       position_ids=torch.arange(at, at + q, device=args.device)[None]).logits[0, -1]
                        at += q
                    reply = []
                    for _ in range(args.max_tokens):
                        nxt = int(logits.argmax())
                        if nxt in p["eos_ids"]:
                            break
                        reply.append(nxt)
                        logits = model(torch.tensor([[nxt]], device=args.device), past_key_values=cache,
                                       position_ids=torch.tensor([[at]], device=args.device)).logits[0, -1]
                        at += 1
                out.append({"press": name + (" (query-aware)" if args.query_aware else ""), "keep": keep,
                            "task": p["task"], "sample": p["sample"],
                            "reply_ids": reply, "answers": p["answers"], "held": cache.get_seq_length()})
            print(f"{name} keep {keep}: {len(data['prompts'])} prompts, {time.time() - start:.0f} s", flush=True)
            _write(args.out, data["context"], out)  # after each press: a run cut short keeps what it finished


def _write(path, context, replies):
    kvpress = import_kvpress()
    with open(path, "w") as f:
        json.dump({"kvpress": getattr(kvpress, "__version__", "0.5"), "context": context, "replies": replies}, f)


def gpu(args):
    """Both sides on one GPU machine: a process per press (AdaKV's and KVzip's, the slowest, one per keep) and per
    kvbound fraction, all at once; what a press finished before the deadline is kept, its replies merged into one
    file."""
    os.makedirs(args.out_dir, exist_ok=True)
    prompts, script = os.path.join(args.out_dir, "prompts.json"), [sys.executable, os.path.abspath(__file__)]
    subprocess.run(script + ["export", "--model", args.model, "--context", str(args.context),
                             "--samples", str(args.samples), "--sample-offset", str(args.sample_offset),
                             "--out", prompts], check=True)
    aware = ["--query-aware"] if args.query_aware else []
    protocol_flags = ["--prefill-chunk", str(args.context)] if args.query_aware or args.question_piece else []
    protocol_flags += ["--question-piece"] if args.question_piece else []
    protocol_flags += ["--budget-of", args.budget_of]
    protocol_flags += ["--keep-question"] if args.keep_question else []
    tag = "_qa" if args.query_aware else ""
    jobs, parts = [], []
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    for name in args.presses.split(","):
        for keep in args.keep.split(",") if name.startswith(("adakv", "kvzip")) else [args.keep]:
            parts.append(os.path.join(args.out_dir, f"press_{name}_{keep}{tag}.json"))
            jobs.append((script + ["run", "--prompts", prompts, "--model", args.model, "--device", args.device,
                                   "--dtype", dtype, "--keep", keep, "--presses", name, "--out", parts[-1]]
                         + aware, args.kvpress_site, parts[-1]))
    for frac in args.keep.split(","):
        out = os.path.join(args.out_dir, f"kvbound_{frac}{tag}.json")
        jobs.append(([sys.executable, "-m", "kvbound", "eval", "ruler", "--model", args.model, "--device", args.device,
                      "--context", str(args.context), "--samples", str(args.samples),
                      "--sample-offset", str(args.sample_offset), "--budget-frac", frac,
                      "--strategies", args.strategies, "--engine", "--json", out] + protocol_flags,
                     os.environ.get("PYTHONPATH", ""), out))
    procs = [subprocess.Popen(cmd, stdout=open(out + ".log", "w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
             for cmd, path, out in jobs]
    deadline = time.time() + args.deadline
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    written = [json.load(open(part)) for part in parts if os.path.exists(part)]
    replies = [r for w in written for r in w["replies"]]
    with open(os.path.join(args.out_dir, f"peer_kvpress_replies{tag}.json"), "w") as f:
        json.dump({"kvpress": written[0]["kvpress"] if written else None, "context": args.context,
                   "replies": replies}, f)
    print(f"{len(replies)} kvpress replies; exit codes {[proc.returncode for proc in procs]}")


def report(args):
    from kvbound.eval.ruler import ruler_table, score
    from kvbound.models import load
    _, tok = load(args.model)
    files = [json.load(open(path)) for path in args.replies]
    data = files[0]
    first = args.first if args.first is not None else float("inf")  # the same instances on both sides
    results = [{"strategy": f"kvpress {r['press']}", "budget_frac": r["keep"], "task": r["task"],
                "sample": r["sample"], "score": score(tok.decode(r["reply_ids"]), r["answers"])}
               for f in files for r in f["replies"]
               if r["sample"] < first]
    results += kvbound_records(args.kvbound or [], first)
    rows, tasks, grid = ruler_table(results)
    aware = any("(query-aware)" in r["press"] for f in files for r in f["replies"])
    kvpress_keeps = "the whole prompt (query-aware)" if aware else "the context (question uncompressed)"
    budgets = {"prompt": "kvbound's budget a fraction of the whole prompt",
               "context": "kvbound's budget (equal memory) kvpress's cache once the question is read",
               "peak": "kvbound's budget (equal peak memory) kvpress's cache at its largest, after the reply"}
    ours = {r.get("budget_of", "prompt") for r in results if r["strategy"].startswith("kvbound")}
    print(f"RULER-style score, {data['context']}-token prompts; kvpress keeps a fraction of {kvpress_keeps}; "
          + "; ".join(budgets[of] for of in budgets if of in ours))
    print(f"{'strategy@keep':<44}" + "".join(f"{t:>16}" for t in tasks) + f"{'mean':>7}")
    for row, cells in sorted(zip(rows, grid), key=lambda x: (x[0].split("@")[1], x[0])):
        mean = sum(cells) / len(cells)
        print(f"{row:<44}" + "".join(f"{100 * c:>15.0f}%" for c in cells) + f"{100 * mean:>6.0f}%")
    scores = instance_scores(results)
    if args.only and not any(row.startswith("kvbound ") and row_name(row) == args.only for row in rows):
        print(f"peer_kvpress.py report: error: --only {args.only!r}: no kvbound row runs that strategy",
              file=sys.stderr)
        sys.exit(2)
    print_bests(rows, tasks, grid, {side: len({r["sample"] for r in results if r["strategy"].startswith(side)})
                                    for side in ("kvbound", "kvpress")}, scores, args.only)
    print_paired(scores)


def kvbound_records(paths, first=float("inf")) -> list[dict]:
    """kvbound's `eval ruler --json` records of instances below `first`, each row named by its strategy and protocol
    tags; an instance that several files ran (each run's baseline) counts once, from the first file."""
    out, seen = [], set()
    for path in paths:
        for r in json.load(open(path))["results"]:
            tags = ["question apart"] if r.get("question_piece") else ["one piece"] if "onepiece" in path else []
            tags += ["question kept"] if r.get("keep_question") else []
            tags += {"context": ["equal memory"], "peak": ["equal peak memory"]}.get(r.get("budget_of"), [])
            name = f"kvbound {r['strategy']}" + (f" ({', '.join(tags)})" if tags else "")
            key = (name, r["budget_frac"], r["task"], r["sample"])
            if r["sample"] < first and key not in seen:
                seen.add(key)
                out.append({**r, "strategy": name})
    return out


def row_name(row: str) -> str:
    """A table row's strategy, without its side, protocol tags and keep: 'kvbound b (equal memory)@0.5' -> 'b'."""
    return row.split("@")[0].split(" ", 1)[1].split(" (")[0]


def family_bests(rows, tasks, grid, side: str, keep: str,
                 only: str | None = None) -> list[tuple[float, list[str], str]]:
    """Per task, the best score of one side's rows at one keep (the full cache left out; `only`: that strategy's rows
    alone), who reaches it, and the first such row; (nan, [], None) where none of them ran the task."""
    mine = [(row, cells) for row, cells in zip(rows, grid)
            if row.startswith(side + " ") and row.endswith("@" + keep) and " baseline" not in row
            and only in (None, row_name(row))]
    bests = []
    for j in range(len(tasks)):
        ran = [cells[j] for _, cells in mine if cells[j] == cells[j]]  # NaN: the row has no instance of the task
        if not ran:
            bests.append((float("nan"), [], None))
            continue
        top = max(ran)
        tops = [row for row, cells in mine if round(100 * cells[j]) == round(100 * top)]
        names = [row_name(row) for row in tops]
        bests.append((top, list(dict.fromkeys(names)), tops[0]))
    return bests


def paired_interval(ours: dict, theirs: dict, rounds: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ours - theirs over the instances both sides ran ({sample: score} each) and its 95% bootstrap
    interval (instances resampled with replacement, the pairs kept together)."""
    import numpy as np
    both = sorted(set(ours) & set(theirs))
    diff = np.array([ours[i] - theirs[i] for i in both])
    means = diff[np.random.default_rng(seed).integers(0, len(diff), (rounds, len(diff)))].mean(1)
    return float(diff.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def instance_scores(results) -> dict:
    """{row (strategy@keep): {task: {sample: score}}}, rows named as `ruler_table` names them."""
    scores: dict = {}
    for r in results:
        row = scores.setdefault(f"{r['strategy']}@{r['budget_frac']:g}", {})
        row.setdefault(r["task"], {})[r["sample"]] = r["score"]
    return scores


def print_bests(rows, tasks, grid, instances: dict, scores: dict, only: str | None = None):
    """The target's test: kvbound's best policy against kvpress's best press, task family by family (`instances`:
    each side's instances a task, which `--first` makes equal), with the paired 95% interval of the difference
    between the two best rows (`paired_interval` over `scores`, `instance_scores`; it leaves out that each side's
    best was picked among several rows). `only`: one kvbound strategy instead of kvbound's best row."""
    for keep in dict.fromkeys(row.split("@")[1] for row in rows):
        ours, theirs = (family_bests(rows, tasks, grid, side, keep, only if side == "kvbound" else None)
                        for side in ("kvbound", "kvpress"))
        both = [(task, a, b) for task, a, b in zip(tasks, ours, theirs) if a[2] and b[2]]  # families both ran
        if not both:
            continue
        mine = f"kvbound's {only}" if only else "best of each side"
        print(f"\nkeep {keep}: {mine} against kvpress's best, per task family ({instances['kvbound']} instances a "
              f"task on kvbound's side, {instances['kvpress']} on kvpress's); difference, paired 95% interval")
        met = below = 0
        for task, (a, who_a, row_a), (b, who_b, row_b) in both:
            ok = round(100 * a) >= round(100 * b)
            mean, lo, hi = paired_interval(scores[row_a][task], scores[row_b][task])
            met += ok
            below += hi < 0
            print(f"  {task:<16} kvbound {100 * a:4.0f}% ({', '.join(who_a[:3])})  kvpress {100 * b:4.0f}% "
                  f"({', '.join(who_b[:3])})  {'yes' if ok else 'NO'}  {100 * mean:+.0f} pp "
                  f"[{100 * lo:+.0f}, {100 * hi:+.0f}]")
        print(f"  kvbound >= kvpress on {met} of {len(both)} families; below beyond the interval on {below}")


def print_paired(scores: dict):
    """Each kvbound row against its kvpress press (`PAIRED`) at the same keep: the paired difference over every
    family's instances pooled, with its 95% interval (`paired_interval`)."""
    lines = []
    for row, tasks in scores.items():
        label, keep = row.split("@")
        side, name = label.split(" ", 1)
        theirs = scores.get(f"kvpress {PAIRED.get(name.split(' (')[0])}@{keep}")
        if side != "kvbound" or theirs is None:
            continue
        pooled = [{(t, i): s for t, by in x.items() for i, s in by.items()} for x in (tasks, theirs)]
        mean, lo, hi = paired_interval(*pooled)
        lines.append(f"  {row:<76} {100 * mean:+5.1f} pp [{100 * lo:+.1f}, {100 * hi:+.1f}] over "
                     f"{len(set(pooled[0]) & set(pooled[1]))} instances")
    if lines:
        print("\nkvbound - kvpress, same rule (h2o-heavy: against observed_attention), over every family's instances, "
              "paired 95% interval")
        print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--model", default=None, help="kvbound model path (default: the shipped SmolLM2)")
    e.add_argument("--context", type=int, default=1024)
    e.add_argument("--samples", type=int, default=5)
    e.add_argument("--sample-offset", type=int, default=0, help="the first instance's number (`eval ruler "
                   "--sample-offset`): more instances for an earlier run's files")
    e.add_argument("--tasks", default=None)
    e.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--prompts", required=True)
    r.add_argument("--model", required=True, help="the .gguf file transformers reads")
    r.add_argument("--presses", default=",".join(PRESSES), help=f"of {', '.join(PRESSES + KVZIP)}")
    r.add_argument("--keep", default="0.25,0.5")
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--device", default="cpu")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    r.add_argument("--first", type=int, default=None, help="only the first N instances of each task")
    r.add_argument("--query-aware", action="store_true", help="the question compressed with the context (kvpress's "
                   "query-aware setting); keep then counts the whole prompt")
    r.add_argument("--out", required=True)
    g = sub.add_parser("gpu")
    g.add_argument("--model", required=True)
    g.add_argument("--kvpress-site", required=True, help="the PYTHONPATH that holds kvpress and transformers < 5.3")
    g.add_argument("--device", default="cuda")
    g.add_argument("--presses", default=",".join(PRESSES), help=f"of {', '.join(PRESSES + KVZIP)}")
    g.add_argument("--context", type=int, default=4096)
    g.add_argument("--samples", type=int, default=20)
    g.add_argument("--sample-offset", type=int, default=0, help="as export's: both sides run instances "
                   "sample_offset onwards, and `report` takes the new files beside the old")
    g.add_argument("--keep", default="0.25,0.5")
    g.add_argument("--strategies",
                   default="window,h2o-heavy,observed,tova,snapkv,knorm,keydiff,adakv,keydiff:alpha=0.2")
    protocol = g.add_mutually_exclusive_group()
    protocol.add_argument("--query-aware", action="store_true", help="presses see the question; kvbound prefills in "
                          "one piece")
    protocol.add_argument("--question-piece", action="store_true", help="kvbound prefills the context in one piece and "
                          "the question in another (kvpress's protocol; presses do not see the question)")
    g.add_argument("--budget-of", choices=["prompt", "context", "peak"], default="prompt", help="kvbound's budget: a "
                   "fraction of the prompt, of the context plus the question whole, or plus the question and the "
                   "reply (`eval ruler --budget-of`)")
    g.add_argument("--keep-question", action="store_true", help="kvbound's recent windows hold the question and the "
                   "reply, as kvpress keeps both (`eval ruler --keep-question`)")
    g.add_argument("--deadline", type=float, default=540, help="seconds before unfinished processes are stopped")
    g.add_argument("--out-dir", required=True)
    p = sub.add_parser("report")
    p.add_argument("--model", default=None)
    p.add_argument("--replies", required=True, nargs="+", help="reply files of `run` (several runs' presses merge)")
    p.add_argument("--kvbound", nargs="*")
    p.add_argument("--first", type=int, default=None, help="only the first N instances of each task, both sides")
    p.add_argument("--only", default=None, help="one kvbound strategy (as --strategies names it) against kvpress's "
                   "best press per family, instead of kvbound's best row")
    args = ap.parse_args()
    {"export": export, "run": run, "gpu": gpu, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
