"""Quantized KV storage: packed 8/4-bit K/V per token (the format of `kernels.packing`).

Tokens are quantized independently and exactly once, when written, so evicting (replacing or moving a
slot) copies packed bytes and never changes another token.

Mixed widths (`heavy=4,recent=8`): every token is stored at 4 bits where eviction moves it, and the
recent window's tokens (and the sinks) also hold a 4-bit residual, x minus its 4-bit read-back quantized
again (`RecentResiduals`), so they read back at about 8-bit precision. A token drops to 4 bits by losing its
residual when it leaves the window: nothing is requantized or moved, and the residuals live in a ring of
sink + recent + 1 entries per layer indexed by position, so only the window pays the extra bits.
"""
from __future__ import annotations

from copy import copy

import torch

from ..errors import KvboundError
from ..kernels.packing import dequantize, quantize
from ..kernels.reference import add_residuals, ring_entry, ring_held
from .store import DenseStore, at


MIXED = {"heavy": 4, "recent": 8}  # the one mixed setting: recent tokens (and sinks) at 8-bit precision


def parse_kv_bits(spec):
    """None | 8 | 4 | 'heavy=4,recent=8' -> None | int | dict(heavy=4, recent=8)."""
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
    if isinstance(out, dict) and out != MIXED:
        raise KvboundError(f"--kv-bits {spec!r}: mixed widths keep recent tokens wider, heavy=4,recent=8 (heavy "
                           "hitters at 8 bits and recent tokens at 4 would store 4-bit precision in 8-bit bytes)")
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

    def mapped(self, fn) -> "_Packed":
        out = copy(self)
        out.codes, out.scale, out.bias = map(fn, self.tensors())
        return out

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

    def mapped(self, fn) -> "PackedKV":
        """The same storage with fn applied to each tensor (a view of them: `BlockPool.all_layers`)."""
        out = copy(self)
        out.k, out.v = self.k.mapped(fn), self.v.mapped(fn)
        out.tensors = out.k.tensors() + out.v.tensors()
        return out

    def pack(self, k, v) -> list[torch.Tensor]:
        return [*quantize(k, self.bits, self.group), *quantize(v, self.bits, self.group)]

    def unpack(self, raw, dtype):
        return (dequantize(*raw[:3], self.bits, self.group, dtype), dequantize(*raw[3:], self.bits, self.group, dtype))

    def roundtrip(self, x):
        return dequantize(*quantize(x, self.bits, self.group), self.bits, self.group, x.dtype)

    def store(self, layer, slots, k, v):
        """k, v [T, H, D] quantized into slots [T, H] by the Triton store kernel (CUDA), bit for bit as `pack`."""
        from ..kernels.triton_decode import store_kv
        kp, vp = self.k, self.v
        store_kv(k, slots, kp.codes[layer], kp.scale[layer], kp.bias[layer], self.bits, self.group,
                 also=(v, vp.codes[layer], vp.scale[layer], vp.bias[layer]))

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

    def mapped(self, fn) -> "Fp8KV":
        out = copy(self)
        out.tensors = [fn(t) for t in self.tensors]
        return out

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
        kc, ks, vc, vs = self.tensors
        store_kv(k, slots, kc[layer].view(torch.float8_e4m3fn), ks[layer], bits="fp8",
                 also=(v, vc[layer].view(torch.float8_e4m3fn), vs[layer], None))

    def kernel_args(self, layer):
        kc, ks, vc, vs = self.tensors
        return (kc[layer].view(torch.float8_e4m3fn), vc[layer].view(torch.float8_e4m3fn),
                dict(bits="fp8", k_scale=ks[layer], v_scale=vs[layer]))


