"""Triton decode attention over a slot-indexed KV pool that also exports attention scores.

One query token per sequence; each sequence reads its keys through its own slot table (local key j
lives in pool slot `slot_table[b, j]`), GQA, split-K ("flash decoding") with a stable merge, fp32
accumulation. K/V are bf16/fp16/fp32, or packed 8/4-bit codes with per-group fp16 scale and bias that
are dequantized in registers.

Score export: H2O needs, per cached key and KV head, the post-softmax probability summed over the
query heads of its group. The exact probability needs the softmax normaliser over *all* splits, so the
split kernel writes its raw logits (G floats per key) and the merge kernel finds the normaliser; a
third kernel, parallel over key blocks, folds exp(logit - M) / L summed over the group into the score
buffer (sum, EMA, or weighted by the number of attended keys). Turned off (EXPORT=False), that code is compiled out.

`attention.py` holds the PyTorch reference these kernels are tested against (TRITON_INTERPRET=1 on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORE_MODES = {None: 0, "sum": 1, "normalized": 2, "ema": 3}


@triton.jit
def _split_kernel(Q, K, V, KS, KB, VS, VB, SlotTable, CtxLen, PartO, PartM, PartL, Logits,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_lb, stride_lh,
                  scale, split,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                  EXPORT: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(CtxLen + b)
    start = s * split
    end = tl.minimum(start + split, n)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = h * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=valid, other=0).to(tl.int64)
        if BITS == 16:
            kp = K + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
            k = tl.load(kp, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :],
                        mask=valid[:, None], other=0.0).to(tl.float32)
        else:
            k = _dequant(K, KS, KB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, DP, BITS, GS,
                         BLOCK_N)
            v = _dequant(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, DP, BITS, GS,
                         BLOCK_N)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        qk = tl.where(valid[None, :], qk, float("-inf"))
        if EXPORT:
            tl.store(Logits + b * stride_lb + heads[:, None] * stride_lh + offs_n[None, :], qk,
                     mask=gmask[:, None] & valid[None, :])
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        m = m_new
    o_ptr = PartO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_d[None, :]
    tl.store(o_ptr, acc, mask=gmask[:, None])
    tl.store(PartM + b * stride_mb + heads * stride_mh + s, m, mask=gmask)
    tl.store(PartL + b * stride_mb + heads * stride_mh + s, l, mask=gmask)


@triton.jit
def _dequant(P, S, B, slot, h, valid, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr,
             DP: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed codes of BLOCK_N tokens -> float32 [BLOCK_N, D]: code * scale[group] + bias[group]."""
    offs_p = tl.arange(0, DP)
    packed = tl.load(P + slot[:, None] * stride_ps + h * stride_ph + offs_p[None, :], mask=valid[:, None], other=0)
    if BITS == 8:
        codes = packed.to(tl.float32)
    else:
        lo = (packed & 0xF).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
        codes = tl.reshape(tl.join(lo, hi), [BLOCK_N, D])
    NG: tl.constexpr = D // GS
    offs_g = tl.arange(0, NG)
    sp = slot[:, None] * stride_ss + h * stride_sh + offs_g[None, :]
    sc = tl.load(S + sp, mask=valid[:, None], other=0.0).to(tl.float32)
    bi = tl.load(B + sp, mask=valid[:, None], other=0.0).to(tl.float32)
    x = tl.reshape(codes, [BLOCK_N, NG, GS]) * sc[:, :, None] + bi[:, :, None]
    return tl.reshape(x, [BLOCK_N, D])


