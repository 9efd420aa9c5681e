"""A decode step's merge on CUDA (`cache.merge`; the PyTorch steps are `cache.steps.evict_merged`): one program per
(sequence, KV head, block of held keys) finds the block's key most like the victim's, then one per (sequence, KV
head) takes the best of its blocks, averages the victim's key and value into it and adds the victim's count to its
count: two launches instead of some fifty small PyTorch operations a layer, the keys read in parallel blocks rather
than one after another. Over packed pools (8/4-bit codes, fp8) it reads keys and values dequantized and writes the
merged key and value packed, as the store kernel packs a new token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packing import head_dim
from .triton_decode import _dequant, _put, _quant_args

WEIGHTS = {"count": 0, "attention": 1, "age": 2}  # what a token weighs in the average: its count, or its rank


@triton.jit
def _rows(P, S, B, slot, h, ok, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
          GS: tl.constexpr, FP8: tl.constexpr):
    """K or V of head h at `slot` [N] where `ok`, as fp32 [N, D] (0 elsewhere), from any pool format."""
    offs_d = tl.arange(0, D)
    if FP8:
        x = tl.load(P + slot[:, None] * stride_ps + h * stride_ph + offs_d[None, :], mask=ok[:, None], other=0.0)
        sc = tl.load(S + slot * stride_ss + h * stride_sh, mask=ok, other=0.0).to(tl.float32)
        return x.to(tl.float32) * sc[:, None]
    elif BITS == 16:
        return tl.load(P + slot[:, None] * stride_ps + h * stride_ph + offs_d[None, :], mask=ok[:, None],
                       other=0.0).to(tl.float32)
    else:
        return _dequant(P, S, B, slot, h, ok, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, True,
                        False).to(tl.float32)


@triton.jit
def _row(P, S, B, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
         GS: tl.constexpr, FP8: tl.constexpr):
    """One token's K or V of head h, fp32 [D]: a block of 16 copies of its slot, the first read, summed."""
    first = tl.arange(0, 16) == 0
    return tl.sum(_rows(P, S, B, tl.full([16], 0, tl.int64) + slot, h, first, stride_ps, stride_ph, stride_ss,
                        stride_sh, D, BITS, GS, FP8), 0)


@triton.jit
def _write_row(x, P, S, B, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
               GS: tl.constexpr, FP8: tl.constexpr):
    if BITS == 16 and not FP8:
        tl.store(P + slot * stride_ps + h * stride_ph + tl.arange(0, D), x.to(P.dtype.element_ty))
    else:
        _put(x, P, S, B, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)


