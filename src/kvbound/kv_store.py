"""Where K/V bytes live: one dense tensor per K and V holding every layer's slots.

The cache asks a store to read the first n slots of a layer, write new tokens into (slot, head)
places, and move a kept token from one slot to another. The quantized store (quant.py) has the
same methods over packed integers plus scales and biases.
"""
from __future__ import annotations

import torch


class DenseStore:
    def __init__(self, layers, slots, heads, head_dim, device, dtype):
        self.k = torch.zeros(layers, slots, heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

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
        """(k_pool, v_pool) for the Triton decode kernel, keyword `quant` for packed stores."""
        return self.k[layer], self.v[layer]

    def grow(self, slots):
        extra = slots - self.k.shape[1]
        pad = self.k.new_zeros(self.k.shape[0], extra, *self.k.shape[2:])
        self.k, self.v = torch.cat([self.k, pad], 1), torch.cat([self.v, pad], 1)

    def bytes_per_token(self):
        """Bytes one token takes in one layer (K and V, all KV heads)."""
        return 2 * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def bytes_held(self, layer, live):
        """live: bool [slots, heads], the (slot, head) places holding a token."""
        return int(live.sum()) * 2 * self.k.shape[3] * self.k.element_size()


def make_store(layers, slots, heads, head_dim, device, dtype, kv_bits=None, group_size=64,
               quantized_kv_start=0, policy=None):
    if kv_bits is None:
        return DenseStore(layers, slots, heads, head_dim, device, dtype)
    from .quant import QuantizedStore
    return QuantizedStore(layers, slots, heads, head_dim, device, dtype, kv_bits, group_size,
                          quantized_kv_start, policy)
