"""Triton kernels for a decode step of caches whose KV heads share a layer's places (AdaKV).

A layer holds places [cap, H] per sequence, place e = slot * H + column, each owned by one KV head (or
free, -1), so a head may hold more places than another (`cache.adaptive_cache`). Four kernels replace the
PyTorch route of `cache.steps.shared_decode` (index writes, a gather of every place, masked SDPA, the
probabilities again in fp32, two stable argsorts over the places):
  - `_store_kernel`, one program per (sequence, KV head): the new token into the head's spare place, and the list
    of the places the head owns (a prefix sum), so the next two visit each head's own places alone;
  - `_split_kernel`, one program per (sequence, KV head, split of its list): its query heads attend to the
    places their head owns (keys read through the slot table, any column; packed pools dequantized in
    registers), a partial softmax per split (flash decoding);
  - `_fold_kernel`, on the same grid: the splits merged into the output, then a second pass over the split's
    keys turns each owned place's logits into its exact probability, summed over the group, and folds it
    into the place's score (sum, normalized or EMA);
  - `_victim_kernel`, one program per sequence: the `heads` places the keep rule drops (the lowest of each
    head's places past its `sure` ones, oldest among ties, the higher place among exact ties), picked one
    at a time, freed and made the next spares; a sequence still below its budget drops none, and the next
    slot's places become its spares.
Same result as the PyTorch route (`tests/test_kernels.py`), for policies whose protected tokens are a prefix of
positions plus the `recent` newest (`Policy.fused_protection`), whatever they rank by (`Policy.rank_source`): the
folded attention, the same over each key's age (the victim kernel divides), or the keys (KNorm's new place is scored
by the fold kernel; for KeyDiff the split kernel sums each head's unit keys and the fold kernel rescores every place
against them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import (MODE_IDS, RANK_IDS, _dequant, _dot, _quant_args, _read_keys, _store_token, _unit_rows,
                            _victim_rank)

MAX_PLACES = 8192  # one program holds a sequence's places in registers; larger layers take the PyTorch route


@triton.jit
def _store_kernel(KN, VN, KP, VP, KS, KB, VS, VB, Table, Rows, Spare, Owner, Pos, Score, Positions, Places, Count,
                  heads, places, stride_nt, stride_nh, stride_ps, stride_ph, stride_ss, stride_sh, stride_tb,
                  stride_spr, stride_sph, stride_r, stride_j, stride_c, D: tl.constexpr, DP: tl.constexpr,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK: tl.constexpr):
    """Sequence b, KV head h: the new token goes into the head's spare place (K and V in its slot's column,
    quantized for a packed pool as `store_kv` writes it), which h then owns, at its position with score 0. Then
    the places h owns, its spare among them, listed in order (Places [B, H, places], Count [B, H]): the split and
    fold kernels visit those alone."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    place = tl.load(Spare + row * stride_spr + h * stride_sph)
    e = tl.arange(0, BLOCK)
    inb = e < places
    own = tl.load(Owner + row * stride_r + (e // heads) * stride_j + (e % heads) * stride_c, mask=inb, other=-1)
    mine = inb & ((own == h) | (e == place))  # another head's spare turns from free to its own: never h's
    at_list = (b * heads + h) * places
    tl.store(Places + at_list + tl.cumsum(mine.to(tl.int32), 0) - 1, e, mask=mine)
    tl.store(Count + b * heads + h, tl.sum(mine.to(tl.int32), 0))
    j = place // heads
    c = place % heads
    slot = tl.load(Table + b * stride_tb + j).to(tl.int64)
    _store_token(KN, VN, KP, VP, KS, KB, VS, VB, b, h, slot, c, stride_nt, stride_nh, stride_ps, stride_ph, stride_ss,
                 stride_sh, D, DP, BITS, GS, False)
    at = row * stride_r + j * stride_j + c * stride_c
    tl.store(Owner + at, h.to(tl.int16))
    tl.store(Pos + at, tl.load(Positions + b).to(tl.int32))
    tl.store(Score + at, 0.0)


@triton.jit
def _keys(K, KS, KB, Table, Places, b, g, i, count, places, heads, q, stride_ks, stride_kh, stride_ss,
          stride_sh, stride_tb, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, IEEE: tl.constexpr):
    """Entries i [N] of the list of places head `g` of sequence b owns (`count` of them): which are valid, the
    places' slots, columns and rows, and q . k over them."""
    valid = i < count
    e = tl.load(Places + (b * heads + g) * places + i, mask=valid, other=0)
    j = e // heads
    c = e % heads
    slot = tl.load(Table + b * stride_tb + j, mask=valid, other=0).to(tl.int64)
    if BITS == 16:
        offs_d = tl.arange(0, D)
        k = tl.load(K + slot[:, None] * stride_ks + c[:, None] * stride_kh + offs_d[None, :], mask=valid[:, None],
                    other=0.0)
    else:
        k = _dequant(K, KS, KB, slot, c[:, None], valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, IEEE,
                     False)
    qk = tl.where(valid[None, :], _dot(q, tl.trans(k), IEEE), float("-inf"))
    return valid, slot, c, j, qk


@triton.jit
def _split_range(count, s, splits, BLOCK_E: tl.constexpr):
    """Split s of `splits` over a list of `count` places: [lo, hi), whole blocks of BLOCK_E but the last."""
    chunk = tl.cdiv(tl.cdiv(count, splits), BLOCK_E) * BLOCK_E
    return s * chunk, tl.minimum(s * chunk + chunk, count)


@triton.jit
def _group_q(Q, b, g, stride_qb, stride_qh, scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    """The query heads of KV head g, [G_PAD, D] (padding rows read head 0), times the softmax scale."""
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    q_ptr = Q + b * stride_qb + tl.where(gmask, g * G + offs_g, 0)[:, None] * stride_qh + tl.arange(0, D)[None, :]
    return tl.load(q_ptr).to(tl.float32) * scale, g * G + offs_g, gmask


@triton.jit
def _split_kernel(Q, K, V, KS, KB, VS, VB, Table, Places, Count, PartO, PartM, PartL, PartU, places, heads,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                  stride_pb, stride_ph, stride_ps, stride_mb, stride_mh, scale, G: tl.constexpr, G_PAD: tl.constexpr,
                  D: tl.constexpr, BLOCK_E: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, IEEE: tl.constexpr,
                  DIFF: tl.constexpr):
    """Program (b, g, s): the query heads of KV head g over split s of the places g owns (its list, `_store_kernel`),
    as a partial softmax (running max, sum, weighted values); with DIFF also the sum of those places' unit keys
    (PartU [B, H, splits, D]), KeyDiff's anchor in part."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    count = tl.load(Count + b * heads + g)
    lo, hi = _split_range(count, s, tl.num_programs(2), BLOCK_E)
    q, qh, gmask = _group_q(Q, b, g, stride_qb, stride_qh, scale, G, G_PAD, D)
    offs_d = tl.arange(0, D)
    m = tl.full([G_PAD], -1e30, tl.float32)  # finite: an empty split changes nothing in the merge
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    unit_sum = tl.zeros([D], tl.float32)
    for i0 in range(lo, hi, BLOCK_E):
        valid, slot, c, j, qk = _keys(K, KS, KB, Table, Places, b, g, i0 + tl.arange(0, BLOCK_E), count, places,
                                      heads, q, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb, D, BITS, GS,
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
                         IEEE, False)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE)
        m = m_new
        if DIFF:  # the keys as the store's gather reads them back, as the PyTorch route scores them
            k = _read_keys(K, KS, KB, Q, slot, c[:, None], valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS,
                           GS, False)
            unit_sum += tl.sum(tl.where(valid[:, None], _unit_rows(k), 0.0), 0)
    part_o = PartO + b * stride_pb + qh[:, None] * stride_ph + s * stride_ps + offs_d[None, :]
    tl.store(part_o, acc, mask=gmask[:, None])
    tl.store(PartM + b * stride_mb + qh * stride_mh + s, m, mask=gmask)
    tl.store(PartL + b * stride_mb + qh * stride_mh + s, l, mask=gmask)
    if DIFF:
        tl.store(PartU + ((b * heads + g) * tl.num_programs(2) + s) * D + offs_d, unit_sum)


@triton.jit
def _fold_kernel(Q, K, KS, KB, Table, Rows, Places, Count, Score, Spare, PartO, PartM, PartL, PartU, Out, places,
                 heads, splits, stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                 stride_or, stride_oj, stride_oc, stride_spr, stride_sph, stride_pb, stride_ph, stride_ps,
                 stride_mb, stride_mh, stride_outb, stride_outh, scale, decay, G: tl.constexpr,
                 G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr, S_PAD: tl.constexpr,
                 BITS: tl.constexpr, GS: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, RANK: tl.constexpr):
    """Program (b, g, s): the splits' softmax merged (split 0 writes the output), then each place of split s of g's
    list gets its exact probability, summed over the group, folded into its score (Score shares Owner's layout).
    Ranks by the keys (RANK, `RANK_IDS`) score them instead: KNorm the new token's place (g's spare), minus its
    key's norm as the pool reads it back (`Policy.key_score`); KeyDiff every place, minus its unit key's cosine to
    g's anchor (`Policy.rescore`: the splits' unit sums added up and normalized)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(Rows + b).to(tl.int64)
    q, qh, gmask = _group_q(Q, b, g, stride_qb, stride_qh, scale, G, G_PAD, D)
    offs_s = tl.arange(0, S_PAD)
    part = b * stride_mb + qh[:, None] * stride_mh + offs_s[None, :]
    smask = gmask[:, None] & (offs_s[None, :] < splits)
    pm = tl.load(PartM + part, mask=smask, other=-1e30)
    m = tl.max(pm, 1)
    w = tl.exp(pm - m[:, None])
    l = tl.sum(tl.load(PartL + part, mask=smask, other=0.0) * w, 1)
    l = tl.where(l > 0, l, 1.0)  # a padding row owns nothing
    if s == 0:
        offs_d = tl.arange(0, D)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for i in range(0, splits):
            wi = tl.sum(tl.where(offs_s[None, :] == i, w, 0.0), 1)
            po = tl.load(PartO + b * stride_pb + qh[:, None] * stride_ph + i * stride_ps + offs_d[None, :],
                         mask=gmask[:, None], other=0.0)
            acc += po * wi[:, None]
        tl.store(Out + b * stride_outb + qh[:, None] * stride_outh + offs_d[None, :], acc / l[:, None],
                 mask=gmask[:, None])
    if RANK == 2 and s == 0:  # KNorm
        first = tl.arange(0, 16) == 0  # the spare place alone, in a vector of the shape _read_keys takes
        e = tl.load(Spare + row * stride_spr + g * stride_sph) + tl.zeros([16], tl.int32)
        j = e // heads
        c = e % heads
        slot = tl.load(Table + b * stride_tb + j, mask=first, other=0).to(tl.int64)
        k = _read_keys(K, KS, KB, Q, slot, c[:, None], first, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS,
                       GS, False)
        norm = tl.sqrt(tl.sum(k * k, 1))
        tl.store(Score + row * stride_or + j * stride_oj + c * stride_oc, -norm, mask=first)
    if MODE != 0 or RANK == 3:  # every place of the split: its attention folded in, or KeyDiff's rescore
        count = tl.load(Count + b * heads + g)
        lo, hi = _split_range(count, s, splits, BLOCK_E)
        if RANK == 3:
            offs_d = tl.arange(0, D)
            anchor = tl.zeros([D], tl.float32)
            for i in range(0, splits):
                anchor += tl.load(PartU + ((b * heads + g) * splits + i) * D + offs_d)
            anchor = anchor / tl.maximum(tl.sqrt(tl.sum(anchor * anchor, 0)), 1e-12)
        own_row = row * stride_or
        for i0 in range(lo, hi, BLOCK_E):
            valid, slot, c, j, qk = _keys(K, KS, KB, Table, Places, b, g, i0 + tl.arange(0, BLOCK_E), count,
                                          places, heads, q, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                                          D, BITS, GS, IEEE)
            ptr = Score + own_row + j * stride_oj + c * stride_oc
            if RANK == 3:
                k = _read_keys(K, KS, KB, Q, slot, c[:, None], valid, stride_ks, stride_kh, stride_ss, stride_sh, D,
                               BITS, GS, False)
                new = -tl.sum(_unit_rows(k) * anchor[None, :], 1)
            else:
                p = tl.exp(tl.where(gmask[:, None], qk - m[:, None], float("-inf"))) / l[:, None]
                step = tl.sum(p, 0)
                if MODE == 2:  # normalized: each query weighs by the places it sees
                    step = step * count
                old = tl.load(ptr, mask=valid, other=0.0)
                if MODE == 3:
                    new = old * decay + step * (1 - decay)
                else:
                    new = old + step
            tl.store(ptr, new, mask=valid)


@triton.jit
def _victim_kernel(Pos, Score, Owner, Rows, Spare, Lens, Widths, heads, prefix, recent, sure,
                   stride_r, stride_j, stride_c, stride_spr, stride_sph, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                   BLOCK: tl.constexpr, AGE: tl.constexpr):
    """Sequence b: the keep rule's order is protected places first, then by score, newer first among ties, then
    lower place first; each head keeps its first `sure` places in that order, and of the rest (each head's last
    count - sure) the last `heads` go. They are picked one at a time from the end of the order (lowest score,
    oldest, higher place), each from a head whose share of the rest is not used up yet: no sort. A sequence whose
    `Lens` slots do not fill its `Widths` place rows yet drops nothing: head i's next spare is place Lens * heads + i,
    free already; places past its width (a plan's padding, free) are none of its own."""
    b = tl.program_id(0)
    row = tl.load(Rows + b).to(tl.int64)
    n = tl.load(Lens + b)
    width = tl.load(Widths + b)
    e = tl.arange(0, BLOCK)
    inb = e < width * heads
    ptr = row * stride_r + (e // heads) * stride_j + (e % heads) * stride_c
    pos = tl.load(Pos + ptr, mask=inb, other=-1)
    score = tl.load(Score + ptr, mask=inb, other=0.0)
    own = tl.maximum(tl.load(Owner + ptr, mask=inb, other=-1).to(tl.int32), 0)  # a padding row's free places
    newest = tl.max(pos, 0)
    key = _victim_rank(score, pos, newest, prefix, recent, AGE)
    hs = tl.arange(0, HEADS_PAD)
    left = tl.zeros([HEADS_PAD], tl.int32)  # each head's places past its sure ones
    for h in tl.static_range(HEADS):
        left = tl.where(hs == h, tl.maximum(tl.sum(((own == h) & inb).to(tl.int32), 0) - sure, 0), left)
    # the places of heads with room left, kept per place (no [places, heads] tensor in the loop)
    room = inb & (tl.sum(tl.where(own[:, None] == hs[None, :], left[None, :], 0), 1) > 0)
    for i in tl.static_range(HEADS):
        low = tl.min(tl.where(room, key, float("inf")), 0)
        pick = room & (key == low)
        oldest = tl.min(tl.where(pick, pos, 0x7FFFFFFF), 0)
        pick = pick & (pos == oldest)
        victim = tl.maximum(tl.max(tl.where(pick, e, -1), 0), 0)
        head = tl.max(tl.where(e == victim, own, -1), 0)
        left = left - (hs == head).to(tl.int32)
        room = room & (e != victim) & ((own != head) | (tl.sum(tl.where(hs == head, left, 0), 0) > 0))
        victim = tl.where(n < width, n * heads + i, victim)
        at = row * stride_r + (victim // heads) * stride_j + (victim % heads) * stride_c
        tl.store(Owner + at, -1)
        tl.store(Pos + at, -1)
        tl.store(Spare + row * stride_spr + i * stride_sph, victim)


def fits(places: int) -> bool:
    """Whether the kernels take a layer of this many places (the victim pass holds a sequence's in one program)."""
    return places <= MAX_PLACES


def shared_decode(q, k, v, k_pool, v_pool, table, rows, positions, owner, pos, spare, score, score_mode: str | None,
                  ema_decay: float, prefix: int, recent: int, sure: int, quant=None, splits: int | None = None,
                  rank: str = "attention", lens=None, widths=None):
    """One layer of AdaKV's steady decode, fused: head h's new token k, v [B, H, D] into its spare place, attention
    of q [B, Hq, D] over each KV head's places, this step's probabilities folded into `score`, and the places the
    keep rule drops freed (owner and pos -1) and made the next `spare`. owner/pos/score: the layer's [R, cap, H]
    metadata, spare [R, H], read at rows[b]; table [B, cap] the sequences' slot tables; positions [B] the new
    tokens'. quant: a packed pool's codes' scales and biases (8/4-bit). splits: how many programs share a
    sequence's places per KV head (default: enough to fill the GPU). rank: `Policy.rank_source`, "attention" (the
    folded scores), "age" (the folded scores over each key's age), or "key-norm" / "key-diff" (from the keys,
    `score_mode` None). lens [B] int32: the slots each sequence holds with the new token's (default: all of the
    table's); one with fewer than its `widths` [B] int32 place rows (default: the table's; fewer for rows of
    different plans, padded with free places) drops no place, and the next slot's places become its spares."""
    if rank not in RANK_IDS:
        raise ValueError(f"the shared decode kernels rank by {', '.join(RANK_IDS)}, got {rank!r}")
    bsz, hq, d = q.shape
    heads = k_pool.shape[1]
    g = hq // heads
    places = table.shape[1] * heads
    bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
    if fp8 or not fits(places):
        raise ValueError(f"the shared decode kernels take 8/4/16-bit pools of at most {MAX_PLACES} places per layer")
    if not (owner.stride() == pos.stride() == score.stride()):
        raise ValueError("owner, pos and score must share one layout")
    ss = (0, 0) if quant is None else (scales[0].stride(0), scales[0].stride(1))
    # each head's places in a list: B x H x places (int32), filled by the store kernel
    place_lists = torch.empty(bsz, heads, places, device=q.device, dtype=torch.int32)
    counts = torch.empty(bsz, heads, device=q.device, dtype=torch.int32)
    _store_kernel[(bsz, heads)](
        k, v, k_pool, v_pool, *scales, table, rows, spare, owner, pos, score, positions, place_lists, counts, heads,
        places, k.stride(0), k.stride(1), k_pool.stride(0), k_pool.stride(1), ss[0], ss[1], table.stride(0),
        *spare.stride(), *owner.stride(), D=d, DP=triton.next_power_of_2(d), BITS=bits, GS=gs,
        BLOCK=max(16, triton.next_power_of_2(places)))
    out = torch.empty_like(q)
    ieee = q.dtype == torch.float32 or not q.is_cuda
    block_e = 64
    blocks = triton.cdiv(places // heads, block_e)  # a head's share of the places
    if splits is None:  # enough programs to fill the GPU: the loop over a split's places is latency-bound
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(blocks, triton.cdiv(2 * sms, bsz * heads)))
    part_o = torch.empty(bsz, hq, splits, d, device=q.device, dtype=torch.float32)
    part_m = torch.empty(bsz, hq, splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    diff = rank == "key-diff"
    part_u = torch.empty(bsz, heads, splits, d, device=q.device, dtype=torch.float32) if diff else part_m
    tiles = dict(G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BLOCK_E=block_e, BITS=bits, GS=gs, IEEE=ieee)
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), ss[0], ss[1], table.stride(0))
    parts = (part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1))
    _split_kernel[(bsz, heads, splits)](
        q, k_pool, v_pool, *scales, table, place_lists, counts, part_o, part_m, part_l, part_u, places, heads,
        *strides, *parts, d ** -0.5, DIFF=diff, **tiles)
    _fold_kernel[(bsz, heads, splits)](
        q, k_pool, *scales[:2], table, rows, place_lists, counts, score, spare, part_o, part_m, part_l, part_u, out,
        places, heads, splits, *strides, *owner.stride(), *spare.stride(), *parts, out.stride(0), out.stride(1),
        d ** -0.5, float(ema_decay), S_PAD=max(2, triton.next_power_of_2(splits)), MODE=MODE_IDS[score_mode],
        RANK=RANK_IDS[rank], **tiles)
    if widths is None:
        widths = torch.full((bsz,), table.shape[1], dtype=torch.int32, device=q.device)
    if lens is None:
        lens = widths
    _victim_kernel[(bsz,)](
        pos, score, owner, rows, spare, lens, widths, heads, prefix, recent, sure, *pos.stride(),
        *spare.stride(),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), BLOCK=max(16, triton.next_power_of_2(places)),
        AGE=rank == "age", num_warps=4 if places <= 2048 else 8)
    return out
