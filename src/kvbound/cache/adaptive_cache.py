"""KV cache of one sequence whose heads and layers keep different numbers of tokens (AdaKV, PyramidKV).

`KVCache` gives each KV head of a layer its own column of slots, all columns the same length, so a head holds
exactly its equal share. Here every (slot, column) place of a layer is an entry that any KV head may own: the
layout of `KVCache` ([slots, heads] places, K/V in a `store.KVStore`) plus an owner per place. A layer holds at
most heads x its budget per head (`policy.head_budgets`) after each eviction, however its heads share them.
Layers whose budgets differ (PyramidKV) share the store's rows: a layer that keeps more than the mean borrows
rows that layers keeping fewer never use (`stacked.layer_places`), so the store holds what a uniform budget's would, in
the engine's pool too. Each query head attends to its KV head's entries only (a mask over the layer's entries;
the PyTorch route, for a batch of one). Evicted entries become holes that new tokens fill, lowest first, so
nothing moves; the first tokens take slot j, column h for token j and head h, as in `KVCache`, which keeps a
protected prefix's blocks shareable. In the engine (a `PagedStore`) prefill pieces run the cache's own `attend`
per sequence, and decodes the batched "shared" steps (`steps.shared_decode`), below the budget too.
"""
from __future__ import annotations

from copy import copy

import torch

from ..errors import KvboundError
from ..kernels import fold_scores
from .policies import pinned_count
from .stacked import layer_places, release
from .steps import fresh_scores, owner_attention, rescored
from .store import DenseStore


