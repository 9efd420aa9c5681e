"""KVzip's score of a prompt's tokens (`policies.KVzipPolicy`; Kim et al., 2025): the model reads the prompt a
second time, right after itself, and each held key scores the most attention any query of that second reading gives
it, over the query heads of its KV head. Tokens the model needs to reproduce the context score high, whatever
question comes next. `engine.generate.prefill` runs the pass; `KVCache.keep_scored` keeps by its scores.
"""
from __future__ import annotations

import torch

from ..errors import KvboundError


class ReconstructionPass:
    """A `models.llama.LayerAttention` for the second reading: each piece attends over the full cache `held` (an
    unbounded `KVCache` holding the prompt) and itself, causally, and writes nothing. `best` [layers, n, H] holds,
    for each of the n held tokens, the highest probability any query of any piece gave it."""

    def __init__(self, held):
        self.held = held
        self.n = held.n[0]
        layers, heads = held.pos.shape[0], held.pos.shape[2]
        self.best = torch.zeros((layers, self.n, heads), dtype=torch.float32, device=held.device)

    def attend(self, layer: int, q, k, v, positions):
        storage = self.held.store.storage
        kc, vc = storage.gather(layer, self.held.store.slot_table(self.n)[None].long())
        out, seen = attention_and_best(q, torch.cat([kc[0].to(k.dtype), k]), torch.cat([vc[0].to(v.dtype), v]),
                                       self.n)
        self.best[layer] = torch.maximum(self.best[layer], seen)
        return out


PROBS = 1 << 26  # attention probabilities computed at once: a long piece's scratch stays at 256 MiB


def attention_and_best(q, k, v, n: int):
    """Queries q [t, Hq, D] over keys and values [n + t, H, D], the last t their own (causal among them): out
    [t, Hq, D], and each of the first n keys' highest probability over the queries and the Hq / H query heads of its
    KV head, [n, H]. fp32, explicit (the probabilities are the point), in blocks of queries that keep the scratch
    within `PROBS` probabilities."""
    t, hq, d = q.shape
    step = max(1, PROBS // (hq * k.shape[0]))
    outs, best = [], torch.zeros(n, k.shape[1], dtype=torch.float32, device=q.device)
    for i in range(0, t, step):
        out, seen = _block(q[i:i + step], k[:n + i + step], v[:n + i + step], n, i)
        outs.append(out)
        best = torch.maximum(best, seen)
    return torch.cat(outs), best


def _block(q, k, v, n: int, first: int):
    """`attention_and_best` for queries [first, first + b) of the piece, over keys [0, n + first + b)."""
    b, hq, d = q.shape
    h = k.shape[1]
    qg = q.float().view(b, h, hq // h, d)
    logits = torch.einsum("thgd,shd->hgts", qg, k.float()) * d ** -0.5  # [H, G, b, keys]
    own = torch.arange(k.shape[0] - n, device=q.device)[None, :] <= first + torch.arange(b, device=q.device)[:, None]
    seen = torch.cat([torch.ones(b, n, dtype=torch.bool, device=q.device), own], 1)
    probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
    out = torch.einsum("hgts,shd->thgd", probs, v.float()).reshape(b, hq, d).to(q.dtype)
    return out, probs[..., :n].amax(dim=(1, 2)).T


def check_scorable(cache, held) -> int:
    """`keep_scored`'s precondition: an empty `cache` and more tokens in the full cache `held` than its room. Returns
    their number."""
    n = held.n[0]
    if cache.seen or n < cache.capacity:
        raise KvboundError(f"keep_scored: needs an empty cache and more than {cache.capacity - 1} tokens, got "
                           f"{cache.seen} held and {n}")
    return n
