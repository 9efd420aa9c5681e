"""Triton kernels for a decode step of caches whose KV heads share a layer's places (AdaKV).

A layer holds places [cap, H] per sequence, place e = slot * H + column, each owned by one KV head (or
free, -1), so a head may hold more places than another (`cache.adaptive_cache`). Two kernels replace the
PyTorch route of `cache.steps.shared_decode` (a gather of every place, masked SDPA, the probabilities again
in fp32, two stable argsorts over the places):
  - `_owner_kernel`, one program per (sequence, KV head): its query heads attend to the places their head
    owns (keys read through the slot table, any column; packed pools dequantized in registers), then a
    second pass over the same keys turns each place's logits into its exact probability, summed over the
    group, and folds it into the place's score (sum, normalized or EMA);
  - `_victim_kernel`, one program per sequence: the keep rule's order (protected first, then by score,
    newer first among ties) as one sort of 64-bit keys (head, score, position), each head's `sure`-th place
    as its threshold, then the `heads` places the rule drops (the lowest of the rest, oldest among ties, the
    higher place among exact ties), freed and made the next spares.
Same result as the PyTorch route (`tests/test_kernels.py`), for policies whose protected tokens are a prefix of
positions plus the `recent` newest and which rank by the folded attention (`Policy.fused_protection`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import MODE_IDS, _dequant, _dot, _quant_args

MAX_PLACES = 8192  # one program sorts a sequence's places in registers; larger layers take the PyTorch route
POS_BITS = 27  # positions below 2**27 - 1 fit the sort key beside head and score


@triton.jit
def _keys(Q, K, KS, KB, Table, Owner, b, g, own_row, e, places, heads, q, stride_ks, stride_kh, stride_ss,
          stride_sh, stride_tb, stride_oj, stride_oc, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
          IEEE: tl.constexpr):
    """Places e [N] of sequence b: which head `g` owns, their slots and columns, and q . k over them."""
    j = e // heads
    c = e % heads
    own = tl.load(Owner + own_row + j * stride_oj + c * stride_oc, mask=e < places, other=-1)
    valid = own == g
    slot = tl.load(Table + b * stride_tb + j, mask=valid, other=0).to(tl.int64)
    if BITS == 16:
        offs_d = tl.arange(0, D)
        k = tl.load(K + slot[:, None] * stride_ks + c[:, None] * stride_kh + offs_d[None, :], mask=valid[:, None],
                    other=0.0)
    else:
        k = _dequant(K, KS, KB, slot, c[:, None], valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, IEEE)
    qk = tl.where(valid[None, :], _dot(q, tl.trans(k), IEEE), float("-inf"))
    return valid, slot, c, j, qk


@triton.jit
def _owner_kernel(Q, K, V, KS, KB, VS, VB, Table, Rows, Owner, Score, Out, places, heads,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                  stride_or, stride_oj, stride_oc, stride_sr, stride_sj, stride_sc, stride_outb, stride_outh,
                  scale, decay, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr,
                  BITS: tl.constexpr, GS: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    own_row = row * stride_or
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    qh = g * G + offs_g
    q_ptr = Q + b * stride_qb + tl.where(gmask, qh, 0)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr).to(tl.float32) * scale
    m = tl.full([G_PAD], -1e30, tl.float32)  # finite: a block of other heads' places changes nothing
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    owned = 0
    for e0 in range(0, places, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        valid, slot, c, j, qk = _keys(Q, K, KS, KB, Table, Owner, b, g, own_row, e, places, heads, q, stride_ks,
                                      stride_kh, stride_ss, stride_sh, stride_tb, stride_oj, stride_oc, D, BITS, GS,
                                      IEEE)
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if BITS == 16:
            v = tl.load(V + slot[:, None] * stride_ks + c[:, None] * stride_kh + offs_d[None, :], mask=valid[:, None],
                        other=0.0)
        else:
            v = _dequant(V, VS, VB, slot, c[:, None], valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS,
                         IEEE)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE)
        owned += tl.sum(valid.to(tl.int32), 0)
        m = m_new
    l = tl.where(l > 0, l, 1.0)  # a padding row owns nothing
    tl.store(Out + b * stride_outb + qh[:, None] * stride_outh + offs_d[None, :], acc / l[:, None], mask=gmask[:, None])
    if MODE != 0:  # each owned place's probability, summed over the group, folds into its score
        for e0 in range(0, places, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            valid, slot, c, j, qk = _keys(Q, K, KS, KB, Table, Owner, b, g, own_row, e, places, heads, q, stride_ks,
                                          stride_kh, stride_ss, stride_sh, stride_tb, stride_oj, stride_oc, D, BITS,
                                          GS, IEEE)
            p = tl.where(gmask[:, None], tl.exp(qk - m[:, None]) / l[:, None], 0.0)
            step = tl.sum(p, 0)
            if MODE == 2:  # normalized: each query weighs by the places it sees
                step = step * owned
            ptr = Score + row * stride_sr + j * stride_sj + c * stride_sc
            old = tl.load(ptr, mask=valid, other=0.0)
            if MODE == 3:
                new = old * decay + step * (1 - decay)
            else:
                new = old + step
            tl.store(ptr, new, mask=valid)


@triton.jit
def _sortable(x):
    """float32 -> int64 in [0, 2**32) whose order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, -1 - bits, bits + 0x80000000)