class AdaptiveKVCache:
    ring = None  # no mixed widths (`KVCache.ring`)

    def __init__(self, config, policy, device="cpu", dtype=torch.float32, kv_bits=None, rotate_keys=None,
                 store=None, stacked=None, **_):
        """dtype: the dtype K/V are stored in. store: where K/V live (default: a dense store of its own; the
        engine passes a PagedStore). stacked: (StackedMeta, row) holding this cache's owners, positions, scores
        and spare places, so that the engine's steady decodes of such caches run as one batch
        (`steps.shared_decode`). Quantized widths of its own and re-indexed positions live in `KVCache`."""
        if kv_bits is not None or rotate_keys is not None:
            raise KvboundError(f"{policy.name}: per-head budgets store K/V unquantized at stream positions "
                               "(no --kv-bits, no --reindex-positions)")
        self.cfg, self.policy, self.device = config, policy, device
        self.bounded, self.budget, self.rotate_keys = True, policy.budget, None
        layers, self.heads = config.num_layers, config.num_kv_heads
        self.budgets = [policy.head_budgets(layer, layers) for layer in range(layers)]
        sure = min(s for s, _ in self.budgets)
        protected = pinned_count(policy.sink, policy.pinned) + policy.recent
        if protected > sure:
            raise KvboundError(f"{policy.name}: sinks, pinned spans and the recent window ({protected} tokens) do "
                               f"not fit the smallest per-head budget of this {layers}-layer model ({sure})")
        self.rows = [share + policy.evict_every for _, share in self.budgets]  # place rows each layer may use
        self.slots = max(self.rows)
        self.store_rows = -(-sum(self.rows) // layers)  # what the store holds per layer: the mean layer's rows
        self.places = layer_places(self.rows, device)
        self.store = store if store is not None else DenseStore(layers, self.store_rows, self.heads,
                                                                config.head_dim, device, dtype)
        self.stacked = stacked
        if stacked is not None:
            stacked[0].hold(stacked[1], self)
            self.owner.fill_(-1)
            self.pos.fill_(-1)
            self.score.zero_()
        else:
            shape = (layers, self.slots, self.heads)
            self.owner = torch.full(shape, -1, dtype=torch.int16, device=device)  # each place's KV head, -1 free
            self.pos = torch.full(shape, -1, dtype=torch.int32, device=device)
            self.score = torch.zeros(shape, dtype=torch.float32, device=device)
            self.spare = torch.zeros((layers, self.heads), dtype=torch.long, device=device)
        self.steady = [False] * layers  # a layer that evicted one step's tokens: exactly its spare places are free
        self.filling = False  # a layer below its budget takes the next slot's places for each decode (`take_spare`)
        self.used = 0  # local slots [0, used) may hold entries
        self.seen = 0

    @property
    def capacity(self) -> int:
        return self.store_rows

    def bind_stacked(self):
        """Point owner, pos, score and spare at this cache's row of its stacked metadata (again when rows grow)."""
        meta, row = self.stacked
        self.owner, self.pos, self.score, self.spare = (x[row] for x in (meta.owner, meta.pos, meta.score, meta.spare))

    def __len__(self) -> int:
        """Tokens held per head in the first layer, on average (read from the device: a cache's truth value is
        not its length, so test `cache is None`, never `not cache`)."""
        return int((self.owner[0] >= 0).sum()) // self.heads

    def next_positions(self, t: int) -> torch.Tensor:
        return torch.arange(self.seen, self.seen + t, device=self.device)

    def advance(self, t: int):
        self.seen += t

    # --- used by the paged engine ---------------------------------------------------------------
    def step_kind(self, t: int) -> str | None:
        """"shared" (a steady decode on stacked rows, batched: `steps.shared_decode`), or None (this cache's own
        `attend`)."""
        return "shared" if t == 1 and self.stacked is not None and (self.filling or all(self.steady)) else None

    @property
    def table_row(self) -> int:
        return self.store.row

    def slots_needed(self, t: int, layer: int = 0) -> int:
        return min(self.store_rows, self.used + t)

    def _room(self, layer: int, t: int) -> int:
        """Place rows the layer may fill this step: up to its own, within what `prepare` made the store hold
        (all of it before any row is borrowed)."""
        n = min(self.rows[layer], self.used + t)
        return n if self.store.capacity >= self.store_rows else min(n, self.store.capacity)

    def _rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(store layer, store slot) of the layer's first n place rows."""
        at_layer, row = self.places[layer]
        return at_layer[:n], self.store.slot_table(self.store_rows if n > self.store_rows else n).long()[row[:n]]

    def _gather(self, layer: int, n: int):
        """K, V of the layer's first n place rows, [n, heads, D] each."""
        at_layer, slots = self._rows(layer, n)
        storage = self.store.storage
        if n <= self.store_rows:  # all its own
            return storage.gather(layer, slots)
        k = v = None
        for lay in at_layer.unique().tolist():
            mine = at_layer == lay
            kl, vl = storage.gather(lay, slots[mine])
            if k is None:
                k, v = kl.new_empty(n, *kl.shape[1:]), vl.new_empty(n, *vl.shape[1:])
            k[mine], v[mine] = kl, vl
        return k, v

    def writable_from(self) -> int:
        return self.policy.protected_prefix

    def prepare(self, t: int):
        """Room for t more tokens' entries, and private copies of the shared blocks they may write."""
        if self.slots_needed(t) > self.store.capacity:
            self.store.grow(self.slots_needed(t))
        self.store.make_private(self.writable_from() // self.store.pool.block_size)

    def take_spare(self):
        """Before a decode in the paged engine: each layer that has not evicted yet (at its budget or below) takes
        the next slot's places as its heads' spares, where its own `attend` would write them, so that the cache's
        decodes join the batched "shared" group; a layer drops no place until it is full. Steady layers' spares
        come from the keep rule."""
        if self.stacked is not None and not self.filling and not all(self.steady):
            nxt = self.used * self.heads + torch.arange(self.heads, device=self.spare.device)
            for layer, steady in enumerate(self.steady):
                if not steady:
                    self.spare[layer] = nxt
            self.filling = True

    def decode_slots(self) -> int:
        """The local slots a decode attends over: those holding tokens and the new token's."""
        return min(self.used + 1, self.slots)

    def decoded(self):
        """Bookkeeping after a batched "shared" step: a cache filling up holds one more slot, and a layer whose rows
        are all in use evicted, so exactly its spares are free."""
        if self.filling:
            self.used += 1
            self.steady = [self.used >= rows for rows in self.rows]
            self.filling = not all(self.steady)
        self.advance(1)

    def release(self):
        release(self)

    def snapshot(self) -> dict:
        return dict(slots=self.store.capacity, bytes=self.store.pool.read_blocks(self.store.blocks),
                    meta=[x.cpu() for x in (self.owner, self.pos, self.score, self.spare)], used=self.used,
                    seen=self.seen, steady=list(self.steady), filling=self.filling)

    def restore(self, state: dict):
        if self.seen:
            raise KvboundError("restore: the cache already holds tokens")
        self.store.grow(state["slots"])
        self.store.pool.write_blocks(self.store.blocks, state["bytes"])
        for x, saved in zip((self.owner, self.pos, self.score, self.spare), state["meta"]):
            x.copy_(saved)
        self.used, self.seen, self.steady = state["used"], state["seen"], list(state["steady"])
        self.filling = state["filling"]

    def adopt_prefix(self, t: int):
        """Local slots [0, t) already hold tokens [0, t) in every head (a prefix-cache hit)."""
        if self.seen:
            raise KvboundError("adopt_prefix: the cache already holds tokens")
        if t > self.store.capacity:
            self.store.grow(t)
        self.owner[:, :t] = torch.arange(self.heads, dtype=self.owner.dtype, device=self.device)
        self.pos[:, :t] = torch.arange(t, dtype=self.pos.dtype, device=self.device)[:, None]
        self.used = self.seen = t

    def fork(self) -> "AdaptiveKVCache":
        """A copy sharing this cache's blocks, with a stacked row of its own when one is free (`KVCache.fork`)."""
        child = copy(self)
        child.store = self.store.fork()
        child.steady = list(self.steady)
        child.stacked = None
        if self.stacked is not None:
            self.stacked[0].fork(self.stacked[1], child)
        if child.stacked is None:
            child.owner, child.pos, child.score, child.spare = (x.clone() for x in (self.owner, self.pos, self.score,
                                                                                     self.spare))
        return child

    # --- called by each attention layer -------------------------------------------------------
    def attend(self, layer: int, q, k, v, positions):
        """Attend the t new tokens over the layer's entries and themselves, fold this step's attention into the
        scores, keep the layer's budget if over it, and write the kept new tokens into free places."""
        t, h, d = k.shape
        self.filling = False  # its spares are not the next slot's once this step writes the lowest free places
        storage = self.store.storage
        used = min(self.used, self.rows[layer])
        held = (self.owner[layer, :used] >= 0).flatten().nonzero()[:, 0]  # places: slot * heads + column
        meta = [x[layer].view(-1) for x in (self.owner, self.pos, self.score)]
        if used:
            kc, vc = self._gather(layer, used)
            kc, vc = kc.flatten(0, 1)[held], vc.flatten(0, 1)[held]
        else:
            kc = vc = k.new_zeros(0, d)
        own = torch.cat([meta[0][held], torch.arange(h, device=k.device, dtype=meta[0].dtype).repeat(t)])
        pos = torch.cat([meta[1][held], positions.to(torch.int32).repeat_interleave(h)])
        ks = torch.cat([kc.to(q.dtype), storage.roundtrip(layer, k).reshape(t * h, d).to(q.dtype)])
        vs = torch.cat([vc.to(q.dtype), storage.roundtrip(layer, v).reshape(t * h, d).to(q.dtype)])
        out, step = self._attention(q, ks, vs, own, pos, positions)
        fresh = fresh_scores(self.policy, k, self.score).flatten()
        score = self._folded(step, own, pos, ks, torch.cat([meta[2][held], fresh]), t)
        sure, share = self.budgets[layer]
        keep = torch.ones_like(pos, dtype=torch.bool)
        evicted = len(pos) > h * (share + self.policy.evict_every - 1)
        if evicted:
            keep = self.policy.keep_entries(pos, score, own, h, sure, h * share)
        m = len(held)
        meta[0][held[~keep[:m]]] = -1
        meta[1][held[~keep[:m]]] = -1
        meta[2][held] = score[:m]
        self._write(layer, self._room(layer, t), k, v, keep[m:], (own[m:], pos[m:], score[m:]), meta)
        if evicted and self.policy.evict_every == 1:
            rows = self.rows[layer]
            self.spare[layer] = (meta[0][:rows * h] < 0).nonzero()[:, 0]  # the one free place per head's worth
            self.steady[layer], self.used = True, max(self.used, rows)
        return out

    def _write(self, layer, rows, k, v, keep, new_meta, meta):
        """The kept new entries (token-major `keep` [t * heads]) into the lowest free places of the layer's
        first `rows` place rows."""
        new = keep.nonzero()[:, 0]
        if not len(new):
            return
        free = (meta[0][:rows * self.heads] < 0).nonzero()[:len(new), 0]
        assert len(free) == len(new), "no free place for a kept token"
        slots, cols = free // self.heads, free % self.heads
        d = k.shape[-1]
        at_layer, at_slot = self._rows(layer, rows)
        at_layer, at_slot = at_layer[slots], at_slot[slots]
        ks, vs = k.reshape(-1, d)[new][:, None], v.reshape(-1, d)[new][:, None]
        for lay in ([layer] if rows <= self.store_rows else at_layer.unique().tolist()):  # borrowed rows: by layer
            mine = at_layer == lay
            self.store.storage.write(lay, at_slot[mine][:, None], ks[mine], vs[mine], cols[mine][:, None])
        for x, y in zip(meta, new_meta):
            x[free] = y[new].to(x.dtype)
        self.used = max(self.used, int(slots.max()) + 1)

    def _attention(self, q, ks, vs, own, pos, positions):
        """Each query head over its KV head's entries at positions up to its own (`steps.owner_attention`):
        out [t, Hq, D], and each entry's attention over the last `policy.score_window` queries [E] or None."""
        t, hq, _ = q.shape
        group = torch.arange(hq, device=q.device) // (hq // self.heads)
        mask = (own[None, None, :] == group[None, :, None]) & (pos[None, None, :] <= positions[:, None, None])
        out, step = owner_attention(q[None], ks[None], vs[None], mask[None], self.policy,
                                    t - min(t, self.policy.score_window or t))
        return out[0], None if step is None else step[0]

    def _folded(self, step, own, pos, ks, score, t):
        """The candidates' scores after this step, from their scores before it: a decode step's attention folds
        in; a prefill piece's goes through the policy's `piece_scores` one head at a time (SnapKV pools along
        each head's stream order); KeyDiff rescores each head's keys."""
        if step is not None and t == 1:
            score = fold_scores(score, step, self.policy.fold, self.policy.fold_decay)
            step = None
        if step is None and not self.policy.rescores:
            return score
        out = torch.empty_like(score)
        for head in range(self.heads):
            mine = (own == head).nonzero()[:, 0]
            one = score[mine, None] if step is None else self.policy.piece_scores(score[mine, None], step[mine, None],
                                                                                  pos[mine, None])
            out[mine] = rescored(self.policy, one, ks[mine, None], pos[mine, None])[:, 0]
        return out

    # --- introspection ------------------------------------------------------------------------
    def positions_held(self, layer: int) -> torch.Tensor:
        """Stream positions held by each head of a layer, [most held by a head, heads], -1 where a head holds fewer."""
        per_head = [self.kept_positions(layer, head) for head in range(self.heads)]
        width = max(map(len, per_head))
        return torch.tensor([p + [-1] * (width - len(p)) for p in per_head], dtype=torch.int32).T

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return sorted(self.pos[layer][self.owner[layer] == head].tolist())

    def nbytes(self) -> dict:
        """KV bytes held (K, V, and per entry its position, score and owner), as `KVCache.nbytes` counts them."""
        live = self.owner >= 0
        entries = int(live.sum())
        d = self.cfg.head_dim
        total = sum(self.store.bytes_held(layer, live[layer]) for layer in range(len(live))) + entries * (4 + 4 + 2)
        bf16 = 2 * 2 * self.heads * d * self.seen * len(live)
        return {"held_bytes": total, "tokens_held": len(self), "full_bf16_bytes": bf16,
                "bytes_per_token_layer": self.store.bytes_per_token(),
                "compression": bf16 / total if total else float("inf")}
