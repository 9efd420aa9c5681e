"""The decode that fills the room of caches evicting every e steps, on CUDA (`cache.steps.bulk_evict_decode`): after the
fused evict step has evicted each head's lowest-ranked token, one program per (sequence, KV head) evicts the e - 1
next (the fused victim choice's rank and protection, so the e evicted are the ones `policies.select_keep` drops) and
moves each kept token past the budget into an evicted slot below it: its stored bytes (codes and scales as they are),
position, score and count. A merging policy's e evicted tokens first merge into the kept keys most like them, all at
once as `merge.merge_into_kept` does (`triton_merge` merges one), under mixed widths with the window's residuals
read and rewritten as `triton_merge` does. One launch a layer, where the PyTorch chunk step
took some sixty."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packing import head_dim
from .triton_decode import _quant_args, _resid_args, _victim_rank
from .triton_merge import WEIGHTS, _merge_weight, _most_similar, _rewrite_residuals, _token_kv, _write_row, search_tile


@triton.jit
def _move_rows(T, stride_s, stride_h, src, dst, h, ok, W: tl.constexpr, WP: tl.constexpr):
    """Head h's W bytes of slots src [E] onto slots dst [E], where `ok` [E]."""
    offs = tl.arange(0, WP)
    m = ok[:, None] & (offs < W)[None, :]
    x = tl.load(T + src[:, None] * stride_s + h * stride_h + offs[None, :], mask=m)
    tl.store(T + dst[:, None] * stride_s + h * stride_h + offs[None, :], x, mask=m)


