"""The packed KV format the kernels read (mlx-lm's QuantizedKVCache layout): group-wise affine 8/4-bit codes.

Each token's K (and V) vector in each KV head is split into groups of `group_size` along head_dim; a group
stores packed unsigned codes plus one scale and one bias (float16):
    x ~= code * scale + bias,  scale = (max - min) / (2^bits - 1),  bias = min.
4-bit codes pack two to a byte, the even column in the low nibble.
"""
from __future__ import annotations

import torch


def head_dim(k_pool: torch.Tensor, quant: dict | None) -> int:
    """The head size behind a pool's kernel arguments (`quant` as `decode_attention` takes it): 8/4-bit codes hold
    D * bits / 8 bytes a head; fp8 and unquantized pools one value a dimension."""
    bits = None if quant is None else quant["bits"]
    return k_pool.shape[-1] if bits in (None, "fp8") else k_pool.shape[-1] * 8 // bits


def quantize(x: torch.Tensor, bits: int, group_size: int):
    """x: [..., D] -> (codes uint8 [..., D*bits/8], scale fp16 [..., D/G], bias fp16 [..., D/G])."""
    *lead, d = x.shape
    g = x.float().reshape(*lead, d // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).to(torch.float16)
    bias = lo.to(torch.float16)
    s = scale.float().clamp_min(1e-8)[..., None]
    codes = ((g - bias.float()[..., None]) / s).round().clamp(0, levels).to(torch.uint8).reshape(*lead, d)
    return pack(codes, bits), scale, bias


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, group_size: int,
               dtype=torch.float32) -> torch.Tensor:
    q = unpack(codes, bits).float()
    *lead, d = q.shape
    q = q.reshape(*lead, d // group_size, group_size) * scale.float()[..., None] + bias.float()[..., None]
    return q.reshape(*lead, d).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)

