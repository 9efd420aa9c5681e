"""KVzip's score of a prompt's tokens (`policies.KVzipPolicy`; Kim et al., 2025): the model reads the prompt a
second time, right after itself, and each held key scores the most attention any query of that second reading gives
it, over the query heads of its KV head. Tokens the model needs to reproduce the context score high, whatever
question comes next. `engine.generate.prefill` runs the pass; `KVCache.keep_scored` keeps by its scores.
"""
from __future__ import annotations

import torch

from ..errors import KvboundError
from ..kernels.reference import causal_attention_batch


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
        kc, vc = prompt_kv(self.held, layer)
        keys, values = torch.cat([kc.to(k.dtype), k]), torch.cat([vc.to(v.dtype), v])
        out, seen = causal_attention_batch(q[None], keys[None], values[None], "max")  # FlashAttention on CUDA
        self.best[layer] = torch.maximum(self.best[layer], seen[0, :self.n])
        return out[0]


class ReadingBatch:
    """A `models.llama.LayerAttention` for one forward over several second readings' pieces: the rows of piece i
    (`lengths[i]` of them, in order) go to `passes[i]`, so the weights are read once for them all."""

    def __init__(self, passes: list[ReconstructionPass], lengths: list[int]):
        self.passes, self.lengths = passes, lengths

    def attend(self, layer: int, q, k, v, positions):
        parts = zip(self.passes, q.split(self.lengths), k.split(self.lengths), v.split(self.lengths))
        return torch.cat([part.attend(layer, qs, ks, vs, None) for part, qs, ks, vs in parts])


def check_scorable(cache, held) -> int:
    """`keep_scored`'s precondition: an empty `cache` and more tokens in the full cache `held` than its room. Returns
    their number."""
    n = held.n[0]
    if cache.seen or n < cache.capacity:
        raise KvboundError(f"keep_scored: needs an empty cache and more than {cache.capacity - 1} tokens, got "
                           f"{cache.seen} held and {n}")
    return n


def prompt_kv(held, layer: int):
    """The K and V [n, H, D] of the n tokens the unbounded cache `held` holds, in one layer."""
    k, v = held.store.storage.gather(layer, held.store.slot_table(held.n[0])[None].long())
    return k[0], v[0]