@triton.jit
def _victim_kernel(Pos, Score, Owner, Rows, Spare, places, heads, prefix, recent, sure,
                   stride_r, stride_j, stride_c, stride_spr, stride_sph, HEADS: tl.constexpr, BLOCK: tl.constexpr,
                   POS_BITS: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Rows + b).to(tl.int64)
    e = tl.arange(0, BLOCK)
    inb = e < places
    ptr = row * stride_r + (e // heads) * stride_j + (e % heads) * stride_c
    pos = tl.load(Pos + ptr, mask=inb, other=-1)
    score = tl.load(Score + ptr, mask=inb, other=0.0)
    own = tl.maximum(tl.load(Owner + ptr, mask=inb, other=-1).to(tl.int32), 0)  # a padding row's free places
    newest = tl.max(pos, 0)
    key = tl.where((pos < prefix) | (pos > newest - recent), float("inf"), score)
    top = (1 << POS_BITS) - 1
    # keep order within a head is ascending in this: head, then score descending, then position descending
    order = ((own.to(tl.int64) << (32 + POS_BITS)) | ((0xFFFFFFFF - _sortable(key)) << POS_BITS)
             | (top - 1 - pos.to(tl.int64)))
    order = tl.where(inb, order, 0x7FFFFFFFFFFFFFFF)
    ranked = tl.sort(order)
    cut = tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64)  # each place's head's `sure`-th place in keep order
    for h in tl.static_range(HEADS):
        first = tl.sum((inb & (own < h)).to(tl.int32), 0)
        count = tl.sum((inb & (own == h)).to(tl.int32), 0)
        nth = tl.sum(tl.where(e == first + sure - 1, ranked, 0), 0)
        cut = tl.where(own == h, tl.where(count > sure, nth, 0x7FFFFFFFFFFFFFFF), cut)
    rest = inb & (order > cut)
    for i in tl.static_range(HEADS):  # the last of the rest in keep order: lowest score, oldest, higher place
        low = tl.min(tl.where(rest, key, float("inf")), 0)
        pick = rest & (key == low)
        oldest = tl.min(tl.where(pick, pos, 0x7FFFFFFF), 0)
        pick = pick & (pos == oldest)
        victim = tl.maximum(tl.max(tl.where(pick, e, -1), 0), 0)
        rest = rest & (e != victim)
        at = row * stride_r + (victim // heads) * stride_j + (victim % heads) * stride_c
        tl.store(Owner + at, -1)
        tl.store(Pos + at, -1)
        tl.store(Spare + row * stride_spr + i * stride_sph, victim)


def fits(places: int) -> bool:
    """Whether the kernels take a layer of this many places (a sequence's places sort in one program)."""
    return places <= MAX_PLACES


def shared_decode(q, k_pool, v_pool, table, rows, owner, pos, spare, score, score_mode: str, ema_decay: float,
                  prefix: int, recent: int, sure: int, quant=None):
    """After the new tokens are in their places: attention of q [B, Hq, D] over each KV head's places, this
    step's probabilities folded into `score`, and the places the keep rule drops freed (owner and pos -1) and
    made the next `spare`. owner/pos/score: the layer's [R, cap, H] metadata, spare [R, H], read at rows[b];
    table [B, cap] the sequences' slot tables. quant: a packed pool's codes' scales and biases (8/4-bit)."""
    bsz, hq, d = q.shape
    heads = k_pool.shape[1]
    g = hq // heads
    places = table.shape[1] * heads
    bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
    if fp8 or not fits(places):
        raise ValueError(f"the shared decode kernels take 8/4/16-bit pools of at most {MAX_PLACES} places per layer")
    if not (owner.stride() == pos.stride() == score.stride()):
        raise ValueError("owner, pos and score must share one layout")
    out = torch.empty_like(q)
    ss = (0, 0) if quant is None else (scales[0].stride(0), scales[0].stride(1))
    ieee = q.dtype == torch.float32 or not q.is_cuda
    _owner_kernel[(bsz, heads)](
        q, k_pool, v_pool, *scales, table, rows, owner, score, out, places, heads,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), ss[0], ss[1], table.stride(0),
        *owner.stride(), *score.stride(), out.stride(0), out.stride(1), d ** -0.5, float(ema_decay),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BLOCK_E=64, BITS=bits, GS=gs,
        MODE=MODE_IDS[score_mode], IEEE=ieee)
    _victim_kernel[(bsz,)](
        pos, score, owner, rows, spare, places, heads, prefix, recent, sure, *pos.stride(), *spare.stride(),
        HEADS=heads, BLOCK=max(16, triton.next_power_of_2(places)), POS_BITS=POS_BITS,
        num_warps=4 if places <= 2048 else 8)
    return out
