"""The decode that fills the room of caches evicting every e steps, on CUDA (`cache.steps.bulk_evict_decode`): after the
fused evict step has evicted each head's lowest-ranked token, one program per (sequence, KV head) evicts the e - 1
next (the fused victim choice's rank and protection, so the e evicted are the ones `policies.select_keep` drops) and
moves each kept token past the budget into an evicted slot below it: its stored bytes (codes and scales as they are),
position and score. One launch a layer, where the PyTorch chunk step took some sixty."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import _victim_rank


@triton.jit
def _move_rows(T, stride_s, stride_h, src, dst, h, ok, W: tl.constexpr, WP: tl.constexpr):
    """Head h's W bytes of slots src [E] onto slots dst [E], where `ok` [E]."""
    offs = tl.arange(0, WP)
    m = ok[:, None] & (offs < W)[None, :]
    x = tl.load(T + src[:, None] * stride_s + h * stride_h + offs[None, :], mask=m)
    tl.store(T + dst[:, None] * stride_s + h * stride_h + offs[None, :], x, mask=m)


@triton.jit
def _compact_kernel(Pos, Score, Spare, Rows, Positions, Table, T0, T1, T2, T3, T4, T5, stride_pr, stride_pj, stride_sr,
                    stride_sj, stride_spr, stride_tb, ts0, th0, ts1, th1, ts2, th2, ts3, th3, ts4, th4, ts5, th5,
                    prefix, recent, CAP: tl.constexpr, CAP_PAD: tl.constexpr, BUDGET: tl.constexpr,
                    E_PAD: tl.constexpr, BY_SCORE: tl.constexpr, AGE: tl.constexpr, NT: tl.constexpr,
                    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                    W5: tl.constexpr, WP: tl.constexpr):
    """Sequence b, head h, slots [0, CAP) held but one (position -1, the evict step's victim): evict the CAP - BUDGET
    - 1 next lowest-ranked unprotected tokens (lowest rank, then oldest position, as `_lowest`); the kept tokens of
    the tail, slots [BUDGET, CAP), move in slot order onto the evicted slots below BUDGET in slot order (the NT stored
    tensors T0.. as bytes, W0.. a slot and head, then position and score). Every move reads the tail and writes
    below it, all at once; the tail is then free, and slot BUDGET the head's spare."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b)
    newest = tl.load(Positions + b).to(tl.int32)
    offs = tl.arange(0, CAP_PAD)
    inside = offs < CAP
    pos = tl.load(Pos + row * stride_pr + offs * stride_pj + h, mask=inside, other=-1)
    # a policy without scores passes Pos again, ranked by position
    key = _victim_rank(tl.load(Score + row * stride_sr + offs * stride_sj + h, mask=inside, other=0).to(tl.float32),
                       pos, newest, prefix, recent, AGE)
    tail = BUDGET + tl.arange(0, E_PAD)
    in_tail = tail < CAP
    tail_pos = tl.load(Pos + row * stride_pr + tail * stride_pj + h, mask=in_tail, other=-1)
    gone = inside & (pos < 0)
    tail_gone = in_tail & (tail_pos < 0)
    open_ = inside & (key < float("inf"))  # held and unprotected
    for _ in range(CAP - BUDGET - 1):
        k_min = tl.min(tl.where(open_, key, float("inf")), 0)
        p_min = tl.min(tl.where(open_ & (key == k_min), pos, 2147483647), 0)
        hit = open_ & (pos == p_min)  # a head holds each position once
        gone = gone | hit
        tail_gone = tail_gone | (in_tail & (tail_pos == p_min))
        open_ = open_ & ~hit
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


def compact(raw, table, pos, score, spare, rows, positions, budget: int, prefix: int, recent: int, age: bool):
    """raw: one layer's stored tensors [slots, H, ...] (K and V, or their codes and scales); table [B, CAP] local ->
    pool slots; pos/score [R, CAP, H] (score None: rank by position), spare [R, H], read at rows [B], every slot
    held but each head's victim of the evict step just run; positions [B], the new tokens'. In place: slots
    [0, budget) hold the kept tokens, the rest are free, slot `budget` is every head's spare."""
    bsz, cap, heads = rows.shape[0], pos.shape[1], pos.shape[2]
    as_bytes = [t.view(torch.uint8) for t in raw]  # one copy loop for every format
    as_bytes += as_bytes[:1] * (6 - len(raw))
    strides = [x for t in as_bytes for x in (t.stride(0), t.stride(1))]
    widths = {f"W{i}": t[0, 0].numel() for i, t in enumerate(as_bytes)}
    sc = pos if score is None else score
    _compact_kernel[(bsz, heads)](pos, sc, spare, rows, positions, table, *as_bytes, pos.stride(0), pos.stride(1),
                                  sc.stride(0), sc.stride(1), spare.stride(0), table.stride(0), *strides, prefix,
                                  recent, CAP=cap, CAP_PAD=triton.next_power_of_2(cap), BUDGET=budget,
                                  E_PAD=max(2, triton.next_power_of_2(cap - budget)), BY_SCORE=score is not None,
                                  AGE=age, NT=len(raw), **widths, WP=triton.next_power_of_2(max(widths.values())))
