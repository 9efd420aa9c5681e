"""A decode step's merge on CUDA (`cache.merge`; the PyTorch steps are `cache.steps.evict_merged`): one program per
(sequence, KV head) finds the kept key most like the victim's, averages the victim's key and value into it and adds
the victim's count to its count, in one launch instead of some fifty small PyTorch operations a layer. Over packed
pools (8/4-bit codes, fp8) it reads keys and values dequantized and writes the merged key and value packed, as the
store kernel packs a new token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packing import head_dim
from .triton_decode import (_dequant, _over_age, _put, _put_residual, _quant_args, _resid_args, _ring_entry,
                            _ring_held)

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
def _resid_rows(x, R, RS, RB, ring_row, entries, p, ok, h, stride_rs, stride_rh, stride_qs, stride_qh,
                D: tl.constexpr, GS: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Rows x [N, D] of positions p [N] with the residuals of those `ok` says the ring holds added (the ring's
    4-bit codes at row `ring_row`, `entries` a row), as attention reads them (`RecentResiduals.add`)."""
    rslot = ring_row * entries + tl.where(ok, _ring_entry(p, SINK, RECENT), 0)
    return x + _dequant(R, RS, RB, rslot, h, ok, stride_rs, stride_rh, stride_qs, stride_qh, D, 4, GS, True,
                        False).to(tl.float32)


