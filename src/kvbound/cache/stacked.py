"""Stacked metadata: positions, scores and spare slots of many bounded caches that share one policy.

One row per cache, so the engine reads and updates a batch of them with one operation per layer; each
cache holds views of its row (`KVCache(meta=...)`) and works on them as a single cache would.
"""
from __future__ import annotations

import torch


def stackable(policy) -> bool:
    """Bounded policies whose steady-state decode runs batched on stacked rows: one eviction per step, and
    every layer the same budget (heads may share one: AdaKV's rows also hold an owner per place)."""
    return policy.bounded and policy.evict_every == 1 and not policy.layered


def release(cache):
    """Give a cache's store blocks and its stacked-metadata row back; the cache is unusable afterwards."""
    cache.store.release()
    if cache.stacked is not None:
        cache.stacked[0].give(cache.stacked[1])
        cache.stacked = None


class StackedMeta:
    def __init__(self, policy, layers: int, heads: int, rows: int, device, ring=None):
        """ring: mixed widths' residuals (`quant.RecentResiduals`) of rows + 1 rows, or None."""
        cap = policy.capacity
        self.policy, self.ring = policy, ring
        self.pos = torch.full((rows + 1, layers, cap, heads), -1, dtype=torch.int32, device=device)
        self.score = torch.zeros((rows + 1, layers, cap, heads), device=device) if policy.score else None
        self.spare = torch.zeros((rows + 1, layers, heads), dtype=torch.long, device=device)
        # heads sharing a layer's places (AdaKV): each place's head, and spare holds places (slot * heads + column);
        # each head's guaranteed places, every layer alike (layered policies are not stackable)
        self.owner = (torch.full((rows + 1, layers, cap, heads), -1, dtype=torch.int16, device=device)
                      if policy.adapts else None)
        self.sure = policy.head_budgets(0, layers)[0]
        self.scratch_row = rows  # the padding rows of a decode graph update this one
        self.free = list(range(rows - 1, -1, -1))

    def take(self) -> int | None:
        """A free row, or None when every row is in use."""
        return self.free.pop() if self.free else None

    def views(self, row: int):
        """(pos, score, spare) of one row: [layers, cap, heads] twice (score None without scores), [layers, heads]."""
        return self.pos[row], None if self.score is None else self.score[row], self.spare[row]

    def give(self, row: int):
        self.free.append(row)

    @property
    def idle(self) -> bool:
        """No cache holds a row."""
        return len(self.free) == self.scratch_row
