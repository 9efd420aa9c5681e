"""KVzip's score of a prompt's tokens (`policies.KVzipPolicy`; Kim et al., 2025): the model reads the prompt a
second time, right after itself, and each held key scores the most attention any query of that second reading gives
it, over the query heads of its KV head. Tokens the model needs to reproduce the context score high, whatever
question comes next. `engine.generate.prefill` runs the pass, and the engine reads the pieces of every second reading
under way in one forward (`ReadingBatch`); `KVCache.keep_scored` keeps by the scores.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ..errors import KvboundError
from ..kernels.reference import causal_attention_batch, flash_ok, varlen_attention_lse


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
    (`lengths[i]` of them, in order) go to `passes[i]`, so the weights are read once for them all. On CUDA the pieces
    of one length attend in one FlashAttention varlen call (`PiecesOfOneLength`), which fills the GPU where one piece's
    heads alone would not."""

    def __init__(self, passes: list[ReconstructionPass], lengths: list[int]):
        self.passes, self.lengths = passes, lengths
        self.groups: dict[int, list[int]] = {}  # piece length -> the pieces of that length
        for i, t in enumerate(lengths):
            self.groups.setdefault(t, []).append(i)
        self.by_length: dict[int, PiecesOfOneLength] = {}  # CUDA: the varlen call of each length's pieces

    def attend(self, layer: int, q, k, v, positions):
        qs, ks, vs = q.split(self.lengths), k.split(self.lengths), v.split(self.lengths)
        outs = [None] * len(self.passes)
        for t, rows in self.groups.items():
            if len(rows) > 1 and flash_ok(q):
                if t not in self.by_length:
                    self.by_length[t] = PiecesOfOneLength([self.passes[i] for i in rows], t, q.device)
                read = self.by_length[t].attend(layer, [qs[i] for i in rows], [ks[i] for i in rows],
                                               [vs[i] for i in rows])
            else:
                read = [self.passes[i].attend(layer, qs[i], ks[i], vs[i], None) for i in rows]
            for i, out in zip(rows, read):
                outs[i] = out
        return torch.cat(outs)


class PiecesOfOneLength:
    """B pieces of t tokens, each after its own held context, attended in one varlen call: the keys of piece b are
    its context's n_b, then its own t, from row starts[b]; each context's scores come from `key_scores`' varlen
    mode, as `causal_attention_batch(..., "max")` gives them one piece at a time."""

    def __init__(self, passes: list[ReconstructionPass], t: int, device):
        self.passes, self.t = passes, t
        used = [p.n + t for p in passes]
        self.max_keys = max(used)
        self.starts = list(accumulate(used[:-1], initial=0))  # on the host: no device sync to read them back
        self.cu_k = torch.tensor(self.starts + [sum(used)], dtype=torch.int32, device=device)
        self.used = torch.tensor(used, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(0, (len(passes) + 1) * t, t, dtype=torch.int32, device=device)

    def attend(self, layer: int, qs, ks, vs):
        from ..kernels.triton_prefill import key_scores
        held = [prompt_kv(p.held, layer) for p in self.passes]
        keys = torch.cat([x for (kc, _), k in zip(held, ks) for x in (kc.to(k.dtype), k)])
        values = torch.cat([x for (_, vc), v in zip(held, vs) for x in (vc.to(v.dtype), v)])
        q = torch.stack(qs)
        out, lse = varlen_attention_lse(q.flatten(0, 1), keys, values, self.cu_q, self.cu_k, self.t, self.max_keys)
        seen = key_scores(q, keys, lse, 0, False, self.cu_k[:-1], self.used, self.max_keys, best=True)
        for p, start in zip(self.passes, self.starts):
            p.best[layer] = torch.maximum(p.best[layer], seen[start:start + p.n])
        return out.view(q.shape).unbind(0)


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