@triton.jit
def _resid_row(x, R, RS, RB, ring_row, entries, p, ok, h, stride_rs, stride_rh, stride_qs, stride_qh,
               D: tl.constexpr, GS: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """`_resid_rows` of one row x [D] at position p: a block of 16 copies, the first read, summed."""
    lane = tl.arange(0, 16)
    add = _resid_rows(tl.zeros([16, D], tl.float32), R, RS, RB, ring_row, entries, tl.full([16], 0, tl.int64) + p,
                      lane < tl.where(ok, 1, 0), h, stride_rs, stride_rh, stride_qs, stride_qh, D, GS, SINK, RECENT)
    return x + tl.sum(add, 0)


@triton.jit
def _token_kv(K, V, KS, KB, VS, VB, slot, p, h, stride_ks, stride_kh, stride_ss, stride_sh, RK, RKS, RKB, RV, RVS,
              RVB, ring_row, entries, first, stride_rs, stride_rh, stride_qs, stride_qh, D: tl.constexpr,
              BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr, RESID: tl.constexpr, SINK: tl.constexpr,
              RECENT: tl.constexpr):
    """The K and V [D] of the token at pool `slot` and position p, as a step from `first` reads them (RESID: with
    its residuals where the ring holds them)."""
    k = _row(K, KS, KB, slot, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
    v = _row(V, VS, VB, slot, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
    if RESID:
        ok = _ring_held(p, first, SINK, RECENT)
        k = _resid_row(k, RK, RKS, RKB, ring_row, entries, p.to(tl.int64), ok, h, stride_rs, stride_rh, stride_qs,
                       stride_qh, D, GS, SINK, RECENT)
        v = _resid_row(v, RV, RVS, RVB, ring_row, entries, p.to(tl.int64), ok, h, stride_rs, stride_rh, stride_qs,
                       stride_qh, D, GS, SINK, RECENT)
    return k, v


@triton.jit
def _rewrite_residuals(k, v, p, newest, RK, RKS, RKB, RV, RVS, RVB, ring_row, entries, h, stride_rs, stride_rh,
                       stride_qs, stride_qh, D: tl.constexpr, GS: tl.constexpr, SINK: tl.constexpr,
                       RECENT: tl.constexpr):
    """A merged key k and value v [D] at position p: their residuals into the ring if it holds p after the step
    from `newest` (past the sinks, within `recent`), as `RecentResiduals.rewrite` writes them."""
    if (p >= SINK) & (p >= newest - RECENT):
        rslot = ring_row * entries + _ring_entry(p, SINK, RECENT)
        _put_residual(k, RK, RKS, RKB, rslot, h, stride_rs, stride_rh, stride_qs, stride_qh, D, GS)
        _put_residual(v, RV, RVS, RVB, rslot, h, stride_rs, stride_rh, stride_qs, stride_qh, D, GS)


@triton.jit
def _write_row(x, P, S, B, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
               GS: tl.constexpr, FP8: tl.constexpr):
    if BITS == 16 and not FP8:
        tl.store(P + slot * stride_ps + h * stride_ph + tl.arange(0, D), x.to(P.dtype.element_ty))
    else:
        _put(x, P, S, B, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)


@triton.jit
def _merge_weight(score, cnt, pos, newest, WEIGHT: tl.constexpr):
    """What a token weighs in a merge's average (WEIGHTS): its count, or its rank plus 1e-6, the rank of observed
    (WEIGHT 2) being its summed attention over the queries that could see it."""
    w = cnt
    if WEIGHT != 0:
        w = score
        if WEIGHT == 2:
            w = _over_age(score, pos, newest)
        w = w + 1e-6
    return w


@triton.jit
def _most_similar(K, KS, KB, Table, Pos, b, row, h, k_v, out, n_out, n, prefix, stride_tb, stride_pr, stride_pj,
                  stride_ks, stride_kh, stride_ss, stride_sh, BLOCK: tl.constexpr, D: tl.constexpr,
                  BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
                  RK, RKS, RKB, ring_row, entries, first, stride_rs, stride_rh, stride_qs, stride_qh,
                  RESID: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Among local slots [0, n) of row `row` held past `prefix` (sinks and pins) and not among out[:n_out] (the
    evicted): the one whose key has the highest cosine similarity to key k_v [D] (the first among ties), -1 for none,
    and its pool slot. A block's slots load beside its positions, not after them, so each block waits on two
    loads in turn, not three. RESID: keys read with mixed widths' residuals from ring RK.. (`_resid_rows`) in a step
    from `first`."""
    unit_v = k_v / tl.maximum(tl.sqrt(tl.sum(k_v * k_v, 0)), 1e-12)
    lane = tl.arange(0, out.shape[0])
    best = float("-inf")
    best_j = -1
    best_slot = tl.zeros([], tl.int64)
    for j0 in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = j0 + tl.arange(0, BLOCK)
        valid = offs < n
        p = tl.load(Pos + row * stride_pr + offs * stride_pj + h, mask=valid, other=-1)
        slot = tl.load(Table + b * stride_tb + offs, mask=valid, other=0).to(tl.int64)
        evicted = tl.sum(((offs[:, None] == out[None, :]) & (lane < n_out)[None, :]).to(tl.int32), 1) > 0
        ok = valid & (p >= prefix) & ~evicted
        k = _rows(K, KS, KB, slot, h, ok, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
        if RESID:
            held = ok & _ring_held(p, first, SINK, RECENT)
            k = _resid_rows(k, RK, RKS, RKB, ring_row, entries, p.to(tl.int64), held, h, stride_rs, stride_rh,
                            stride_qs, stride_qh, D, GS, SINK, RECENT)
        cos = tl.where(ok, tl.sum(k * unit_v[None, :], 1) / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), 1e-12),
                       float("-inf"))
        top = tl.max(cos, 0)
        at = tl.min(tl.where(cos == top, offs, 1 << 30), 0)  # the first of the block's best
        better = top > best
        best_j = tl.where(better, at, best_j)
        best_slot = tl.where(better, tl.sum(tl.where(offs == at, slot, 0), 0), best_slot)
        best = tl.where(better, top, best)
    return best_j, best_slot


@triton.jit
def _merge_victim_kernel(K, V, KS, KB, VS, VB, Table, Rows, Pos, Score, Count, Victim, Lens, Newest,
                         stride_ks, stride_kh, stride_ss, stride_sh, stride_tb, stride_pr, stride_pj, stride_vb, width,
                         prefix, RK, RKS, RKB, RV, RVS, RVB, stride_rs, stride_rh, stride_qs, stride_qh, entries,
                         D: tl.constexpr, BLOCK: tl.constexpr, WEIGHT: tl.constexpr, FREE: tl.constexpr,
                         BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
                         RESID: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """RESID (mixed widths, a 4-bit pool): keys and values read with their residuals in the ring (RK.., at the
    caches' rows, entries a row) as the decode at Newest read them, and a target the ring holds gets its merged
    key's and value's residuals (`RecentResiduals.rewrite`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(Lens + b)
    row = tl.load(Rows + b).to(tl.int64)  # read beside the length, not after it
    newest = tl.load(Newest + b)
    jv = tl.load(Victim + (row if FREE else b) * stride_vb + h)  # FREE: the rows' spare slots, by row
    if n == width:  # a row below its budget evicts nothing
        slot_v = tl.load(Table + b * stride_tb + jv).to(tl.int64)
        at_v = row * stride_pr + jv * stride_pj + h
        # everything of the victim's is read before the search, which then hides its wait
        c_v = tl.load(Count + at_v)
        p_v = tl.load(Pos + at_v)
        k_v, v_v = _token_kv(K, V, KS, KB, VS, VB, slot_v, p_v, h, stride_ks, stride_kh, stride_ss, stride_sh, RK, RKS,
                             RKB, RV, RVS, RVB, row, entries, newest, stride_rs, stride_rh, stride_qs, stride_qh, D,
                             BITS, GS, FP8, RESID, SINK, RECENT)
        w_v = _merge_weight(tl.load(Score + at_v), c_v, p_v, newest, WEIGHT)
        best_j, slot_t = _most_similar(K, KS, KB, Table, Pos, b, row, h, k_v, tl.zeros([2], tl.int32) + jv, 1, n,
                                       prefix, stride_tb, stride_pr, stride_pj, stride_ks, stride_kh, stride_ss,
                                       stride_sh, BLOCK, D, BITS, GS, FP8, STAGES, RK, RKS, RKB, row, entries, newest,
                                       stride_rs, stride_rh, stride_qs, stride_qh, RESID, SINK, RECENT)
        if best_j >= 0:
            at_t = row * stride_pr + best_j * stride_pj + h
            c_t = tl.load(Count + at_t)
            p_t = tl.load(Pos + at_t)
            w_t = _merge_weight(tl.load(Score + at_t), c_t, p_t, newest, WEIGHT)
            den = w_t + w_v
            k_t, v_t = _token_kv(K, V, KS, KB, VS, VB, slot_t, p_t, h, stride_ks, stride_kh, stride_ss, stride_sh, RK,
                                 RKS, RKB, RV, RVS, RVB, row, entries, newest, stride_rs, stride_rh, stride_qs,
                                 stride_qh, D, BITS, GS, FP8, RESID, SINK, RECENT)
            k_m = (w_t * k_t + w_v * k_v) / den
            v_m = (w_t * v_t + w_v * v_v) / den
            _write_row(k_m, K, KS, KB, slot_t, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
            _write_row(v_m, V, VS, VB, slot_t, h, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
            tl.store(Count + at_t, c_t + c_v)
            if RESID:
                _rewrite_residuals(k_m, v_m, p_t, newest, RK, RKS, RKB, RV, RVS, RVB, row, entries, h, stride_rs,
                                   stride_rh, stride_qs, stride_qh, D, GS, SINK, RECENT)
        if FREE:
            tl.store(Pos + at_v, -1)


def search_tile(width: int, d: int, bits: int, fp8: bool) -> dict:
    """The similarity search's tile for `width` keys of head_dim d stored at `bits` (16: bf16, or fp8): keys a block,
    warps, pipelined stages. Chosen on the H100 (results/merge_search_tiles_h100.log): 128-key blocks but for 8-bit
    keys at d=128, two stages for bf16 alone (they slowed every packed format)."""
    block = 64 if bits == 8 and d > 64 else 128
    return dict(BLOCK=min(block, triton.next_power_of_2(width)), num_warps=4, STAGES=2 if bits == 16 and not fp8 else 1)


def merge_victims(k_pool, v_pool, table, rows, pos, score, count, victim, lens, prefix: int, weight: str, newest=None,
                  free: bool = False, quant=None, resid=None):
    """Each head's victim (local slot victim[b, h]) of rows whose lens[b] fill the table's width, merged into the held
    key past `prefix` (sinks and pins) of highest cosine similarity: K/V written in place in the pools [slots, H, ...]
    (table [B, W] their slots; `quant` as for `triton_decode.decode_attention`, the merged key and value then packed),
    count [R, W, H] updated at rows `rows`. weight: `WEIGHTS`' key. newest [B]: each row's newest position (default:
    the largest held). free: the victims are the rows' spare slots, victim [R, H] read at rows[b], whose positions the
    merge then frees (`triton_decode.evict_decode`). resid: mixed widths' residuals over a 4-bit pool
    (`RecentResiduals.kernel_args`, rows `rows`, read in a step from `newest`)."""
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
    if resid is not None and bits != 4:
        raise ValueError(f"merge_victims: residuals add to a 4-bit pool, got {bits} bits")
    rt = _resid_args(resid, pos)
    _merge_victim_kernel[(bsz, heads)](
        k_pool, v_pool, *scales, table, rows, pos, sc, count, victim, lens, newest, k_pool.stride(0),
        k_pool.stride(1), scales[0].stride(0) if quant else 0, scales[0].stride(1) if quant else 0, table.stride(0),
        pos.stride(0), pos.stride(1), victim.stride(0), width, prefix, *rt["ring"], D=d, WEIGHT=WEIGHTS[weight],
        FREE=free, BITS=bits, GS=gs, FP8=fp8, RESID=resid is not None, SINK=rt["sink"], RECENT=rt["recent"],
        **search_tile(width, d, bits, fp8))
