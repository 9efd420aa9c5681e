"""Where one sequence's K/V bytes live, and the slot-addressed storage behind them.

Two protocols:
  - `SlotStorage`: K/V of every layer, addressed by slot. The attention steps (`steps.py`) read and write
    it through a slot table, so one step serves a single cache and a batch of caches in a shared pool alike.
    `DenseStore`, `QuantizedStore` (quant.py) and the engine's `BlockPool` (block_pool.py) are storages.
  - `KVStore`: one sequence's cache slots [0, capacity) ("local" slots) and where they live in a storage
    (`slot_table`). A dense or quantized store is its own storage; a `PagedStore` is a sequence's view of
    the shared block pool.
"""
from __future__ import annotations

from copy import copy
from typing import Protocol

import torch

from ..errors import KvboundError


EACH_HEAD = "each head"  # `heads` of a write whose slots [T, H] name one slot per token and head


def at(layer, slots, heads):
    """Index of (slot, head) places in a [layers, slots, heads, ...] tensor: every head of `slots` when
    heads is None, head h of token t at slots[t, h] when heads is EACH_HEAD, else the (slots[i], heads[i])
    pairs (broadcast)."""
    if heads is EACH_HEAD:
        return layer, slots, torch.arange(slots.shape[-1], device=slots.device)
    return (layer, slots) if heads is None else (layer, slots, heads)


class SlotStorage(Protocol):
    exact: bool  # reads back exactly what was written (unquantized)

    def write(self, layer: int, slots, k, v, heads=None) -> None:
        """k, v [T, H, D] into `slots` [T] (every head) or into (slots, heads) pairs [T, H] (`at`)."""

    def gather(self, layer: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape [...]) -> [..., H, D], dequantized."""

    def roundtrip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """What a token written now reads back as (x itself unless quantized)."""

    def kernel_args(self, layer: int):
        """(k_pool, v_pool, quant) for `kernels.decode_attention`: quant is None for unquantized pools, the
        codes' scales and biases for packed ones; None instead of the tuple where no kernel reads the storage."""


class KVStore(Protocol):
    storage: SlotStorage
    capacity: int

    def slot_table(self, n: int) -> torch.Tensor: ...
    def write(self, layer: int, slots, k, v, heads=None) -> None: ...
    def write_range(self, layer: int, start: int, k, v) -> None: ...
    def move(self, layer: int, heads, src, dst) -> None: ...
    def grow(self, slots: int) -> int: ...
    def after_insert(self, layer: int, n: int, pos: torch.Tensor, newest: int) -> None: ...
    def release(self) -> None: ...
    def bytes_per_token(self) -> int: ...
    def bytes_held(self, layer: int, live: torch.Tensor) -> int: ...


