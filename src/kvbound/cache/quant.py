"""Quantized KV storage: packed 8/4-bit K/V per token (the format of `kernels.packing`).

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

from ..errors import KvboundError
from ..kernels.packing import convert, dequantize, quantize
from .store import DenseStore, at


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


def packed_head_bytes(head_dim: int, bits: int, group_size: int) -> int:
    """Bytes of one token's K (or V) in one head: its codes, and an fp16 scale and bias per group."""
    return head_dim * bits // 8 + 2 * 2 * (head_dim // group_size)


def zeros_on(device):
    """The plain allocator of storage tensors: zeros(shape, dtype) on `device` (the pool may pass its own)."""
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


class _Packed:
    """Codes + scales + biases of one of K or V for every layer and slot, at one bit width."""

    def __init__(self, layers, slots, heads, head_dim, bits, group_size, zeros):
        self.bits, self.group = bits, group_size
        self.codes = zeros((layers, slots, heads, head_dim * bits // 8), torch.uint8)
        self.scale = zeros((layers, slots, heads, head_dim // group_size), torch.float16)
        self.bias = zeros((layers, slots, heads, head_dim // group_size), torch.float16)

    def tensors(self):
        return [self.codes, self.scale, self.bias]

    def bytes_per_token_head(self):
        return packed_head_bytes(self.codes.shape[-1] * 8 // self.bits, self.bits, self.group)


class PackedKV:
    """Packed K and V by slot at one width, the paged pool's storage with `kv_bits` (`BlockPool`)."""

    def __init__(self, layers, slots, heads, head_dim, bits, group_size, zeros):
        if bits not in (4, 8):
            raise KvboundError(f"the paged pool packs K/V at 8 or 4 bits, got {bits!r}")
        check_group(head_dim, group_size)
        self.bits, self.group = bits, group_size
        self.k = _Packed(layers, slots, heads, head_dim, bits, group_size, zeros)
        self.v = _Packed(layers, slots, heads, head_dim, bits, group_size, zeros)
        self.tensors = self.k.tensors() + self.v.tensors()

    def pack(self, k, v) -> list[torch.Tensor]:
        return [*quantize(k, self.bits, self.group), *quantize(v, self.bits, self.group)]

    def unpack(self, raw, dtype):
        return (dequantize(*raw[:3], self.bits, self.group, dtype), dequantize(*raw[3:], self.bits, self.group, dtype))

    def roundtrip(self, x):
        return dequantize(*quantize(x, self.bits, self.group), self.bits, self.group, x.dtype)

    def store(self, layer, slots, k, v):
        """k, v [T, H, D] quantized into slots [T, H] by the Triton store kernel (CUDA), bit for bit as `pack`."""
        from ..kernels.triton_decode import store_kv
        for side, x in ((self.k, k), (self.v, v)):
            store_kv(x.contiguous(), slots, side.codes[layer], side.scale[layer], side.bias[layer], self.bits,
                     self.group)

    def kernel_args(self, layer):
        k, v = self.k, self.v
        quant = dict(bits=self.bits, group=self.group, k_scale=k.scale[layer], k_bias=k.bias[layer],
                     v_scale=v.scale[layer], v_bias=v.bias[layer])
        return k.codes[layer], v.codes[layer], quant


FP8_MAX = 448.0  # the largest float8 e4m3 value


class Fp8KV:
    """K and V as float8 e4m3 codes with an fp16 scale per token and head (its largest magnitude maps to 448):
    the paged pool's storage with kv_bits="fp8" (vLLM's --kv-cache-dtype fp8). The decode kernel reads the codes
    and applies the scales once per key."""

    def __init__(self, layers, slots, heads, head_dim, zeros):
        def side():
            return [zeros((layers, slots, heads, head_dim), torch.uint8),
                    zeros((layers, slots, heads, 1), torch.float16)]
        self.tensors = side() + side()

    @staticmethod
    def _pack(x):
        scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-7).to(torch.float16)
        codes = (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return [codes.view(torch.uint8), scale]

    @staticmethod
    def _unpack(codes, scale, dtype):
        return (codes.view(torch.float8_e4m3fn).float() * scale.float()).to(dtype)

    def pack(self, k, v) -> list[torch.Tensor]:
        return self._pack(k) + self._pack(v)

    def unpack(self, raw, dtype):
        return self._unpack(*raw[:2], dtype), self._unpack(*raw[2:], dtype)

    def roundtrip(self, x):
        return self._unpack(*self._pack(x), x.dtype)

    def store(self, layer, slots, k, v):
        """k, v [T, H, D] into slots [T, H] by the Triton store kernel (CUDA), as `pack` does."""
        from ..kernels.triton_decode import store_kv
        for (codes, scale), x in ((self.tensors[:2], k), (self.tensors[2:], v)):
            store_kv(x.contiguous(), slots, codes[layer].view(torch.float8_e4m3fn), scale[layer], bits="fp8")

    def kernel_args(self, layer):
        kc, ks, vc, vs = self.tensors
        return (kc[layer].view(torch.float8_e4m3fn), vc[layer].view(torch.float8_e4m3fn),
                dict(bits="fp8", k_scale=ks[layer], v_scale=vs[layer]))


class QuantizedStore:
    """Packed K/V, a `store.KVStore` and its own `SlotStorage`. A full-precision prefix store until `start` tokens."""
    exact = False  # reads back the dequantized codes

    def __init__(self, layers, slots, heads, head_dim, device, dtype, bits, group_size, start=0, policy=None):
        check_group(head_dim, group_size)
        self.mixed = isinstance(bits, dict)
        self.recent_bits = bits["recent"] if self.mixed else bits
        self.heavy_bits = bits["heavy"] if self.mixed else bits
        if self.mixed and (policy is None or policy.name != "h2o"):
            raise KvboundError("--kv-bits heavy=..,recent=.. needs an h2o policy (it has a recent window)")
        self.recent_window = policy.recent if policy is not None else 0
        self.sink = policy.sink if policy is not None else 0
        self.dtype, self.group, self.start = dtype, group_size, start
        shape = (layers, slots, heads, head_dim)
        widths = sorted({self.recent_bits, self.heavy_bits})
        self.k = {b: _Packed(*shape, b, group_size, zeros_on(device)) for b in widths}
        self.v = {b: _Packed(*shape, b, group_size, zeros_on(device)) for b in widths}
        # width of the token in each (layer, slot, head)
        self.width = torch.full((layers, slots, heads), self.recent_bits, dtype=torch.uint8, device=device)
        self.dense = None
        self.storage = self
        if start > 0:
            self.dense = DenseStore(layers, slots, heads, head_dim, device, dtype)
            self.dense_layers = [True] * layers

    def _is_dense(self, layer):
        return self.dense is not None and self.dense_layers[layer]

    def gather(self, layer, slots):
        if self._is_dense(layer):
            return self.dense.gather(layer, slots)
        ks, vs = [], []
        for b in self.k:
            ks.append(dequantize(*(t[layer, slots] for t in self.k[b].tensors()), b, self.group, self.dtype))
            vs.append(dequantize(*(t[layer, slots] for t in self.v[b].tensors()), b, self.group, self.dtype))
        if len(ks) == 1:
            return ks[0], vs[0]
        wide = (self.width[layer, slots] == max(self.k))[..., None]
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
            if x.is_cuda:  # the Triton store kernel quantizes on the way in, bit for bit as `quantize`
                from ..kernels.triton_decode import store_kv
                slots = torch.arange(start, end, device=x.device, dtype=torch.int32)[:, None].expand(-1, x.shape[1])
                store_kv(x.contiguous(), slots, packed.codes[layer], packed.scale[layer], packed.bias[layer], b,
                         self.group)
                continue
            for dst, src in zip(packed.tensors(), quantize(x, b, self.group)):
                dst[layer, start:end] = src
        self.width[layer, start:end] = b

    def write(self, layer, slots, k, v, heads=None):
        if self._is_dense(layer):
            self.dense.write(layer, slots, k, v, heads)
            return
        b = self.recent_bits
        for packed, x in ((self.k[b], k), (self.v[b], v)):
            for dst, src in zip(packed.tensors(), quantize(x, b, self.group)):
                dst[at(layer, slots, heads)] = src
        self.width[at(layer, slots, heads)] = b

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

    def release(self):
        pass

    # --- called by the cache after each insert ------------------------------------------------
    def after_insert(self, layer, n, pos, newest):
        """Quantize the dense prefix once the cache reaches `start` tokens; convert tokens that left the
        recent window to the heavy width (mixed precision)."""
        if self._is_dense(layer) and n >= self.start:
            k, v = self.dense.gather(layer, slice(0, n))
            self.dense_layers[layer] = False
            self.write_range(layer, 0, k, v)
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

    def bytes_per_token(self, bits: int | None = None):
        """Bytes of one token in one layer (K and V, all heads) at `bits` (default: the width tokens are written at)."""
        return 2 * self.width.shape[2] * self.k[bits or self.recent_bits].bytes_per_token_head()

    def bytes_held(self, layer, live):
        if self._is_dense(layer):
            return self.dense.bytes_held(layer, live)
        width = self.width[layer, :live.shape[0]][live]
        return sum(2 * int((width == b).sum()) * self.k[b].bytes_per_token_head() for b in self.k)
