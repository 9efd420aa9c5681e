"""Stacked metadata: positions, scores, spare slots (and merged-token counts) of many bounded caches that share one
policy.

One row per cache, so the engine reads and updates a batch of them with one operation per layer; each
cache holds views of its row (`KVCache(meta=...)`) and works on them as a single cache would.
"""
from __future__ import annotations

import torch


def stackable(policy) -> bool:
    """Bounded policies whose steps run batched on stacked rows: one eviction per step (heads may share a layer's
    budget, AdaKV's rows also holding an owner per place; layers may keep different budgets, PyramidKV's, reading
    rows of other layers through `layer_places`), or, evicting every e steps, their decodes with room as evictions
    of nothing and the one that fills the room as a one-token "chunk" (heads and layers of one budget:
    `AdaptiveKVCache` evicts every step)."""
    return policy.bounded and (policy.evict_every == 1 or not policy.adapts)


def layer_places(rows: list[int], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (store layer, store row) of each of its `rows[layer]` place rows, where the store holds the
    mean layer's rows: a layer's rows up to that width are its own, and a layer that keeps more (PyramidKV's first
    layers) borrows the rows past the budget of layers that keep fewer, so a uniform budget's blocks hold them."""
    width = -(-sum(rows) // len(rows))
    lent = [(other, row) for other, n in enumerate(rows) for row in range(n, width)]
    out = []
    for layer, n in enumerate(rows):
        own = min(n, width)
        extra, lent = lent[:n - own], lent[n - own:]
        where = [(layer, row) for row in range(own)] + extra
        out.append(tuple(torch.tensor(x, dtype=torch.long, device=device) for x in zip(*where)))
    return out


def place_slots(places: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, storage) -> torch.Tensor:
    """The slots of a layer's place rows in a storage's view of every layer's slots (`all_layers`, `flat_slots`):
    places, the layer's (store layer, store row) per place row (`layer_places`), or per cache [B, rows]; table [..., W]
    or [B, W], the storage slot of each local slot."""
    store_layer, store_row = places
    slots = table[..., store_row] if store_row.dim() == 1 else table.gather(1, store_row)
    return storage.flat_slots(store_layer.to(table.dtype), slots)


def release(cache):
    """Give a cache's store blocks and its stacked-metadata row back; the cache is unusable afterwards."""
    cache.store.release()
    if cache.stacked is not None:
        cache.stacked[0].give(cache.stacked[1])
        cache.stacked = None


class StackedMeta:
    def __init__(self, policy, layers: int, heads: int, rows: int, device, ring=None, first_rows: int | None = None):
        """Up to `rows` rows, `first_rows` of them allocated at first (all by default), twice as many whenever a
        cache finds none free: a policy that few sequences use holds few rows. ring: mixed widths' residuals for a
        number of rows (a function giving `quant.RecentResiduals`), or None; they grow with the rows. Layers of
        different budgets (PyramidKV's, or the plans of one layers=global policy, each a sequence's own) keep each
        row's plan: its place rows per layer and where they are in the store (`set_plan`), so one batch reads rows
        of different plans."""
        self.policy, self.max_rows = policy, rows
        budgets = [policy.head_budgets(layer, layers) for layer in range(layers)]
        self.sure = [sure for sure, _ in budgets]  # each head's guaranteed places, per layer (one for every plan)
        self.layer_rows = [share + policy.evict_every for _, share in budgets]  # the policy's place rows per layer
        self.layer_width = list(self.layer_rows)  # planned: the most place rows any row's plan gave each layer
        widest = max(self.layer_rows)
        self.planned = policy.layered or policy.needs_plan
        self.rows = rows if first_rows is None else min(rows, first_rows)
        self.ring = None if ring is None else ring(self.rows + 1)
        # the scratch row, last, is where the padding rows of a decode graph write
        shape = (self.rows + 1, layers, widest, heads)
        self.pos = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.score = torch.zeros(shape, device=device) if policy.score else None
        self.count = torch.ones(shape, device=device) if policy.merge else None  # tokens each place stands for
        self.spare = torch.zeros(shape[:2] + shape[3:], dtype=torch.long, device=device)
        # heads sharing a layer's places (AdaKV): each place's head, and spare holds places (slot * heads + column)
        self.owner = torch.full(shape, -1, dtype=torch.int16, device=device) if policy.adapts else None
        # planned: each row's place rows per layer [R + 1, layers], and their (store layer, store row) [R + 1,
        # layers, width] (`layer_places`; past a layer's rows, its first place, never owned)
        self.plan_rows = torch.zeros(shape[:2], dtype=torch.int32, device=device) if self.planned else None
        self.place_layer = torch.zeros(shape[:3], dtype=torch.long, device=device) if self.planned else None
        self.place_row = torch.zeros(shape[:3], dtype=torch.long, device=device) if self.planned else None
        self.free = list(range(self.rows - 1, -1, -1))
        self.holders: dict = {}  # row -> the cache whose views point into it (`bind_stacked` after growing)
        self.generation = 0  # how many times the rows grew or widened: graphs captured over older tensors are stale
        if self.planned:  # the scratch row: the policy's own layout
            self.set_plan(self.scratch_row, self.layer_rows)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor (a row's whole state, as `fork` copies it)."""
        held = (self.pos, self.score, self.spare, self.owner, self.count, self.plan_rows, self.place_layer,
                self.place_row)
        return [t for t in held if t is not None] + (self.ring.tensors() if self.ring is not None else [])

    def set_plan(self, row: int, rows: list[int]):
        """Row `row` holds a cache whose layers use `rows` place rows each (planned metadata): where they are in
        the store, the metadata widened first if a layer uses more rows than it holds."""
        if max(rows) > self.width:
            self._resize(self.rows, max(rows))
        if any(n > w for n, w in zip(rows, self.layer_width)):  # groups read each layer this wide: graphs are stale
            self.layer_width = [max(n, w) for n, w in zip(rows, self.layer_width)]
            self.generation += 1
        at_layer = torch.arange(len(rows))[:, None].repeat(1, self.width)
        at_row = torch.zeros_like(at_layer)
        for layer, (store_layer, store_row) in enumerate(layer_places(rows, "cpu")):
            at_layer[layer, :rows[layer]], at_row[layer, :rows[layer]] = store_layer, store_row
        self.plan_rows[row] = torch.tensor(rows, dtype=torch.int32)
        self.place_layer[row], self.place_row[row] = at_layer, at_row

    @property
    def width(self) -> int:
        """Slots of a row's slot table: its policy's capacity, or the widest layer's rows (PyramidKV)."""
        return self.pos.shape[2]

    @property
    def scratch_row(self) -> int:
        return self.rows

    def take(self) -> int | None:
        """A free row (grown into if none is free and the rows may grow), or None when every row is in use."""
        if not self.free and self.rows < self.max_rows:
            self._grow(min(self.max_rows, 2 * self.rows))
        return self.free.pop() if self.free else None

    def _grow(self, rows: int):
        self._resize(rows, self.width)

    def _resize(self, rows: int, width: int):
        """Reallocate for `rows` rows of `width` place rows a layer, copying the rows in use (stream-ordered after any
        step still running on them), and re-point their caches' views."""
        def grown(t, fill, wide=True):  # wide: [rows, layers, width, ...], widened too
            if t is None:
                return None
            out = torch.full((rows + 1,) + t.shape[1:2] + ((width,) if wide else t.shape[2:3]) + t.shape[3:], fill,
                             dtype=t.dtype, device=t.device)
            (out[:self.rows, :, :t.shape[2]] if wide else out[:self.rows]).copy_(t[:self.rows])
            return out
        self.pos, self.score, self.owner = grown(self.pos, -1), grown(self.score, 0), grown(self.owner, -1)
        self.count = grown(self.count, 1)
        self.place_layer, self.place_row = grown(self.place_layer, 0), grown(self.place_row, 0)
        self.spare, self.plan_rows = grown(self.spare, 0, False), grown(self.plan_rows, 0, False)
        if self.ring is not None:
            self.ring = self.ring.mapped(lambda t: grown(t, 0, False))
        self.free = list(range(rows - 1, self.rows - 1, -1)) + self.free
        self.rows, self.generation = rows, self.generation + 1
        if self.planned:
            self.set_plan(self.scratch_row, self.layer_rows)
        for cache in self.holders.values():
            cache.bind_stacked()

    def hold(self, row: int, cache):
        """Point `cache`'s views at its row, now and whenever the rows grow; planned, the row takes its layout."""
        self.holders[row] = cache
        if self.planned:
            self.set_plan(row, cache.rows)
        cache.bind_stacked()

    def views(self, row: int):
        """(pos, score, spare, count) of one row: [layers, cap, heads] (score None without scores), [layers, heads],
        [layers, cap, heads] (None without merging)."""
        return (self.pos[row], None if self.score is None else self.score[row], self.spare[row],
                None if self.count is None else self.count[row])

    def fork(self, row: int, cache):
        """Give `cache`, a fork of row's cache, a free row holding a copy of `row` (positions, scores, spares, owners,
        residuals), so that its steps batch with the others': `cache.stacked` becomes (self, new row), or None when
        every row is in use."""
        new = self.take()
        cache.stacked = None if new is None else (self, new)
        if new is None:
            return
        for t in self.tensors():
            t[new] = t[row]
        self.holders[new] = cache
        cache.bind_stacked()

    def give(self, row: int):
        self.holders.pop(row, None)
        self.free.append(row)

    @property
    def idle(self) -> bool:
        """No cache holds a row."""
        return len(self.free) == self.rows