class DenseStore:
    """One sequence's K/V in two tensors [layers, slots, heads, head_dim]; its own storage."""
    exact = True

    def __init__(self, layers, slots, heads, head_dim, device, dtype):
        self.k = torch.zeros(layers, slots, heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.storage = self

    @property
    def capacity(self):
        return self.k.shape[1]

    def gather(self, layer, slots):
        return self.k[layer, slots], self.v[layer, slots]

    def write(self, layer, slots, k, v, heads=None):
        self.k[at(layer, slots, heads)] = k.to(self.k.dtype)
        self.v[at(layer, slots, heads)] = v.to(self.v.dtype)

    def write_range(self, layer, start, k, v):
        """New tokens into slots [start, start + T) of every head (a plain slice copy)."""
        self.k[layer, start:start + k.shape[0]] = k
        self.v[layer, start:start + v.shape[0]] = v

    def roundtrip(self, layer, x):
        return x

    def move(self, layer, heads, src, dst):
        """Copy (src[i], heads[i]) to (dst[i], heads[i]) for every i."""
        self.k[layer, dst, heads] = self.k[layer, src, heads]
        self.v[layer, dst, heads] = self.v[layer, src, heads]

    def kernel_args(self, layer):
        return self.k[layer], self.v[layer], None

    def rotate_keys(self, layer, slots, heads, delta, rotate):
        """Keys at (slots[i], heads[i]) -> rotate(keys [N, D], delta [N]), in place."""
        self.k[layer, slots, heads] = rotate(self.k[layer, slots, heads], delta).to(self.k.dtype)

    def slot_table(self, n):
        """Where local slots [0, n) live in the storage: here, the same slots."""
        return torch.arange(n, device=self.k.device, dtype=torch.int32)

    def flat_slots(self, layer, slots):
        """Where slot `slots` of `layer` is in `all_layers`' view: l * slots per layer + s."""
        return slots + layer * self.k.shape[1]

    def all_layers(self) -> "DenseStore":
        """This store with every layer's slots as layer 0's (`flat_slots`), a view of the same tensors until the store
        grows (`BlockPool.all_layers`)."""
        flat = copy(self)
        flat.k, flat.v = (x.view(1, -1, *x.shape[2:]) for x in (self.k, self.v))
        flat.storage = flat
        return flat

    def grow(self, slots):
        """Room for at least `slots` slots (doubling); returns the new slot count."""
        slots = max(slots, 2 * self.k.shape[1])
        extra = slots - self.k.shape[1]
        pad = self.k.new_zeros(self.k.shape[0], extra, *self.k.shape[2:])
        self.k, self.v = torch.cat([self.k, pad], 1), torch.cat([self.v, pad], 1)
        return slots

    def after_insert(self, layer, n, pos, newest):
        """Called after each insert (a quantized store converts tokens there); nothing to do here."""

    def release(self):
        """Memory goes with the object; nothing to give back."""

    def bytes_per_token(self):
        """Bytes one token takes in one layer (K and V, all KV heads)."""
        return 2 * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def bytes_held(self, layer, live):
        """live: bool [slots, heads], the (slot, head) places holding a token."""
        return int(live.sum()) * 2 * self.k.shape[3] * self.k.element_size()


class PagedStore:
    """One sequence's view of the shared block pool (block_pool.BlockPool, its storage): local slot j lives
    in pool slot blocks[j // bs] * bs + j % bs. Growing takes blocks from the pool; `make_private` copies
    shared blocks before they are written (copy-on-write)."""

    exact = True

    def __init__(self, pool, blocks=()):
        """blocks: leading blocks to start from, a reference taken on each (a striped pool brings them into this
        row's stripe while it has room, `BlockPool.adopt`, and keeps only those: see `len(blocks)`)."""
        self.pool = self.storage = pool
        self.private = False  # set once `make_private` found nothing shared past its first block
        self.row = pool.take_row()  # this sequence's row in the pool's block tables
        self.blocks = pool.adopt(self.row, list(blocks)) if pool.striped else list(blocks)
        self._changed()

    def _changed(self):
        self._map = None
        self.pool.set_blocks(self.row, self.blocks)

    @property
    def capacity(self):
        return len(self.blocks) * self.pool.block_size

    def slot_table(self, n):
        if self._map is None:
            self._map = self.pool.slot_tables([self.row], len(self.blocks))[0]
        return self._map[:n]

    def pool_slot(self, j: int) -> int:
        """The pool slot of local slot j, computed on the host."""
        return self.pool.slot_of(self.blocks, j)

    def write(self, layer, slots, k, v, heads=None):
        self.pool.write(layer, self.slot_table(self.capacity).long()[slots], k, v, heads)

    def write_range(self, layer, start, k, v):
        self.pool.write(layer, self.slot_table(start + k.shape[0])[start:].long(), k, v)

    def move(self, layer, heads, src, dst):
        m = self.slot_table(self.capacity).long()
        self.pool.move(layer, heads, m[src], m[dst])

    def blocks_for(self, slots: int) -> int:
        """More blocks needed to hold `slots` local slots."""
        return max(0, -(-slots // self.pool.block_size) - len(self.blocks))

    def grow(self, slots):
        """Take blocks from the pool until `slots` local slots exist (exactly, rounded up to a block)."""
        need = self.blocks_for(slots)
        if need:
            n, pool = len(self.blocks), self.pool
            self.blocks += (pool.take([pool.stripe_block(self.row, i) for i in range(n, n + need)]) if pool.striped
                            else [pool.allocate() for _ in range(need)])
            self._changed()
        return self.capacity

    def make_private(self, first_block: int = 0):
        """Copy-on-write: replace every shared block from `first_block` on by a private copy."""
        copied = False
        for i in range(first_block, len(self.blocks)):
            b = self.blocks[i]
            if self.pool.ref[b] > 1:
                self.blocks[i] = self.pool.copy_block(b)
                self.pool.decref(b)
                copied = True
        if copied:
            self._changed()
        self.private = True

    def fork(self) -> "PagedStore":
        """A second view of the same blocks (each gets a reference); both copy a block before writing it. A
        striped pool brings them into the fork's stripe at once instead (`BlockPool.adopt`; the scheduler kept
        room for it)."""
        for b in self.blocks:
            self.pool.incref(b)
        self.private = self.private and self.pool.striped
        kid = PagedStore(self.pool, self.blocks)
        if len(kid.blocks) < len(self.blocks):
            raise KvboundError("a fork found no room for its copies in virtual storage (the scheduler keeps room)")
        return kid

    def after_insert(self, layer, n, pos, newest):
        pass

    def release(self):
        self.pool.free_all(self.blocks)
        self.pool.give_row(self.row)
        self.blocks, self.row, self._map = [], None, None

    def bytes_per_token(self):
        return self.pool.bytes_per_token()

    def bytes_held(self, layer, live):
        return int(live.sum()) * self.pool.bytes_per_token() // self.pool.kv_heads
