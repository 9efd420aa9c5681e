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
def _move_bytes(T, stride_s, stride_h, src, dst, h, ok, W: tl.constexpr, WP: tl.constexpr):
    """Head h's W bytes of slot src onto slot dst, where `ok`."""
    offs = tl.arange(0, WP)
    m = offs < ok.to(tl.int32) * W
    x = tl.load(T + src * stride_s + h * stride_h + offs, mask=m)
    tl.store(T + dst * stride_s + h * stride_h + offs, x, mask=m)


@triton.jit
def _compact_kernel(Pos, Score, Spare, Rows, Positions, Table, T0, T1, T2, T3, T4, T5, stride_pr, stride_pj, stride_sr,
                    stride_sj, stride_spr, stride_tb, ts0, th0, ts1, th1, ts2, th2, ts3, th3, ts4, th4, ts5, th5,
                    prefix, recent, CAP: tl.constexpr, CAP_PAD: tl.constexpr, BUDGET: tl.constexpr,
                    BY_SCORE: tl.constexpr, AGE: tl.constexpr, NT: tl.constexpr, W0: tl.constexpr,
                    W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr, W5: tl.constexpr,
                    WP: tl.constexpr):
    """Sequence b, head h, slots [0, CAP) held but one (position -1, the evict step's victim): evict the CAP - BUDGET
    - 1 next lowest-ranked unprotected tokens (lowest rank, then oldest position, as `_lowest`); the i-th kept slot
    past BUDGET moves onto the i-th evicted slot below it (the NT stored tensors T0.. as bytes, W0.. a slot and
    head); slots from BUDGET on are then free, and slot BUDGET is the head's spare. Positions and scores move in
    registers, written once at the end (a slot is read before any is written)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b)
    newest = tl.load(Positions + b).to(tl.int32)
    offs = tl.arange(0, CAP_PAD)
    inside = offs < CAP
    pos = tl.load(Pos + row * stride_pr + offs * stride_pj + h, mask=inside, other=-1)
    # a policy without scores passes Pos again, ranked by position (float, so the moves below keep one type)
    score = tl.load(Score + row * stride_sr + offs * stride_sj + h, mask=inside, other=0).to(tl.float32)
    key = _victim_rank(score, pos, newest, prefix, recent, AGE)
    gone = inside & (pos < 0)
    open_ = inside & (key < float("inf"))  # held and unprotected
    for _ in range(CAP - BUDGET - 1):
        k_min = tl.min(tl.where(open_, key, float("inf")), 0)
        p_min = tl.min(tl.where(open_ & (key == k_min), pos, 2147483647), 0)
        hit = open_ & (pos == p_min)  # a head holds each position once
        gone = gone | hit
        open_ = open_ & ~hit
    holes = gone & (offs < BUDGET)
    movers = inside & ~gone & (offs >= BUDGET)  # as many as holes: BUDGET tokens are kept
    hole_at = tl.cumsum(holes.to(tl.int32), 0) - 1
    mover_at = tl.cumsum(movers.to(tl.int32), 0) - 1
    new_pos = tl.where(offs < BUDGET, pos, -1)
    new_score = score
    for i in range(CAP - BUDGET):
        is_src = movers & (mover_at == i)
        ok = tl.sum(is_src.to(tl.int32), 0) > 0
        src = tl.sum(tl.where(is_src, offs, 0), 0)
        dst = tl.sum(tl.where(holes & (hole_at == i), offs, 0), 0)
        to = offs == dst
        new_pos = tl.where(to & ok, tl.sum(tl.where(is_src, pos, 0), 0), new_pos)
        new_score = tl.where(to & ok, tl.sum(tl.where(is_src, score, 0.0), 0), new_score)
        src_slot = tl.load(Table + b * stride_tb + src).to(tl.int64)
        dst_slot = tl.load(Table + b * stride_tb + dst).to(tl.int64)
        _move_bytes(T0, ts0, th0, src_slot, dst_slot, h, ok, W0, WP)
        _move_bytes(T1, ts1, th1, src_slot, dst_slot, h, ok, W1, WP)
        if NT > 2:
            _move_bytes(T2, ts2, th2, src_slot, dst_slot, h, ok, W2, WP)
            _move_bytes(T3, ts3, th3, src_slot, dst_slot, h, ok, W3, WP)
        if NT > 4:
            _move_bytes(T4, ts4, th4, src_slot, dst_slot, h, ok, W4, WP)
            _move_bytes(T5, ts5, th5, src_slot, dst_slot, h, ok, W5, WP)
    tl.store(Pos + row * stride_pr + offs * stride_pj + h, new_pos, mask=inside)
    if BY_SCORE:
        tl.store(Score + row * stride_sr + offs * stride_sj + h, new_score, mask=inside)
    tl.store(Spare + row * stride_spr + h, BUDGET)


def compact(raw, table, pos, score, spare, rows, positions, budget: int, prefix: int, recent: int, age: bool):
    """raw: one layer's stored tensors [slots, H, ...] (K and V, or their codes and scales); table [B, CAP] local ->
    pool slots; pos/score [R, CAP, H] (score None: rank by position), spare [R, H], read at rows [B], every slot
    held but each head's victim of the evict step just run; positions [B], the new tokens'. In place: slots
    [0, budget) hold the kept tokens, the rest are free, slot `budget` is every head's spare."""
    bsz, cap, heads = rows.shape[0], pos.shape[1], pos.shape[2]
    as_bytes = [t.view(torch.uint8) for t in raw]  # one copy loop for every format
    args, widths = [], []
    for t in as_bytes + as_bytes[:1] * (6 - len(as_bytes)):
        args += [t.stride(0), t.stride(1)]
        widths.append(t[0, 0].numel())
    sc = pos if score is None else score
    _compact_kernel[(bsz, heads)](pos, sc, spare, rows, positions, table, *(as_bytes + as_bytes[:1] * (6 - len(raw))),
                                  pos.stride(0), pos.stride(1), sc.stride(0), sc.stride(1), spare.stride(0),
                                  table.stride(0), *args, prefix, recent, CAP=cap, CAP_PAD=triton.next_power_of_2(cap),
                                  BUDGET=budget, BY_SCORE=score is not None, AGE=age, NT=len(raw),
                                  **{f"W{i}": w for i, w in enumerate(widths)},
                                  WP=triton.next_power_of_2(max(widths)))
