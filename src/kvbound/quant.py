"""Quantized KV: group-wise affine 8/4-bit per token (mlx-lm's QuantizedKVCache layout).

Each token's K (and V) vector in each KV head is split into groups of `group_size` along head_dim;
a group stores packed unsigned codes plus one scale and one bias (float16):
    x ~= code * scale + bias,  scale = (max - min) / (2^bits - 1),  bias = min.
Tokens are quantized independently and exactly once, when written, so evicting (replacing or moving a
slot) copies packed bytes and never changes another token.

Mixed precision (`heavy=8,recent=4`): a token is written at the recent width. When it leaves the
recent window (it becomes a heavy-hitter candidate) it is converted once to the heavy width, from its
codes (never from the lost original):
  - 4 -> 8 bits is exact: code8 = 17 * code4, scale8 = scale4 / 17 (255 = 15 * 17). Its values, and so
    its precision, stay those of the 4-bit quantization; only the storage width changes.
  - 8 -> 4 bits requantizes the dequantized 8-bit values (error <= 8-bit error + half a 4-bit step).
"""
from __future__ import annotations

import torch

from .config import KvboundError


def parse_kv_bits(spec):
    """None | 8 | 4 | 'heavy=8,recent=4' -> None | int | dict(heavy=, recent=)."""
    if spec is None or spec == "" or spec in ("16", "none", "bf16"):
        return None
    if isinstance(spec, (int, dict)):
        out = spec
    elif "=" in str(spec):
        out = {}
        for item in str(spec).split(","):
            k, _, v = item.partition("=")
            if k not in ("heavy", "recent") or not v.isdigit():
                raise KvboundError(f"--kv-bits {spec!r}: expected heavy=B,recent=B")
            out[k] = int(v)
        if set(out) != {"heavy", "recent"}:
            raise KvboundError(f"--kv-bits {spec!r}: give both heavy= and recent=")
    else:
        try:
            out = int(spec)
        except ValueError:
            raise KvboundError(f"--kv-bits must be 8, 4 or heavy=B,recent=B; got {spec!r}") from None
    for b in (out.values() if isinstance(out, dict) else [out]):
        if b not in (4, 8):
            raise KvboundError(f"--kv-bits: unsupported bit width {b} (supported: 4, 8)")
    return out


def check_group(head_dim: int, group_size: int):
    if group_size not in (32, 64, 128) or head_dim % group_size:
        raise KvboundError(f"--kv-group-size {group_size} must be 32, 64 or 128 and divide head_dim {head_dim}")


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


def convert(codes, scale, bias, src_bits: int, dst_bits: int, group_size: int):
    """Change a token's storage width once (see module docstring)."""
    if src_bits == dst_bits:
        return codes, scale, bias
    if src_bits == 4 and dst_bits == 8:
        q = unpack(codes, 4) * 17
        return q, (scale.float() / 17).to(torch.float16), bias
    return quantize(dequantize(codes, scale, bias, src_bits, group_size), dst_bits, group_size)