@triton.jit
def _merge_evicted(K, V, KS, KB, VS, VB, Table, Pos, Count, b, row, h, offs, pos, score, cnt, gone, newest, prefix,
                   stride_tb, stride_pr, stride_pj, stride_ks, stride_kh, stride_qs, stride_qh, RK, RKS, RKB, RV, RVS,
                   RVB, stride_rs, stride_rh, stride_rqs, stride_rqh, entries, CAP: tl.constexpr, E: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK: tl.constexpr, WEIGHT: tl.constexpr, D: tl.constexpr,
                   BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr, RESID: tl.constexpr,
                   SINK: tl.constexpr, RECENT: tl.constexpr):
    """Each of the E evicted slots (`gone`) merges into the held slot past `prefix` most like it (cosine similarity,
    the first among ties), all against the keys as they were: a target's K and V become the weighted mean of its own
    and its evicted tokens' (WEIGHT as `triton_merge.WEIGHTS`), packed once, and its count their sum. RESID (mixed
    widths): every key and value read with its residuals where the ring RK.. holds them in the step from `newest`,
    and a target the ring holds after the step gets its new residuals (`triton_merge`'s merge does the same). Returns
    the counts [CAP_PAD] after it."""
    w = _merge_weight(score, cnt, pos, newest, WEIGHT)
    lane = tl.arange(0, E_PAD)
    gone_at = tl.cumsum(gone.to(tl.int32), 0) - 1
    vic = tl.sum(tl.where(gone[None, :] & (gone_at[None, :] == lane[:, None]), offs[None, :], 0), 1)  # [E_PAD]
    tgt = tl.full([E_PAD], -1, tl.int32)
    for i in range(E):
        jv = tl.sum(tl.where(lane == i, vic, 0), 0)
        slot_v = tl.load(Table + b * stride_tb + jv).to(tl.int64)
        k_v, _ = _token_kv(K, V, KS, KB, VS, VB, slot_v, tl.sum(tl.where(offs == jv, pos, 0), 0), h, stride_ks,
                           stride_kh, stride_qs, stride_qh, RK, RKS, RKB, RV, RVS, RVB, row, entries, newest,
                           stride_rs, stride_rh, stride_rqs, stride_rqh, D, BITS, GS, FP8, RESID, SINK, RECENT)
        best_j, _ = _most_similar(K, KS, KB, Table, Pos, b, row, h, k_v, vic, E, CAP, prefix, stride_tb, stride_pr,
                                  stride_pj, stride_ks, stride_kh, stride_qs, stride_qh, BLOCK, D, BITS, GS, FP8,
                                  STAGES, RK, RKS, RKB, row, entries, newest, stride_rs, stride_rh, stride_rqs,
                                  stride_rqh, RESID, SINK, RECENT)
        tgt = tl.where(lane == i, best_j, tgt)
    for i in range(E):  # each target once, with all its evicted tokens
        t = tl.sum(tl.where(lane == i, tgt, 0), 0)
        earlier = tl.sum(((lane < i) & (tgt == t)).to(tl.int32), 0)
        if (t >= 0) & (earlier == 0):
            slot_t = tl.load(Table + b * stride_tb + t).to(tl.int64)
            w_t = tl.sum(tl.where(offs == t, w, 0.0), 0)
            c_t = tl.sum(tl.where(offs == t, cnt, 0.0), 0)
            p_t = tl.sum(tl.where(offs == t, pos, 0), 0)
            k_acc, v_acc = _token_kv(K, V, KS, KB, VS, VB, slot_t, p_t, h, stride_ks, stride_kh, stride_qs, stride_qh,
                                     RK, RKS, RKB, RV, RVS, RVB, row, entries, newest, stride_rs, stride_rh,
                                     stride_rqs, stride_rqh, D, BITS, GS, FP8, RESID, SINK, RECENT)
            k_acc, v_acc, den = w_t * k_acc, w_t * v_acc, w_t
            for j in range(E):  # only the tokens merging into t are read: E rows for all targets, not E x E
                if tl.sum(tl.where(lane == j, tgt, 0), 0) == t:
                    jv = tl.sum(tl.where(lane == j, vic, 0), 0)
                    w_v = tl.sum(tl.where(offs == jv, w, 0.0), 0)
                    slot_v = tl.load(Table + b * stride_tb + jv).to(tl.int64)
                    k_v, v_v = _token_kv(K, V, KS, KB, VS, VB, slot_v, tl.sum(tl.where(offs == jv, pos, 0), 0), h,
                                         stride_ks, stride_kh, stride_qs, stride_qh, RK, RKS, RKB, RV, RVS, RVB, row,
                                         entries, newest, stride_rs, stride_rh, stride_rqs, stride_rqh, D, BITS, GS,
                                         FP8, RESID, SINK, RECENT)
                    k_acc += w_v * k_v
                    v_acc += w_v * v_v
                    den += w_v
                    c_t += tl.sum(tl.where(offs == jv, cnt, 0.0), 0)
            k_m, v_m = k_acc / den, v_acc / den
            _write_row(k_m, K, KS, KB, slot_t, h, stride_ks, stride_kh, stride_qs, stride_qh, D, BITS, GS, FP8)
            _write_row(v_m, V, VS, VB, slot_t, h, stride_ks, stride_kh, stride_qs, stride_qh, D, BITS, GS, FP8)
            if RESID:
                _rewrite_residuals(k_m, v_m, p_t, newest, RK, RKS, RKB, RV, RVS, RVB, row, entries, h, stride_rs,
                                   stride_rh, stride_rqs, stride_rqh, D, GS, SINK, RECENT)
            cnt = tl.where(offs == t, c_t, cnt)
    tl.store(Count + row * stride_pr + offs * stride_pj + h, cnt, mask=offs < CAP)
    tl.debug_barrier()  # the moves below read what the merge wrote, in other threads
    return cnt


