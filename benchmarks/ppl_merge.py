"""Perplexity when an evicted token is merged into its most similar kept key instead of dropped (issue #18).

This is a prototype outside the cache classes. It answers one question before the engine is changed: does merging
beat observed-attention eviction (kvpress's ObservedAttention, kvbound's best policy on text) on held-out text?
Every row is fed the same tokens one at a time, as `kvbound eval ppl` feeds them. The K/V are stored in bf16. The
observed row uses kvbound's own named shape and is checked against `eval ppl` in tests/test_eval.py.

Modes:
- full: no eviction.
- window: the sinks and the newest tokens.
- observed: evicts the lowest summed attention over age.
- merge-mass: the observed victim's key and value averaged into the kept non-sink key of highest cosine similarity,
  weighted by how many tokens each stands for. A key's logit gains log(that count), so a merged key draws the
  attention its tokens would have drawn apart.
- merge-attention: the same, weighted by each token's summed attention.
- merge-rank: the same, weighted by observed's rank (summed attention over age).
- merge-attention-nobias: merge-attention without the log-count logit.
- merge-rank-adjacent: merge-rank into the kept non-sink key nearest in position instead of the most similar one
  (no pass over the head's keys).

    python3 benchmarks/ppl_merge.py --seq-len 2048 --samples 4 --sample-offset 4 --budget 256 --text ../shared/data
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from kvbound.cache.policies import named_policy
from kvbound.eval.data import token_samples
from kvbound.models import load

MODES = ("full", "window", "observed", "merge-mass", "merge-attention", "merge-rank", "merge-attention-nobias",
         "merge-rank-adjacent")


class MergeCache:
    """Rows of (sample, mode) behind the model's `attend`, all fed the same number of tokens a step. Per layer
    K, V [R, H, S, D], positions, token counts and summed attention [R, H, S]; every row holds the same S."""

    def __init__(self, modes: list[str], layers: int, budget: int | None):
        pol = named_policy("observed", budget or 256)
        self.sink, self.recent, self.budget = pol.sink, pol.recent, budget  # budget None: the full cache
        self.rows, self.seen, self.t = len(modes), 0, 0
        self.layers = [None] * layers
        flag = lambda names: torch.tensor([m in names for m in modes])[:, None]  # noqa: E731
        self.window = flag(("window",))
        self.merge = flag(MODES[3:])
        self.by_attention = flag(("merge-attention", "merge-rank", "merge-attention-nobias", "merge-rank-adjacent"))
        self.by_rank = flag(("merge-rank", "merge-rank-adjacent"))
        self.adjacent = flag(("merge-rank-adjacent",))
        self.bias = flag(("merge-mass", "merge-attention", "merge-rank", "merge-rank-adjacent"))[..., None, None, None]

    def positions(self, lengths: list[int]) -> torch.Tensor:
        self.t = lengths[0]
        return torch.arange(self.seen, self.seen + self.t).repeat(self.rows)

    def advance(self):
        self.seen += self.t

    def attend(self, layer, q, k, v, positions):
        rows, t, (hq, d), h = self.rows, self.t, q.shape[1:], k.shape[1]
        q = q.view(rows, t, h, hq // h, d).permute(0, 2, 3, 1, 4)  # [R, H, G, T, D]
        k, v = (x.to(torch.bfloat16).float().view(rows, t, h, d).transpose(1, 2) for x in (k, v))
        new = torch.arange(self.seen, self.seen + t).expand(rows, h, t)
        held = self.layers[layer]
        kk, vv, pos, count, score = (k, v, new, torch.ones(rows, h, t), torch.zeros(rows, h, t)) if held is None else \
            [torch.cat(pair, 2) for pair in zip(held, (k, v, new, torch.ones(rows, h, t), torch.zeros(rows, h, t)))]
        logits = torch.einsum("rhgtd,rhsd->rhgts", q, kk) / math.sqrt(d)
        logits = logits + torch.where(self.bias, count.log()[:, :, None, None, :], 0.0)
        logits = logits.masked_fill(pos[:, :, None, None, :] > new[:, :, None, :, None], float("-inf"))
        p = logits.softmax(-1)
        score = score + p.sum((2, 3))
        out = torch.einsum("rhgts,rhsd->rhgtd", p, vv).permute(0, 3, 1, 2, 4).reshape(rows * t, hq, d)
        state = [kk, vv, pos, count, score]
        while self.budget is not None and state[0].shape[2] > self.budget:  # merges write into kk, vv in place
            state = self.evict(*state)
        self.layers[layer] = state
        return out

    def evict(self, kk, vv, pos, count, score):
        """One token out of each row's heads: the window's oldest past the sinks, else observed's victim, which the
        merge modes first average into its most similar kept key past the sinks."""
        rows, h, n, d = kk.shape
        newest = self.seen + self.t - 1
        observed = score / (newest - pos + 1).clamp(min=1)  # summed attention over the queries that saw it
        protected = (pos < self.sink) | (pos > newest - self.recent)
        rank = torch.where(self.window[..., None], pos.float(), observed)
        protected = torch.where(self.window[..., None], pos < self.sink, protected)
        victim = rank.masked_fill(protected, float("inf")).argmin(-1)[..., None]  # [R, H, 1]
        take = lambda x, i: x.gather(2, i[..., None].expand(rows, h, 1, d))  # noqa: E731
        similar = torch.nn.functional.cosine_similarity(kk, take(kk, victim), dim=-1)
        near = -(pos - pos.gather(2, victim)).abs().float()
        similar = torch.where(self.adjacent[..., None], near, similar)
        similar = similar.masked_fill(pos < self.sink, float("-inf")).scatter(2, victim, float("-inf"))
        target = similar.argmax(-1)[..., None]
        weight = torch.where(self.by_rank[..., None], observed, score) + 1e-6
        weight = torch.where(self.by_attention[..., None], weight, count)
        w_t, w_v = weight.gather(2, target), weight.gather(2, victim)
        merge = self.merge[..., None]
        for x in (kk, vv):
            mixed = (w_t[..., None] * take(x, target) + w_v[..., None] * take(x, victim)) / (w_t + w_v)[..., None]
            mixed = mixed.to(torch.bfloat16).float()  # stored in bf16, as the cache stores it
            kept = torch.where(merge[..., None], mixed, take(x, target))
            x.scatter_(2, target[..., None].expand(rows, h, 1, d), kept)
        c_t, c_v = count.gather(2, target), count.gather(2, victim)
        count.scatter_(2, target, torch.where(merge, c_t + c_v, c_t))
        keep = torch.ones(rows, h, n, dtype=torch.bool).scatter(2, victim, False)
        return [x[keep].view(rows, h, n - 1, *x.shape[3:]) for x in (kk, vv, pos, count, score)]


def perplexities(model, samples: list[list[int]], modes: list[str], budget: int, prefill: int,
                 progress: bool = False) -> dict:
    """Perplexity of each mode over `samples`, scored token by token after the first `prefill` tokens; the full
    cache runs apart (its layers grow past the budget)."""
    result = {}
    if "full" in modes:
        result.update(_run(model, samples, ["full"], None, prefill, progress))
    if rest := [m for m in modes if m != "full"]:
        result.update(_run(model, samples, rest, budget, prefill, progress))
    return {m: result[m] for m in modes}


def _run(model, samples, modes, budget, prefill, progress):
    ids = torch.tensor(samples).repeat_interleave(len(modes), 0)  # row r: sample r // len(modes)
    rows, seq_len = ids.shape
    cache = MergeCache(modes * len(samples), model.config.num_layers, budget)
    nll, start = {m: 0.0 for m in modes}, time.time()
    with torch.inference_mode():
        logits = model(ids[:, :prefill].flatten(), cache.positions([prefill] * rows), cache,
                       logits_at=torch.arange(1, rows + 1) * prefill - 1)
        cache.advance()
        for i in range(prefill, seq_len):
            for r, lp in enumerate(torch.log_softmax(logits, -1).gather(1, ids[:, i:i + 1])[:, 0].tolist()):
                nll[modes[r % len(modes)]] -= lp
            if i + 1 < seq_len:
                logits = model(ids[:, i], cache.positions([1] * rows), cache)
                cache.advance()
            if progress and i % 256 == 0:
                print(f"{i}/{seq_len} tokens, {time.time() - start:.0f} s", flush=True)
    steps = len(samples) * (seq_len - prefill)
    return {m: math.exp(v / steps) for m, v in nll.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the default model)")
    ap.add_argument("--text", nargs="+", required=True, help="text files or folders")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--sample-offset", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--json", help="write the perplexities here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    torch.set_flush_denormal(True)
    model, tok = load(args.model)
    samples, files = token_samples(tok, args.text, args.samples, args.seq_len, args.sample_offset)
    print(f"samples: {', '.join(files)}", flush=True)
    ppl = perplexities(model, samples, modes, args.budget, args.prefill, progress=True)
    base, window = ppl.get("full"), ppl.get("window")
    print(f"{'mode':<24}{'PPL':>9}{'Δ% vs full':>12}{'x window':>10}")
    for m, x in ppl.items():
        delta = 100 * (x / base - 1) if base else float("nan")
        ratio = delta / (100 * (window / base - 1)) if base and window else float("nan")
        print(f"{m:<24}{x:>9.3f}{delta:>+12.2f}{ratio:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ppl": ppl, "config": vars(args), "files": files}, f, indent=2)


if __name__ == "__main__":
    main()