@triton.jit
def _victim_unit(K, KS, KB, Table, Rows, Victim, b, h, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb, stride_vb,
                 width, D: tl.constexpr, FREE: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr):
    """Row b's victim in head h: its row, local slot, pool slot and key, fp32 [D]. Read before the row is known to
    fill its table (so the reads overlap the test), the slot kept inside the table."""
    row = tl.load(Rows + b).to(tl.int64)
    jv = tl.load(Victim + (row if FREE else b) * stride_vb + h)  # FREE: the rows' spare slots, by row
    jv = tl.minimum(tl.maximum(jv, 0), width - 1)
    slot_v = tl.load(Table + b * stride_tb + jv).to(tl.int64)
    k_v = _row(K, KS, KB, slot_v, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
    return row, jv, slot_v, k_v


@triton.jit
def _most_alike_kernel(K, KS, KB, Table, Rows, Pos, Victim, Lens, Top, TopAt, stride_ks, stride_kh, stride_ss,
                       stride_sh, stride_tb, stride_pr, stride_pj, stride_vb, width, prefix, D: tl.constexpr,
                       BLOCK: tl.constexpr, NB: tl.constexpr, FREE: tl.constexpr, BITS: tl.constexpr,
                       GS: tl.constexpr, FP8: tl.constexpr):
    """One block of a row's held keys in head h: its highest cosine similarity to the victim's key and the first
    local slot that has it, into Top / TopAt [B, H, NB] (-inf: none of the block may take the victim, or the row is
    below its budget and evicts nothing). Every read is independent of the others but the victim's, so they
    overlap."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(Lens + b)
    row, jv, slot_v, k_v = _victim_unit(K, KS, KB, Table, Rows, Victim, b, h, stride_ks, stride_kh, stride_ss,
                                        stride_sh, stride_tb, stride_vb, width, D, FREE, BITS, GS, FP8)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < width
    p = tl.load(Pos + row * stride_pr + offs * stride_pj + h, mask=valid, other=-1)
    slot = tl.load(Table + b * stride_tb + offs, mask=valid, other=0).to(tl.int64)
    k = _rows(K, KS, KB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
    ok = valid & (p >= prefix) & (offs != jv) & (n == width)  # held, past the sinks and pins, not the victim
    cos = tl.sum(k * k_v[None, :], 1) / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), 1e-12)  # the victim's norm: a constant
    cos = tl.where(ok, cos, float("-inf"))
    top = tl.max(cos, 0)
    at = (b * tl.num_programs(1) + h) * NB + blk
    tl.store(Top + at, top)
    tl.store(TopAt + at, tl.min(tl.where(cos == top, offs, 1 << 30), 0))  # the first of the block's best


@triton.jit
def _merge_victim_kernel(K, V, KS, KB, VS, VB, Table, Rows, Pos, Score, Count, Victim, Lens, Newest, Top, TopAt,
                         stride_ks, stride_kh, stride_ss, stride_sh, stride_tb, stride_pr, stride_pj, stride_vb, width,
                         nblocks, D: tl.constexpr, NB: tl.constexpr, WEIGHT: tl.constexpr, FREE: tl.constexpr,
                         BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr):
    """Row b's victim in head h averaged into the best of its blocks' candidates (`_most_alike_kernel`), the
    first on a tie, as one pass over the keys would choose. The victim's reads are issued before the tests."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(Lens + b)
    row, jv, slot_v, k_v = _victim_unit(K, KS, KB, Table, Rows, Victim, b, h, stride_ks, stride_kh, stride_ss,
                                        stride_sh, stride_tb, stride_vb, width, D, FREE, BITS, GS, FP8)
    v_v = _row(V, VS, VB, slot_v, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
    at_v = row * stride_pr + jv * stride_pj + h
    c_v = tl.load(Count + at_v)
    blocks = tl.arange(0, NB)
    at = (b * tl.num_programs(1) + h) * NB + blocks
    tops = tl.load(Top + at, mask=blocks < nblocks, other=float("-inf"))
    best = tl.max(tops, 0)
    best_j = tl.min(tl.where(tops == best, tl.load(TopAt + at, mask=blocks < nblocks, other=1 << 30), 1 << 30), 0)
    if (n == width) & (best > float("-inf")):
        at_t = row * stride_pr + best_j * stride_pj + h
        c_t = tl.load(Count + at_t)
        if WEIGHT == 0:
            w_t, w_v = c_t, c_v
        else:
            w_t, w_v = tl.load(Score + at_t), tl.load(Score + at_v)
            if WEIGHT == 2:  # summed attention over the queries that could see each token
                newest = tl.load(Newest + b)
                w_t = w_t / tl.maximum(newest - tl.load(Pos + at_t) + 1, 1).to(tl.float32)
                w_v = w_v / tl.maximum(newest - tl.load(Pos + at_v) + 1, 1).to(tl.float32)
            w_t, w_v = w_t + 1e-6, w_v + 1e-6
        slot_t = tl.load(Table + b * stride_tb + best_j).to(tl.int64)
        den = w_t + w_v
        k_t = _row(K, KS, KB, slot_t, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
        v_t = _row(V, VS, VB, slot_t, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
        _write_row((w_t * k_t + w_v * k_v) / den, K, KS, KB, slot_t, h, stride_ks, stride_kh, stride_ss,
                   stride_sh, D, BITS, GS, FP8)
        _write_row((w_t * v_t + w_v * v_v) / den, V, VS, VB, slot_t, h, stride_ks, stride_kh, stride_ss,
                   stride_sh, D, BITS, GS, FP8)
        tl.store(Count + at_t, c_t + c_v)
    if FREE & (n == width):
        tl.store(Pos + at_v, -1)


def merge_victims(k_pool, v_pool, table, rows, pos, score, count, victim, lens, prefix: int, weight: str, newest=None,
                  free: bool = False, quant=None):
    """Each head's victim (local slot victim[b, h]) of rows whose lens[b] fill the table's width, merged into the held
    key past `prefix` (sinks and pins) of highest cosine similarity: K/V written in place in the pools [slots, H, ...]
    (table [B, W] their slots; `quant` as for `triton_decode.decode_attention`, the merged key and value then packed),
    count [R, W, H] updated at rows `rows`. weight: `WEIGHTS`' key. newest [B]: each row's newest position (default:
    the largest held). free: the victims are the rows' spare slots, victim [R, H] read at rows[b], whose positions the
    merge then frees (`triton_decode.evict_decode`)."""
    bsz, width = table.shape
    heads, d = k_pool.shape[1], head_dim(k_pool, quant)
    bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
    if newest is None:
        newest = pos[rows, :width].flatten(1).amax(1)
    sc = count if score is None else score
    if v_pool.stride() != k_pool.stride():
        raise ValueError(f"merge_victims: K and V pools must share strides, got {k_pool.stride()}, {v_pool.stride()}")
    if not (pos.stride(2) == count.stride(2) == sc.stride(2) == 1 and pos.stride()[:2] == count.stride()[:2]
            == sc.stride()[:2]):
        raise ValueError("merge_victims: pos, score and count must share one layout, heads contiguous")
    block = min(64, triton.next_power_of_2(width))
    nblocks = triton.cdiv(width, block)
    top = torch.empty((bsz, heads, triton.next_power_of_2(nblocks)), device=k_pool.device)
    top_at = torch.empty(top.shape, dtype=torch.int32, device=k_pool.device)
    strides = (k_pool.stride(0), k_pool.stride(1), scales[0].stride(0) if quant else 0,
               scales[0].stride(1) if quant else 0, table.stride(0))
    _most_alike_kernel[(bsz, heads, nblocks)](
        k_pool, *scales[:2], table, rows, pos, victim, lens, top, top_at, *strides, pos.stride(0), pos.stride(1),
        victim.stride(0), width, prefix, D=d, BLOCK=block, NB=top.shape[2], FREE=free, BITS=bits, GS=gs, FP8=fp8)
    _merge_victim_kernel[(bsz, heads)](
        k_pool, v_pool, *scales, table, rows, pos, sc, count, victim, lens, newest, top, top_at, *strides,
        pos.stride(0), pos.stride(1), victim.stride(0), width, nblocks, D=d, NB=top.shape[2], WEIGHT=WEIGHTS[weight],
        FREE=free, BITS=bits, GS=gs, FP8=fp8)
