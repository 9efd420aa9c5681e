"""Perplexity under a bounded cache.

Perplexity follows a real decode: the first `prefill` tokens of a sample go in at once, then every
next token is scored from the logits under the bounded cache and fed, one at a time. All strategies
of a sample run side by side in one batch (they see the same tokens), so the weights are read once.
"""
from __future__ import annotations

import math

import torch
from tqdm import tqdm

from ..cache import MultiCache
from ..cache.policies import refuse_prompt_scoring
from ..errors import KvboundError
from .strategies import CacheOptions, check_engine_strategies, engine_completions, kv_widths, make_cache


def perplexity(model, samples, strategies: dict, options: CacheOptions, prefill: int, device="cpu",
               dtype=torch.float32, progress=True, samples_per_batch: int = 4) -> dict:
    """Token-by-token perplexity of every strategy. `samples_per_batch` samples (times every strategy)
    go through one forward pass per step: the step is bound by reading the weights, so a wider batch
    costs little more than a narrow one."""
    names = list(strategies)
    nll = {s: 0.0 for s in names}
    count = 0
    mem = {s: [] for s in names}
    _check_samples(model, samples, prefill)
    for pol, _ in strategies.values():
        refuse_prompt_scoring(pol, "perplexity, which evicts as it reads,")
    steps = sum(len(x) - prefill for x in samples)
    bar = tqdm(total=steps, desc="ppl", disable=not progress, unit="tok")
    chunk = options.prefill_chunk
    for first in range(0, len(samples), samples_per_batch):
        group = torch.tensor(samples[first:first + samples_per_batch], device=device)  # [S, L]
        ids_t = group.repeat_interleave(len(names), 0)  # row r: sample r // len(names), strategy r % len(names)
        rows, seq_len = ids_t.shape
        caches = [make_cache(model, pol, bits, options, device, dtype) for _ in range(len(group))
                  for pol, bits in strategies.values()]
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
    return _results(strategies, nll, count, {s: [m["held_bytes"] for m in mem[s]] for s in names},
                    {s: [m["full_bf16_bytes"] for m in mem[s]] for s in names})


def _check_samples(model, samples, prefill: int):
    if any(len(x) != len(samples[0]) for x in samples):
        raise KvboundError("perplexity: all samples must have the same length")
    model.config.check_length(len(samples[0]))
    if prefill < 1 or prefill >= len(samples[0]):
        raise KvboundError(f"--prefill must be in [1, seq-len), got {prefill}")


def _results(strategies: dict, nll: dict, count: int, held: dict, full: dict) -> dict:
    """Per strategy: perplexity over `count` scored tokens, mean KV bytes held and of a full bf16 cache (lists
    per sample), the compression, and the change against the first strategy."""
    out = {}
    for s, (policy, bits) in strategies.items():
        kv, whole = sum(held[s]) / len(held[s]), sum(full[s]) / len(full[s])
        out[s] = {"ppl": math.exp(nll[s] / count), "policy": policy.describe(), "kv_bits": bits,
                  "kv_held_bytes": kv, "kv_full_bf16_bytes": whole, "compression_vs_full_bf16": whole / kv}
    base = out[next(iter(out))]["ppl"]
    for r in out.values():
        r["delta_pct"] = 100 * (r["ppl"] / base - 1)
    return out


def engine_perplexity(model, samples, strategies: dict, options: CacheOptions, prefill: int, progress=True) -> dict:
    """`perplexity` through the serving engine: each (sample, strategy) is one request whose prompt is the
    sample's first `prefill` tokens and whose continuation is fed as teacher tokens, scored token by token,
    every request in one continuous batch over the engine's paged pool (packed with a +kv8 / +kv4 width: one
    engine per width). The same numbers as `perplexity`, through the code that serves."""
    from ..engine import SamplingParams
    check_engine_strategies(strategies, options)
    names = list(strategies)
    _check_samples(model, samples, prefill)
    nll = {s: 0.0 for s in names}
    held = {s: [] for s in names}
    count = sum(len(x) - prefill for x in samples)
    bar = tqdm(total=count * len(names), desc="ppl (engine)", disable=not progress, unit="tok")
    runs, owner = [], []
    for bits in kv_widths(b for _, b in strategies.values()):  # one engine per width
        for sample in samples:
            for s in [s for s in names if strategies[s][1] == bits]:
                rest = sample[prefill:]
                params = SamplingParams(max_tokens=len(rest), teacher_tokens=rest, logprobs=0, ignore_eos=True)
                runs.append((strategies[s][0], bits, sample[:prefill], params))
                owner.append(s)

    def sizing(mine):
        return dict(kv_cache_tokens=len(mine) * (len(samples[0]) + 32), max_num_seqs=len(mine),
                    max_num_batched_tokens=max(2048, options.prefill_chunk))

    def done(j, completion):
        nll[owner[j]] -= sum(lp["logprob"] for lp in completion.logprobs)
        held[owner[j]].append(completion.peak_kv_bytes)
        bar.update(len(completion.logprobs))
    engine_completions(model, None, runs, options, sizing, done)
    bar.close()
    full = len(samples[0]) * model.config.kv_bytes_per_token(2)
    return _results(strategies, nll, count, held, {s: [full] for s in names})


def print_ppl_table(res: dict, title: str = ""):
    if title:
        print(title)
    print(f"{'strategy':<24} {'PPL':>9} {'Δ% vs ' + next(iter(res)):>16} {'KV held (KiB)':>14} {'vs full bf16':>12}")
    for s, r in res.items():
        print(f"{s:<24} {r['ppl']:>9.3f} {r['delta_pct']:>+16.2f} {r['kv_held_bytes'] / 1024:>14.1f} "
              f"{r['compression_vs_full_bf16']:>11.2f}x")