@triton.jit
def _compact_kernel(Pos, Score, Spare, Rows, Positions, Table, T0, T1, T2, T3, T4, T5, stride_pr, stride_pj, stride_sr,
                    stride_sj, stride_spr, stride_tb, ts0, th0, ts1, th1, ts2, th2, ts3, th3, ts4, th4, ts5, th5,
                    prefix, recent, Count, K, V, KS, KB, VS, VB, stride_ks, stride_kh, stride_qs, stride_qh,
                    RK, RKS, RKB, RV, RVS, RVB, stride_rs, stride_rh, stride_rqs, stride_rqh, entries,
                    CAP: tl.constexpr, CAP_PAD: tl.constexpr, BUDGET: tl.constexpr,
                    E_PAD: tl.constexpr, BY_SCORE: tl.constexpr, AGE: tl.constexpr, NT: tl.constexpr,
                    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                    W5: tl.constexpr, WP: tl.constexpr, MERGE: tl.constexpr, BLOCK: tl.constexpr,
                    WEIGHT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr,
                    STAGES: tl.constexpr, RESID: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Sequence b, head h, slots [0, CAP) held, the evict step's victim in the head's spare slot (freed, or at its
    position for a merge, MERGE): evict the CAP - BUDGET - 1 next lowest-ranked unprotected tokens (lowest rank, then
    oldest position, as `_lowest`), MERGE them all (`_merge_evicted`; K, V.. as `triton_merge` reads the pools); the
    kept tokens of the tail, slots [BUDGET, CAP), move in slot order onto the evicted slots below BUDGET in slot order
    (the NT stored tensors T0.. as bytes, W0.. a slot and head, then position, score and count). Every move reads the
    tail and writes below it, all at once; the tail is then free, and slot BUDGET the head's spare. RESID: mixed
    widths' ring RK.. (rows as Pos's, `entries` a row), which the merge reads and writes; found by position, it stays
    as it is through the moves."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b)
    newest = tl.load(Positions + b).to(tl.int32)
    offs = tl.arange(0, CAP_PAD)
    inside = offs < CAP
    pos = tl.load(Pos + row * stride_pr + offs * stride_pj + h, mask=inside, other=-1)
    # a policy without scores passes Pos again, ranked by position
    score = tl.load(Score + row * stride_sr + offs * stride_sj + h, mask=inside, other=0).to(tl.float32)
    key = _victim_rank(score, pos, newest, prefix, recent, AGE)
    tail = BUDGET + tl.arange(0, E_PAD)
    in_tail = tail < CAP
    tail_pos = tl.load(Pos + row * stride_pr + tail * stride_pj + h, mask=in_tail, other=-1)
    first = tl.load(Spare + row * stride_spr + h)  # the evict step's victim
    gone = inside & (offs == first)
    tail_gone = in_tail & (tail == first)
    open_ = inside & (key < float("inf")) & ~gone  # held and unprotected
    for _ in range(CAP - BUDGET - 1):
        k_min = tl.min(tl.where(open_, key, float("inf")), 0)
        p_min = tl.min(tl.where(open_ & (key == k_min), pos, 2147483647), 0)
        hit = open_ & (pos == p_min)  # a head holds each position once
        gone = gone | hit
        tail_gone = tail_gone | (in_tail & (tail_pos == p_min))
        open_ = open_ & ~hit
    if MERGE:
        cnt = tl.load(Count + row * stride_pr + offs * stride_pj + h, mask=inside, other=0.0)
        cnt = _merge_evicted(K, V, KS, KB, VS, VB, Table, Pos, Count, b, row, h, offs, pos, score, cnt, gone, newest,
                             prefix, stride_tb, stride_pr, stride_pj, stride_ks, stride_kh, stride_qs, stride_qh, RK,
                             RKS, RKB, RV, RVS, RVB, stride_rs, stride_rh, stride_rqs, stride_rqh, entries, CAP,
                             CAP - BUDGET, E_PAD, BLOCK, WEIGHT, D, BITS, GS, FP8, STAGES, RESID, SINK, RECENT)
        tail_cnt = tl.sum(tl.where(offs[None, :] == tail[:, None], cnt[None, :], 0.0), 1)
    holes = gone & (offs < BUDGET)
    hole_at = tl.cumsum(holes.to(tl.int32), 0) - 1
    movers = in_tail & ~tail_gone  # as many as holes: BUDGET tokens are kept
    mover_at = tl.cumsum(movers.to(tl.int32), 0) - 1
    dst = tl.sum(tl.where(holes[None, :] & (hole_at[None, :] == mover_at[:, None]), offs[None, :], 0), 1)
    tl.store(Pos + row * stride_pr + dst * stride_pj + h, tail_pos, mask=movers)
    tl.store(Pos + row * stride_pr + tail * stride_pj + h, tl.full([E_PAD], -1, tl.int32), mask=in_tail)
    if BY_SCORE:
        tail_score = tl.load(Score + row * stride_sr + tail * stride_sj + h, mask=movers, other=0.0)
        tl.store(Score + row * stride_sr + dst * stride_sj + h, tail_score, mask=movers)
    if MERGE:
        tl.store(Count + row * stride_pr + dst * stride_pj + h, tail_cnt, mask=movers)
    src_slot = tl.load(Table + b * stride_tb + tail, mask=movers, other=0).to(tl.int64)
    dst_slot = tl.load(Table + b * stride_tb + dst, mask=movers, other=0).to(tl.int64)
    _move_rows(T0, ts0, th0, src_slot, dst_slot, h, movers, W0, WP)
    _move_rows(T1, ts1, th1, src_slot, dst_slot, h, movers, W1, WP)
    if NT > 2:
        _move_rows(T2, ts2, th2, src_slot, dst_slot, h, movers, W2, WP)
        _move_rows(T3, ts3, th3, src_slot, dst_slot, h, movers, W3, WP)
    if NT > 4:
        _move_rows(T4, ts4, th4, src_slot, dst_slot, h, movers, W4, WP)
        _move_rows(T5, ts5, th5, src_slot, dst_slot, h, movers, W5, WP)
    tl.store(Spare + row * stride_spr + h, BUDGET)


