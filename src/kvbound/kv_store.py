"""Where K/V bytes live: one dense tensor per K and V holding every layer's slots.

The cache asks a store to read the first n slots of a layer, write new tokens into (slot, head)
places, and move a kept token from one slot to another. The quantized store (quant.py) has the
same methods over packed integers plus scales and biases.
"""
from __future__ import annotations

import torch


class DenseStore:
    exact = True  # reads back exactly what was written
    def __init__(self, layers, slots, heads, head_dim, device, dtype):
        self.k = torch.zeros(layers, slots, heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self):
        return self.k.shape[1]

    def read(self, layer, n):
        return self.k[layer, :n], self.v[layer, :n]

    def write(self, layer, slots, heads, k, v):
        """slots, heads: [T, H] index pairs; k, v: [T, H, D]."""
        self.k[layer, slots, heads] = k.to(self.k.dtype)
        self.v[layer, slots, heads] = v.to(self.v.dtype)

    def write_range(self, layer, start, k, v):
        """New tokens into slots [start, start + T) of every head (a plain slice copy)."""
        self.k[layer, start:start + k.shape[0]] = k
        self.v[layer, start:start + v.shape[0]] = v

    def roundtrip(self, layer, x):
        """What a written token reads back as (the identity here; quantize+dequantize when quantized)."""
        return x

    def move(self, layer, heads, src, dst):
        """Copy (src[i], heads[i]) to (dst[i], heads[i]) for every i."""
        self.k[layer, dst, heads] = self.k[layer, src, heads]
        self.v[layer, dst, heads] = self.v[layer, src, heads]

    def kernel_args(self, layer):
        """(k_pool, v_pool, quant) for `attention.decode_attention`: quant is None here, the codes' scales
        and biases for packed stores; None instead of the tuple where no kernel can read the store."""
        return self.k[layer], self.v[layer], None

    def slot_table(self, n):
        """Where the kernel finds local slots [0, n) in `kernel_args`' pools."""
        return torch.arange(n, device=self.k.device, dtype=torch.int32)

    def grow(self, slots):
        """Room for at least `slots` slots (doubling); returns the new slot count."""
        slots = max(slots, 2 * self.k.shape[1])
        extra = slots - self.k.shape[1]
        pad = self.k.new_zeros(self.k.shape[0], extra, *self.k.shape[2:])
        self.k, self.v = torch.cat([self.k, pad], 1), torch.cat([self.v, pad], 1)
        return slots

    def bytes_per_token(self):
        """Bytes one token takes in one layer (K and V, all KV heads)."""
        return 2 * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def bytes_held(self, layer, live):
        """live: bool [slots, heads], the (slot, head) places holding a token."""
        return int(live.sum()) * 2 * self.k.shape[3] * self.k.element_size()


class PagedStore:
    """One sequence's view of the shared block pool (block_manager.BlockPool): local slot j lives in pool
    slot blocks[j // bs] * bs + j % bs. Same methods as DenseStore. Growing takes blocks from the pool;
    `make_private` copies shared blocks before they are written (copy-on-write)."""

    exact = True

    def __init__(self, pool, blocks=()):
        self.pool = pool
        self.blocks = list(blocks)
        self.private = False  # set once `make_private` found nothing shared past its first block
        self.row = pool.take_row()  # this sequence's row in pool.tables
        self._changed()

    def _changed(self):
        self._map = None
        if self.blocks:
            self.pool.tables[self.row, :len(self.blocks)] = torch.tensor(self.blocks, dtype=torch.int32)

    @property
    def capacity(self):
        return len(self.blocks) * self.pool.block_size

    def slotmap(self):
        if self._map is None:
            bs = self.pool.block_size
            b = self.pool.tables[self.row, :len(self.blocks)].long()
            self._map = (b[:, None] * bs + torch.arange(bs, device=b.device)).flatten()
        return self._map

    def read(self, layer, n):
        m = self.slotmap()[:n]
        return self.pool.k[layer, m], self.pool.v[layer, m]

    def write(self, layer, slots, heads, k, v):
        m = self.slotmap()[slots]
        self.pool.k[layer, m, heads] = k.to(self.pool.k.dtype)
        self.pool.v[layer, m, heads] = v.to(self.pool.v.dtype)

    def write_range(self, layer, start, k, v):
        m = self.slotmap()[start:start + k.shape[0]]
        self.pool.k[layer, m] = k.to(self.pool.k.dtype)
        self.pool.v[layer, m] = v.to(self.pool.v.dtype)

    def roundtrip(self, layer, x):
        return x

    def move(self, layer, heads, src, dst):
        m = self.slotmap()
        self.pool.k[layer, m[dst], heads] = self.pool.k[layer, m[src], heads]
        self.pool.v[layer, m[dst], heads] = self.pool.v[layer, m[src], heads]

    def kernel_args(self, layer):
        return self.pool.k[layer], self.pool.v[layer], None

    def slot_table(self, n):
        return self.slotmap()[:n].to(torch.int32)

    def blocks_for(self, slots: int) -> int:
        """More blocks needed to hold `slots` local slots."""
        return max(0, -(-slots // self.pool.block_size) - len(self.blocks))

    def grow(self, slots):
        """Take blocks from the pool until `slots` local slots exist (exactly, rounded up to a block)."""
        need = self.blocks_for(slots)
        if need:
            self.blocks += [self.pool.allocate() for _ in range(need)]
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

    def release(self):
        self.pool.free_all(self.blocks)
        self.pool.give_row(self.row)
        self.blocks, self.row, self._map = [], None, None

    def bytes_per_token(self):
        return 2 * self.pool.k.shape[2] * self.pool.k.shape[3] * self.pool.k.element_size()

    def bytes_held(self, layer, live):
        return int(live.sum()) * 2 * self.pool.k.shape[3] * self.pool.k.element_size()


def make_store(layers, slots, heads, head_dim, device, dtype, kv_bits=None, group_size=64,
               quantized_kv_start=0, policy=None):
    if kv_bits is None:
        return DenseStore(layers, slots, heads, head_dim, device, dtype)
    from .quant import QuantizedStore
    return QuantizedStore(layers, slots, heads, head_dim, device, dtype, kv_bits, group_size,
                          quantized_kv_start, policy)