class QuantizedStore:
    """Packed K/V at one width, a `store.KVStore` and its own `SlotStorage`. A full-precision prefix store until
    `start` tokens."""
    exact = False  # reads back the dequantized codes

    def __init__(self, layers, slots, heads, head_dim, device, dtype, bits, group_size, start=0):
        check_group(head_dim, group_size)
        self.bits, self.dtype, self.group, self.start = bits, dtype, group_size, start
        self.packed = PackedKV(layers, slots, heads, head_dim, bits, group_size, zeros_on(device))
        self.dense = None
        self.storage = self
        if start > 0:
            self.dense = DenseStore(layers, slots, heads, head_dim, device, dtype)
            self.dense_layers = [True] * layers

    def _is_dense(self, layer):
        return self.dense is not None and self.dense_layers[layer]

    def _sides(self):
        return self.packed.k, self.packed.v

    def gather(self, layer, slots):
        if self._is_dense(layer):
            return self.dense.gather(layer, slots)
        return tuple(dequantize(*(t[layer, slots] for t in side.tensors()), self.bits, self.group, self.dtype)
                     for side in self._sides())

    def roundtrip(self, layer, x):
        if self._is_dense(layer):
            return x
        return self.packed.roundtrip(x)

    def write_range(self, layer, start, k, v):
        if self._is_dense(layer):
            self.dense.write_range(layer, start, k, v)
            return
        end = start + k.shape[0]
        if k.is_cuda:  # the Triton store kernel quantizes on the way in, bit for bit as `quantize`
            slots = torch.arange(start, end, device=k.device, dtype=torch.int32)[:, None].expand(-1, k.shape[1])
            self.packed.store(layer, slots, k, v)
            return
        for side, x in zip(self._sides(), (k, v)):
            for dst, src in zip(side.tensors(), quantize(x, self.bits, self.group)):
                dst[layer, start:end] = src

    def write(self, layer, slots, k, v, heads=None):
        if self._is_dense(layer):
            self.dense.write(layer, slots, k, v, heads)
            return
        for side, x in zip(self._sides(), (k, v)):
            for dst, src in zip(side.tensors(), quantize(x, self.bits, self.group)):
                dst[at(layer, slots, heads)] = src

    def move(self, layer, heads, src, dst):
        if self._is_dense(layer):
            self.dense.move(layer, heads, src, dst)
            return
        for t in self.packed.tensors:
            t[layer, dst, heads] = t[layer, src, heads]

    def kernel_args(self, layer):
        """The packed pools for the fused kernel."""
        if self._is_dense(layer):
            return self.dense.kernel_args(layer)
        return self.packed.kernel_args(layer)

    def slot_table(self, n):
        return torch.arange(n, device=self.packed.k.codes.device, dtype=torch.int32)

    @property
    def capacity(self):
        return self.packed.k.codes.shape[1]

    def grow(self, slots):
        slots = max(slots, 2 * self.capacity)

        def pad(t):
            return torch.cat([t, t.new_zeros(t.shape[0], slots - t.shape[1], *t.shape[2:])], 1)
        for side in self._sides():
            side.codes, side.scale, side.bias = (pad(t) for t in side.tensors())
        self.packed.tensors = self.packed.k.tensors() + self.packed.v.tensors()
        if self.dense is not None:
            self.dense.grow(slots)
        return slots

    def release(self):
        pass

    def after_insert(self, layer, n, pos, newest):
        """Quantize the dense prefix once the cache reaches `start` tokens."""
        if self._is_dense(layer) and n >= self.start:
            k, v = self.dense.gather(layer, slice(0, n))
            self.dense_layers[layer] = False
            self.write_range(layer, 0, k, v)
            if not any(self.dense_layers):
                self.dense = None

    def bytes_per_token(self):
        """Bytes of one token in one layer (K and V, all heads)."""
        return 2 * self.packed.k.codes.shape[2] * self.packed.k.bytes_per_token_head()

    def bytes_held(self, layer, live):
        if self._is_dense(layer):
            return self.dense.bytes_held(layer, live)
        return 2 * int(live.sum()) * self.packed.k.bytes_per_token_head()