@triton.jit
def _merge_kernel(PartO, PartM, PartL, Out, CtxLen, stride_ob, stride_oh, stride_os, stride_mb, stride_mh,
                  stride_outb, stride_outh, split, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  MODE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(CtxLen + b)
    used = tl.cdiv(n, split)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = h * G + offs_g
    big_m = tl.full([G_PAD], float("-inf"), tl.float32)
    for s in range(0, used):
        big_m = tl.maximum(big_m, tl.load(PartM + b * stride_mb + heads * stride_mh + s, mask=gmask,
                                          other=float("-inf")))
    big_l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(0, used):
        ms = tl.load(PartM + b * stride_mb + heads * stride_mh + s, mask=gmask, other=float("-inf"))
        ls = tl.load(PartL + b * stride_mb + heads * stride_mh + s, mask=gmask, other=0.0)
        w = tl.where(gmask, tl.exp(ms - big_m), 0.0)
        big_l += ls * w
        o = tl.load(PartO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        acc += o * w[:, None]
    big_l = tl.where(gmask, big_l, 1.0)
    out = acc / big_l[:, None]
    tl.store(Out + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=gmask[:, None])
    if MODE != 0:  # the normaliser of each query head, for the score fold
        tl.store(PartM + b * stride_mb + heads * stride_mh, big_m, mask=gmask)
        tl.store(PartL + b * stride_mb + heads * stride_mh, big_l, mask=gmask)


@triton.jit
def _score_kernel(Logits, PartM, PartL, Score, CtxLen, stride_mb, stride_mh, stride_lb, stride_lh,
                  stride_sb, stride_sj, ema_decay, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr,
                  MODE: tl.constexpr):
    """Fold this step's exact probabilities, summed over each KV head's query group, into the scores."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    j0 = tl.program_id(2) * BLOCK
    n = tl.load(CtxLen + b)
    if j0 >= n:
        return
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    heads = h * G + offs_g
    big_m = tl.load(PartM + b * stride_mb + heads * stride_mh, mask=gmask, other=0.0)
    big_l = tl.load(PartL + b * stride_mb + heads * stride_mh, mask=gmask, other=1.0)
    offs_n = j0 + tl.arange(0, BLOCK)
    valid = offs_n < n
    lg = tl.load(Logits + b * stride_lb + heads[:, None] * stride_lh + offs_n[None, :],
                 mask=gmask[:, None] & valid[None, :], other=float("-inf"))
    p = tl.exp(lg - big_m[:, None]) / big_l[:, None]
    p = tl.sum(tl.where(gmask[:, None] & valid[None, :], p, 0.0), 0)
    sp = Score + b * stride_sb + offs_n * stride_sj + h
    old = tl.load(sp, mask=valid, other=0.0)
    if MODE == 1:
        new = old + p
    elif MODE == 2:
        new = old + p * n.to(tl.float32)
    else:
        new = old * ema_decay + p * (1.0 - ema_decay)
    tl.store(sp, new, mask=valid)


def decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, scale=None, score=None, score_mode=None,
                     ema_decay=0.95, quant=None, split=None, block_n=None, out=None, programs_per_sm=None,
                     num_warps=4):
    """q: [B, Hq, D]; k_pool/v_pool: [slots, Hkv, D] (or packed codes [slots, Hkv, D*bits/8] with
    quant=dict(bits=, group=, k_scale=, k_bias=, v_scale=, v_bias=) of [slots, Hkv, D/group]);
    slot_table: [B, max_len] int32; ctx_lens: [B] int32; score: [B, max_len, Hkv] float32, updated in
    place with this step's probabilities when score_mode is "sum" | "normalized" | "ema".
    Returns out [B, Hq, D] in q's dtype."""
    bsz, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    max_len = slot_table.shape[1]
    scale = d ** -0.5 if scale is None else scale
    # defaults from `benchmarks/decode_attention.py --tune` on an H200 (benchmarks/tune_h200.log): 64-key
    # blocks and 4 programs per SM; the packed kernels, which dequantize in registers, did better at
    # head_dim 128 with 32-key blocks and 2 programs per SM (benchmarks/README.md)
    wide_packed = quant is not None and d > 64
    block_n = block_n or (32 if wide_packed else 64)
    programs_per_sm = programs_per_sm or (2 if wide_packed else 4)
    if split is None:  # enough programs to fill the GPU, at least a few blocks each
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        want = max(1, (programs_per_sm * sms) // max(1, bsz * hkv))
        split = max(block_n * 4, triton.cdiv(triton.cdiv(max_len, want), block_n) * block_n)
    num_splits = max(1, triton.cdiv(max_len, split))
    g_pad = max(16, triton.next_power_of_2(g))
    part_o = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    part_m = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    mode = SCORE_MODES[score_mode]
    export = mode != 0
    logits = torch.empty(bsz, hq, max_len, device=q.device, dtype=torch.float32) if export else part_m
    if out is None:
        out = torch.empty_like(q)
    bits = 16 if quant is None else quant["bits"]
    gs = d if quant is None else quant["group"]
    ks = kb = vs = vb = k_pool
    ss = (0, 0)
    if quant is not None:
        ks, kb, vs, vb = quant["k_scale"], quant["k_bias"], quant["v_scale"], quant["v_bias"]
        ss = (ks.stride(0), ks.stride(1))
    ieee = q.dtype == torch.float32 or not q.is_cuda
    _split_kernel[(bsz, hkv, num_splits)](
        q, k_pool, v_pool, ks, kb, vs, vb, slot_table, ctx_lens, part_o, part_m, part_l, logits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), ss[0], ss[1], slot_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        logits.stride(0), logits.stride(1), scale, split,
        G=g, G_PAD=g_pad, D=d, DP=d * bits // 8 if bits != 16 else d, BLOCK_N=block_n, BITS=bits,
        GS=gs, EXPORT=export, IEEE=ieee, num_warps=num_warps)
    _merge_kernel[(bsz, hkv)](
        part_o, part_m, part_l, out, ctx_lens,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        out.stride(0), out.stride(1), split, G=g, G_PAD=g_pad, D=d, MODE=mode)
    if export:
        block = 256
        _score_kernel[(bsz, hkv, triton.cdiv(max_len, block))](
            logits, part_m, part_l, score, ctx_lens, part_m.stride(0), part_m.stride(1),
            logits.stride(0), logits.stride(1), score.stride(0), score.stride(1), float(ema_decay),
            G=g, G_PAD=g_pad, BLOCK=block, MODE=mode)
    return out


@triton.jit
def _store_kernel(X, Slots, P, PS, PB, stride_xt, stride_xh, stride_st, stride_ps, stride_ph, stride_ss,
                  stride_sh, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Slots + t * stride_st + h).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, D)
    x = tl.load(X + t * stride_xt + h * stride_xh + offs_d)
    if BITS == 16:
        tl.store(P + slot * stride_ps + h * stride_ph + offs_d, x.to(P.dtype.element_ty))
    else:
        NG: tl.constexpr = D // GS
        xg = tl.reshape(x.to(tl.float32), [NG, GS])
        lo = tl.min(xg, 1)
        hi = tl.max(xg, 1)
        levels: tl.constexpr = (1 << BITS) - 1
        sc = ((hi - lo) / levels).to(tl.float16)
        bi = lo.to(tl.float16)
        scf = tl.maximum(sc.to(tl.float32), 1e-8)
        codes = (xg - bi.to(tl.float32)[:, None]) / scf[:, None]
        codes = tl.minimum(tl.maximum(codes, 0.0), levels)
        r = tl.floor(codes + 0.5)  # round half to even, as torch.round does
        codes = tl.where(((r - codes) == 0.5) & ((r % 2) == 1), r - 1.0, r)
        codes = tl.reshape(codes.to(tl.uint8), [D])
        offs_g = tl.arange(0, NG)
        tl.store(PS + slot * stride_ss + h * stride_sh + offs_g, sc)
        tl.store(PB + slot * stride_ss + h * stride_sh + offs_g, bi)
        if BITS == 8:
            tl.store(P + slot * stride_ps + h * stride_ph + offs_d, codes)
        else:
            pairs = tl.reshape(codes, [D // 2, 2])
            even, odd = tl.split(pairs)
            tl.store(P + slot * stride_ps + h * stride_ph + tl.arange(0, D // 2), even | (odd << 4))


def store_kv(x, slots, pool, scale=None, bias=None, bits=16, group=64):
    """Write x [T, Hkv, D] into pool at slots [T, Hkv] (one slot per token and KV head; -1 skips),
    quantizing to `bits` (8/4) on the way in when scale/bias pools are given."""
    t, h, d = x.shape
    ps = (0, 0) if scale is None else (scale.stride(0), scale.stride(1))
    _store_kernel[(t, h)](x, slots, pool, scale if scale is not None else pool, bias if bias is not None else pool,
                          x.stride(0), x.stride(1), slots.stride(0), pool.stride(0), pool.stride(1), ps[0], ps[1],
                          D=d, BITS=bits, GS=group)


@triton.jit
def _rope_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_ct, HALF: tl.constexpr, HALF_P: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF_P)
    m = offs < HALF
    p = X + t * stride_xt + h * stride_xh + offs
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + offs, mask=m, other=0.0)
    s = tl.load(Sin + t * stride_ct + offs, mask=m, other=0.0)
    tl.store(p, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=m)
    tl.store(p + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=m)


def rope_inplace(x, cos, sin, heads: int):
    """Rotate the first `heads` heads of x [T, H, D] in place (rotate-half RoPE, fp32 math, as
    model.apply_rope): one launch for the q and k heads of a fused qkv projection, no copies."""
    t, _, d = x.shape
    _rope_kernel[(t, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                             HALF=d // 2, HALF_P=triton.next_power_of_2(d // 2))