class _Packed:
    """Codes + scales + biases of one of K or V for every layer and slot, at one bit width."""

    def __init__(self, layers, slots, heads, head_dim, bits, group_size, device):
        self.bits, self.group = bits, group_size
        self.codes = torch.zeros(layers, slots, heads, head_dim * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(layers, slots, heads, head_dim // group_size, dtype=torch.float16, device=device)
        self.bias = torch.zeros_like(self.scale)

    def tensors(self):
        return [self.codes, self.scale, self.bias]

    def bytes_per_token_head(self):
        return self.codes.shape[-1] + 2 * 2 * self.scale.shape[-1]


class QuantizedStore:
    """Packed K/V with the DenseStore interface. A full-precision prefix store until `start` tokens."""

    def __init__(self, layers, slots, heads, head_dim, device, dtype, bits, group_size, start=0, policy=None):
        check_group(head_dim, group_size)
        self.mixed = isinstance(bits, dict)
        self.recent_bits = bits["recent"] if self.mixed else bits
        self.heavy_bits = bits["heavy"] if self.mixed else bits
        if self.mixed and getattr(policy, "recent", None) is None:
            raise KvboundError("--kv-bits heavy=..,recent=.. needs an h2o policy (it has a recent window)")
        self.recent_window = getattr(policy, "recent", 0)
        self.sink = getattr(policy, "sink", 0)
        self.dtype, self.group, self.start = dtype, group_size, start
        shape = (layers, slots, heads, head_dim)
        widths = sorted({self.recent_bits, self.heavy_bits})
        self.k = {b: _Packed(*shape, b, group_size, device) for b in widths}
        self.v = {b: _Packed(*shape, b, group_size, device) for b in widths}
        # width of the token in each (layer, slot, head)
        self.width = torch.full((layers, slots, heads), self.recent_bits, dtype=torch.uint8, device=device)
        self.dense = None
        if start > 0:
            from .kv_store import DenseStore
            self.dense = DenseStore(layers, slots, heads, head_dim, device, dtype)
            self.dense_layers = [True] * layers

    def _is_dense(self, layer):
        return self.dense is not None and self.dense_layers[layer]

    def read(self, layer, n):
        if self._is_dense(layer):
            return self.dense.read(layer, n)
        ks, vs = [], []
        for b in self.k:
            ks.append(dequantize(*(t[layer, :n] for t in self.k[b].tensors()), b, self.group, self.dtype))
            vs.append(dequantize(*(t[layer, :n] for t in self.v[b].tensors()), b, self.group, self.dtype))
        if len(ks) == 1:
            return ks[0], vs[0]
        wide = (self.width[layer, :n] == max(self.k))[..., None]
        return torch.where(wide, ks[1], ks[0]), torch.where(wide, vs[1], vs[0])

    def roundtrip(self, layer, x):
        if self._is_dense(layer):
            return x
        return dequantize(*quantize(x, self.recent_bits, self.group), self.recent_bits, self.group, x.dtype)

    def write_range(self, layer, start, k, v):
        if self._is_dense(layer):
            self.dense.write_range(layer, start, k, v)
            return
        b, end = self.recent_bits, start + k.shape[0]
        for packed, x in ((self.k[b], k), (self.v[b], v)):
            for dst, src in zip(packed.tensors(), quantize(x, b, self.group)):
                dst[layer, start:end] = src
        self.width[layer, start:end] = b

    def write(self, layer, slots, heads, k, v):
        if self._is_dense(layer):
            self.dense.write(layer, slots, heads, k, v)
            return
        b = self.recent_bits
        for packed, x in ((self.k[b], k), (self.v[b], v)):
            for dst, src in zip(packed.tensors(), quantize(x, b, self.group)):
                dst[layer, slots, heads] = src
        self.width[layer, slots, heads] = b

    def move(self, layer, heads, src, dst):
        if self._is_dense(layer):
            self.dense.move(layer, heads, src, dst)
            return
        for packed in list(self.k.values()) + list(self.v.values()):
            for t in packed.tensors():
                t[layer, dst, heads] = t[layer, src, heads]
        self.width[layer, dst, heads] = self.width[layer, src, heads]

    def kernel_args(self, layer):
        """The packed pools for the fused kernel; None with mixed widths (one call reads one width)."""
        if self._is_dense(layer):
            return self.dense.kernel_args(layer)
        if self.mixed:
            return None
        b = self.recent_bits
        k, v = self.k[b], self.v[b]
        quant = dict(bits=b, group=self.group, k_scale=k.scale[layer], k_bias=k.bias[layer],
                     v_scale=v.scale[layer], v_bias=v.bias[layer])
        return k.codes[layer], v.codes[layer], quant

    def slot_table(self, n):
        return torch.arange(n, device=self.width.device, dtype=torch.int32)

    @property
    def capacity(self):
        return self.width.shape[1]

    def grow(self, slots):
        slots = max(slots, 2 * self.capacity)

        def pad(t):
            return torch.cat([t, t.new_zeros(t.shape[0], slots - t.shape[1], *t.shape[2:])], 1)
        for packed in list(self.k.values()) + list(self.v.values()):
            packed.codes, packed.scale, packed.bias = (pad(t) for t in packed.tensors())
        self.width = torch.cat([self.width, self.width.new_full(
            (self.width.shape[0], slots - self.width.shape[1], self.width.shape[2]), self.recent_bits)], 1)
        if self.dense is not None:
            self.dense.grow(slots)
        return slots

    # --- called by the cache after each insert ------------------------------------------------
    def after_insert(self, layer, n, pos, newest):
        """Quantize the dense prefix once the cache reaches `start` tokens; convert tokens that left the
        recent window to the heavy width (mixed precision)."""
        if self._is_dense(layer) and n >= self.start:
            k, v = self.dense.read(layer, n)
            self.dense_layers[layer] = False
            idx = torch.arange(n, device=k.device)[:, None].expand(n, k.shape[1])
            heads = torch.arange(k.shape[1], device=k.device)[None, :].expand_as(idx)
            self.write(layer, idx, heads, k, v)
            if not any(self.dense_layers):
                self.dense = None
        if not self.mixed or self._is_dense(layer):
            return
        p = pos[:n]
        old = (p >= self.sink) & (p <= newest - self.recent_window) & (self.width[layer, :n] == self.recent_bits)
        if not old.any():
            return
        slots, heads = old.nonzero(as_tuple=True)
        src, dst = self.recent_bits, self.heavy_bits
        for side in (self.k, self.v):
            got = convert(*(t[layer, slots, heads] for t in side[src].tensors()), src, dst, self.group)
            for t, val in zip(side[dst].tensors(), got):
                t[layer, slots, heads] = val
        self.width[layer, slots, heads] = dst

    def bytes_per_token(self):
        """Bytes of one token in one layer (K and V, all heads) at the recent/uniform width."""
        return 2 * self.width.shape[2] * self.k[self.recent_bits].bytes_per_token_head()

    def bytes_held(self, layer, live):
        if self._is_dense(layer):
            return self.dense.bytes_held(layer, live)
        width = self.width[layer, :live.shape[0]][live]
        return sum(2 * int((width == b).sum()) * self.k[b].bytes_per_token_head() for b in self.k)
