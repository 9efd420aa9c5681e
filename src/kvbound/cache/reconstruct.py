"""KVzip's score of a prompt's tokens (`policies.KVzipPolicy`; Kim et al., 2025): the model reads the prompt a
second time, right after itself, and each held key scores the most attention any query of that second reading gives
it, over the query heads of its KV head. Tokens the model needs to reproduce the context score high, whatever
question comes next. As in KVzip, the context is scored in blocks (`KVzipPolicy.chunk`): a piece's probabilities
are over the sinks, its own block and itself only, so each block's tokens compete among themselves.
`engine.generate.prefill` runs the pass, and the engine reads the pieces of every second reading under way in one
forward (`ReadingBatch`); `KVCache.keep_scored` keeps by the scores.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ..errors import KvboundError
from ..kernels.reference import causal_attention_batch, flash_ok, varlen_attention_lse


def next_piece(at: int, chunk: int, n: int, block: int) -> tuple[int, tuple[int, int]]:
    """The second reading's piece from token `at` of an n-token context: its length, up to `chunk` and ending at
    its block of `block` tokens (KVzip's, `KVzipPolicy.chunk`; 0: the whole context), and that block [lo, hi)."""
    block = block or n
    lo = at - at % block
    hi = min(n, lo + block)
    return min(chunk, hi - at), (lo, hi)


class ReconstructionPass:
    """A `models.llama.LayerAttention` for the second reading: each piece attends over the full cache `held` (an
    unbounded `KVCache` holding the prompt) and itself, causally, and writes nothing. `best` [layers, n, H] holds,
    for each of the n held tokens, the highest probability any query of any piece gave it, the probabilities over
    the keys `scored_keys` gives: the piece's block of held tokens [lo, hi) (`span`, set before each piece), the
    first `sink` held tokens before it, and the piece."""

    def __init__(self, held, sink: int = 0):
        self.held, self.sink = held, sink
        self.n = held.n[0]
        self.span = (0, self.n)
        layers, heads = held.pos.shape[0], held.pos.shape[2]
        self.best = torch.zeros((layers, self.n, heads), dtype=torch.float32, device=held.device)

    @property
    def whole(self) -> bool:
        """Whether the piece's scores are over every held token, as its attention is: one pass gives both."""
        return self.span == (0, self.n)

    def scored_keys(self, kc, k):
        """The held keys (or values) `kc` a piece's scores are over, then the piece's own `k`; and where the span
        starts in them."""
        lo, hi = self.span
        s = min(self.sink, lo)
        return torch.cat([kc[:s], kc[lo:hi], k]), s

    def keep_best(self, layer: int, seen, s: int):
        """Fold a piece's scores `seen` [keys, H] (over `scored_keys`, the span from s) into its span's best."""
        lo, hi = self.span
        self.best[layer, lo:hi] = torch.maximum(self.best[layer, lo:hi], seen[s:s + hi - lo])

    def attend(self, layer: int, q, k, v, positions):
        kc, vc = prompt_kv(self.held, layer)
        kc, vc = kc.to(k.dtype), vc.to(v.dtype)
        mode = "max" if self.whole else None
        out, seen = causal_attention_batch(q[None], torch.cat([kc, k])[None], torch.cat([vc, v])[None], mode)
        s = 0
        if not self.whole:  # FlashAttention on CUDA, both passes
            (keys, s), (values, _) = self.scored_keys(kc, k), self.scored_keys(vc, v)
            seen = causal_attention_batch(q[None], keys[None], values[None], "max")[1]
        self.keep_best(layer, seen[0], s)
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
    its context's n_b, then its own t; each context's scores come from `key_scores`' varlen mode over each piece's
    `scored_keys` (a second varlen call gives their softmax's normalizers unless every piece scores its whole
    context), as `ReconstructionPass.attend` gives them one piece at a time."""

    def __init__(self, passes: list[ReconstructionPass], t: int, device):
        self.passes, self.t, self.device = passes, t, device
        self.whole = all(p.whole for p in passes)
        self.cu_q = torch.arange(0, (len(passes) + 1) * t, t, dtype=torch.int32, device=device)
        self.keys = self._rows([p.n + t for p in passes])
        self.scored = self.keys if self.whole else self._rows([min(p.sink, p.span[0]) + p.span[1] - p.span[0] + t
                                                               for p in passes])

    def _rows(self, used: list[int]):
        """(row starts on the host, cumulative starts, lengths, longest) of pieces of `used` keys each."""
        starts = list(accumulate(used[:-1], initial=0))  # on the host: no device sync to read them back
        cu = torch.tensor(starts + [sum(used)], dtype=torch.int32, device=self.device)
        return starts, cu, torch.tensor(used, dtype=torch.int32, device=self.device), max(used)

    def attend(self, layer: int, qs, ks, vs):
        from ..kernels.triton_prefill import key_scores
        held = [prompt_kv(p.held, layer) for p in self.passes]
        held = [(kc.to(k.dtype), vc.to(k.dtype)) for (kc, vc), k in zip(held, ks)]
        keys = torch.cat([x for (kc, _), k in zip(held, ks) for x in (kc, k)])
        values = torch.cat([x for (_, vc), v in zip(held, vs) for x in (vc, v)])
        q = torch.stack(qs)
        _, cu, _, longest = self.keys
        out, lse = varlen_attention_lse(q.flatten(0, 1), keys, values, self.cu_q, cu, self.t, longest)
        begins = [0] * len(self.passes)
        if not self.whole:
            scored = [p.scored_keys(kc, k) for p, (kc, _), k in zip(self.passes, held, ks)]
            keys, begins = torch.cat([x for x, _ in scored]), [s for _, s in scored]
            values = torch.cat([p.scored_keys(vc, v)[0] for p, (_, vc), v in zip(self.passes, held, vs)])
            _, cu, _, longest = self.scored
            lse = varlen_attention_lse(q.flatten(0, 1), keys, values, self.cu_q, cu, self.t, longest)[1]
        starts, cu, used, longest = self.scored
        seen = key_scores(q, keys, lse, 0, False, cu[:-1], used, longest, best=True)
        for p, start, s in zip(self.passes, starts, begins):
            p.keep_best(layer, seen[start:], s)
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