def compact(raw, table, pos, score, spare, rows, positions, budget: int, prefix: int, recent: int, age: bool,
            count=None, merge=None, resid=None):
    """raw: one layer's stored tensors [slots, H, ...] (K and V, or their codes and scales); table [B, CAP] local ->
    pool slots; pos/score [R, CAP, H] (score None: rank by position), spare [R, H], read at rows [B], every slot
    held, each head's victim of the evict step just run in its spare slot (freed, or with `count` at its position);
    positions [B], the new tokens'. count [R, CAP, H] and merge = (the pools' kernel arguments, `merge_mode`): a
    merging policy's, whose evicted tokens merge first. In place: slots [0, budget) hold the kept tokens, the rest are
    free, slot `budget` is every head's spare. resid: a merge's mixed-width residuals over a 4-bit pool
    (`RecentResiduals.kernel_args` at rows `rows`), read and written as `triton_merge.merge_victims` does."""
    bsz, cap, heads = rows.shape[0], pos.shape[1], pos.shape[2]
    as_bytes = [t.view(torch.uint8) for t in raw]  # one copy loop for every format
    as_bytes += as_bytes[:1] * (6 - len(raw))
    strides = [x for t in as_bytes for x in (t.stride(0), t.stride(1))]
    widths = {f"W{i}": t[0, 0].numel() for i, t in enumerate(as_bytes)}
    sc = pos if score is None else score
    if merge is None:
        kv, d, quant_args, weight = [pos] * 6, 16, (16, 16, False), 0
        strides_kv = [0] * 4
    else:
        (k_pool, v_pool, quant), weight = merge
        d = head_dim(k_pool, quant)
        bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
        kv, quant_args, weight = [k_pool, v_pool, *scales], (bits, gs, fp8), WEIGHTS[weight]
        strides_kv = [k_pool.stride(0), k_pool.stride(1), scales[0].stride(0) if quant else 0,
                      scales[0].stride(1) if quant else 0]
    if resid is not None and (merge is None or quant_args[0] != 4):
        raise ValueError("compact: residuals are read by a merge over a 4-bit pool")
    rt = _resid_args(resid, pos)
    _compact_kernel[(bsz, heads)](pos, sc, spare, rows, positions, table, *as_bytes, pos.stride(0), pos.stride(1),
                                  sc.stride(0), sc.stride(1), spare.stride(0), table.stride(0), *strides, prefix,
                                  recent, pos if count is None else count, *kv, *strides_kv, *rt["ring"], CAP=cap,
                                  CAP_PAD=triton.next_power_of_2(cap), BUDGET=budget,
                                  E_PAD=max(2, triton.next_power_of_2(cap - budget)), BY_SCORE=score is not None,
                                  AGE=age, NT=len(raw), **widths, WP=triton.next_power_of_2(max(widths.values())),
                                  MERGE=merge is not None, WEIGHT=weight, D=d, BITS=quant_args[0],
                                  GS=quant_args[1], FP8=quant_args[2], RESID=resid is not None, SINK=rt["sink"],
                                  RECENT=rt["recent"], **search_tile(cap, d, *quant_args[::2]))