def check_mixed_policy(policy):
    """Mixed widths keep a policy's recent window (and sinks) at 8-bit precision: an h2o policy's, one budget."""
    if policy.name != "h2o" or policy.adapts:
        raise KvboundError("--kv-bits heavy=4,recent=8 needs an h2o policy without adaptive budgets (its recent "
                           f"window is what stays at 8 bits), got {policy.describe()}")


def ring_bytes(config, policy, group_size: int) -> int:
    """Bytes of one sequence's residual ring under mixed widths (`RecentResiduals`): K and V, every layer and KV
    head, sink + recent + 1 entries of 4-bit codes with an fp16 scale and bias per group."""
    entries = policy.sink + policy.recent + 1
    return 2 * config.num_layers * entries * config.num_kv_heads * packed_head_bytes(config.head_dim, 4, group_size)


class RecentResiduals:
    """The recent window's extra precision under `--kv-bits heavy=4,recent=8`, for `rows` caches (one row each,
    indexed like their positions and scores): each token of the window (and each sink) holds x - read_back_4bit(x)
    quantized to 4 bits again, in a ring indexed by position (sink + recent + 1 entries per layer and head), so it
    reads back at about 8-bit precision while its 4-bit codes live in the store. A token leaves the window by
    losing its residual.
    During a step whose first position is `first`, a cached token reads its residual if it is a sink or among the
    `recent` tokens before `first`; the step's own tokens read back at full mixed precision (`roundtrip`), and a
    decode step's token is written before it attends."""

    def __init__(self, rows, layers, heads, head_dim, sink, recent, group_size, device):
        check_group(head_dim, group_size)
        self.sink, self.recent, self.group = sink, recent, group_size
        shape = (rows, layers * (sink + recent + 1), heads, head_dim)  # _Packed's [layers, slots, ...] layout
        self.size = sink + recent + 1
        zeros = zeros_on(device)
        self.k = _Packed(*shape, 4, group_size, zeros)
        self.v = _Packed(*shape, 4, group_size, zeros)

    def tensors(self):
        return self.k.tensors() + self.v.tensors()

    def mapped(self, fn) -> "RecentResiduals":
        """A twin whose tensors are fn(tensor) (a row's view, a copy, a stacked meta's grown rows)."""
        twin = copy(self)
        twin.k, twin.v = copy(self.k), copy(self.v)
        for side in (twin.k, twin.v):
            side.codes, side.scale, side.bias = (fn(t) for t in side.tensors())
        return twin

    def row(self, r: int) -> "RecentResiduals":
        """Row r alone, as a one-row view of the same memory (a stacked cache's own steps)."""
        return self.mapped(lambda t: t[r:r + 1])

    def clone(self) -> "RecentResiduals":
        """A copy with tensors of its own (a forked sequence writes its own window)."""
        return self.mapped(torch.clone)

    def _entry(self, layer, pos):
        """Entries of positions `pos` in `layer`'s part of a row."""
        return layer * self.size + ring_entry(pos, self.sink, self.recent)

    def _kept(self, positions):
        """Which of a step's new positions [B, t] (ascending) hold a residual after it."""
        return (positions < self.sink) | (positions >= positions[:, -1:] - self.recent)

    def _split(self, x):
        """x -> (its 4-bit read-back in x's dtype, the packed residual)."""
        main = dequantize(*quantize(x, 4, self.group), 4, self.group, x.dtype)
        return main, quantize(x.float() - main.float(), 4, self.group)

    def roundtrip(self, layer, x):
        """What a token written now reads back as while in the window."""
        main, res = self._split(x)
        return (main.float() + dequantize(*res, 4, self.group)).to(x.dtype)

    def write(self, layer, rows, positions, k, v, kernel=None):
        """The residuals of new tokens k, v [B, t, H, D] at `positions` [B, t] (ascending) of rows `rows` [B] that
        the window or the sinks keep after them. kernel: the Triton store (default on CUDA: no host sync);
        otherwise PyTorch, where one token a row (a decode step) takes no host sync."""
        if k.is_cuda if kernel is None else kernel:  # skipped tokens get entry -1
            flat = rows[:, None] * self.k.codes.shape[1] + self._entry(layer, positions.long())
            entries = torch.where(self._kept(positions), flat, -1).reshape(-1)
            from ..kernels.triton_decode import store_residuals
            for side, x in ((self.k, k), (self.v, v)):
                store_residuals(x.reshape(-1, *x.shape[2:]).contiguous(), entries,
                                *(t.view(-1, *t.shape[2:]) for t in side.tensors()), self.group)
            return
        if positions.shape[1] == 1:
            r, at = rows[:, None], self._entry(layer, positions.long())
        else:
            b, t = self._kept(positions).nonzero(as_tuple=True)
            r, at, k, v = rows[b], self._entry(layer, positions[b, t].long()), k[b, t], v[b, t]
        for side, x in ((self.k, k), (self.v, v)):
            for dst, src in zip(side.tensors(), self._split(x)[1]):
                dst[r, at] = src

    def rewrite(self, layer, rows, pos, k, v, which, newest):
        """Merged keys' residuals: of candidates `which` [B, M, H] (positions pos [B, M, H], new values k, v
        [B, M, H, D]), those the ring holds after a step whose last position is newest [B] get their new values'
        residuals. Window positions are distinct modulo the ring, so each entry takes at most one candidate: a
        scatter of candidate indices, then one write of the layer's entries, with no host sync (graphs)."""
        held = which & (pos >= self.sink) & (pos >= newest.reshape(-1, 1, 1) - self.recent)
        b, m, h = pos.shape
        entry = torch.where(held, ring_entry(pos.clamp(min=0), self.sink, self.recent), self.size).long()
        src = torch.full((b, self.size + 1, h), -1, dtype=torch.long, device=pos.device)
        src.scatter_(1, entry, torch.arange(m, device=pos.device)[None, :, None].expand(b, m, h))
        src = src[:, :self.size]  # the last column took the candidates the ring does not hold
        at = slice(layer * self.size, (layer + 1) * self.size)
        for side, x in ((self.k, k), (self.v, v)):
            picked = x.gather(1, src.clamp(min=0)[..., None].expand(-1, -1, -1, x.shape[-1]))
            for t, new in zip(side.tensors(), self._split(picked)[1]):
                t[rows, at] = torch.where((src >= 0)[..., None], new, t[rows, at])

    def add(self, layer, rows, k, v, pos, first):
        """K, V [B, M, H, D] read from the store at local slots [0, M) of rows `rows` [B], whose positions are
        pos[rows] ([R, cap, H]): the places that hold residuals in a step from `first` get them added."""
        return tuple(add_residuals(k, v, self.kernel_args(layer, rows, first, pos), self.group))

    def with_piece(self, layer, rows, kc, vc, pos, first, k, v):
        """K, V a prefill piece attends over: the cached places kc, vc [B, n, H, D] (local slots [0, n), positions
        pos[rows]) with their residuals in a step from `first` [B], then the piece's own k, v [B, t, H, D] at mixed
        precision."""
        cached = self.add(layer, rows, kc, vc, pos, first)
        return tuple(torch.cat([c, self.roundtrip(layer, x).to(c.dtype)], 1) for c, x in zip(cached, (k, v)))

    def kernel_args(self, layer, rows, first, pos):
        """The decode kernel's `resid` (`kernels.decode_attention`): this layer's ring entries, read at rows
        `rows` [B] (of the ring and of the positions `pos` [R, cap, H]) for a step from `first` [B]."""
        at = slice(layer * self.size, (layer + 1) * self.size)
        return dict(pos=pos, rows=rows, first=first, k=[t[:, at] for t in self.k.tensors()],
                    v=[t[:, at] for t in self.v.tensors()], sink=self.sink, recent=self.recent)

    def bytes_held(self, pos, seen):
        """Bytes of the residuals held for positions `pos` [M, H] of one layer of a cache after `seen` tokens."""
        return 2 * int(ring_held(pos[None], seen, self.sink, self.recent).sum()) * self.k.bytes_per_token_head()

    def bytes_per_row(self):
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

