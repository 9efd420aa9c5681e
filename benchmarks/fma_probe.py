"""Probe: 8-bit decode at d=128 with CUDA-core dots (no tensor cores) against the split kernel's tensor-core route.

    python benchmarks/fma_probe.py [--configs 8b:7:4096:8192,...]
"""
import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode_attention import packed, timed, tune_inputs  # noqa: E402

from kvbound.kernels import decode_attention  # noqa: E402
from kvbound.kernels.triton_decode import _merge_kernel, _seq_split  # noqa: E402

_BYTES_TO_F32: tl.constexpr = tl.constexpr("""{
prmt.b32 $0, $4, 0x4B000000, 0x7540;
prmt.b32 $1, $4, 0x4B000000, 0x7541;
prmt.b32 $2, $4, 0x4B000000, 0x7542;
prmt.b32 $3, $4, 0x4B000000, 0x7543;
sub.f32 $0, $0, 0f4B000000;
sub.f32 $1, $1, 0f4B000000;
sub.f32 $2, $2, 0f4B000000;
sub.f32 $3, $3, 0f4B000000;
}""")


@triton.jit
def _f32(c, PRMT: tl.constexpr):
    if PRMT:
        return tl.inline_asm_elementwise(_BYTES_TO_F32, "=r,=r,=r,=r,r", [c], dtype=tl.float32, is_pure=True, pack=4)
    return (c.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _logits(kf0, kf1, q0, q1, qs0, qs1, ks0, kb0, ks1, kb1, valid):
    """One query head's logits over a block: per group scale * (q . codes) + bias * sum(q)."""
    s = tl.sum(kf0 * q0[None, :], 1) * ks0 + qs0 * kb0 + tl.sum(kf1 * q1[None, :], 1) * ks1 + qs1 * kb1
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _head_step(s, m, l, a0, a1, pb0, pb1, vf0, vf1, vs0, vb0, vs1, vb1, ACC3: tl.constexpr):
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    l = l * alpha + tl.sum(p, 0)
    pb0 = pb0 * alpha + tl.sum(p * vb0, 0)
    pb1 = pb1 * alpha + tl.sum(p * vb1, 0)
    if ACC3:
        if m_new > m:
            a0 = a0 * alpha
            a1 = a1 * alpha
        a0 += vf0 * (p * vs0)[:, None]
        a1 += vf1 * (p * vs1)[:, None]
    else:
        a0 = a0 * alpha + tl.sum(vf0 * (p * vs0)[:, None], 0)
        a1 = a1 * alpha + tl.sum(vf1 * (p * vs1)[:, None], 0)
    return m_new, l, a0, a1, pb0, pb1


@triton.jit
def _head_out(PartO, PartM, PartL, row, orow, m, l, a0, a1, pb0, pb1, GS: tl.constexpr, ACC3: tl.constexpr):
    offs = tl.arange(0, GS)
    if ACC3:
        a0 = tl.sum(a0, 0)
        a1 = tl.sum(a1, 0)
    tl.store(PartO + orow + offs, a0 + pb0)
    tl.store(PartO + orow + GS + offs, a1 + pb1)
    tl.store(PartM + row, m)
    tl.store(PartL + row, l)


@triton.jit
def _fma_split(Q, K, V, KS, KB, VS, VB, SlotTable, CtxLen, PartO, PartM, PartL,
               stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
               stride_ob, stride_oh, stride_os, stride_mb, stride_mh, scale, split,
               G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, GS: tl.constexpr, ACC3: tl.constexpr,
               PRMT: tl.constexpr):
    """G = 4 query heads a KV head, two groups a head (d = 128): every op 2-D in the codes' load layout."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(CtxLen + b)
    split = _seq_split(n, split, tl.num_programs(2), BLOCK_N)
    start = s * split
    end = tl.minimum(start + split, n)
    offs_w = tl.arange(0, GS)
    qp = Q + b * stride_qb + h * G * stride_qh + offs_w
    q00 = tl.load(qp).to(tl.float32) * scale
    q01 = tl.load(qp + GS).to(tl.float32) * scale
    q10 = tl.load(qp + stride_qh).to(tl.float32) * scale
    q11 = tl.load(qp + stride_qh + GS).to(tl.float32) * scale
    q20 = tl.load(qp + 2 * stride_qh).to(tl.float32) * scale
    q21 = tl.load(qp + 2 * stride_qh + GS).to(tl.float32) * scale
    q30 = tl.load(qp + 3 * stride_qh).to(tl.float32) * scale
    q31 = tl.load(qp + 3 * stride_qh + GS).to(tl.float32) * scale
    qs00, qs01, qs10, qs11 = tl.sum(q00, 0), tl.sum(q01, 0), tl.sum(q10, 0), tl.sum(q11, 0)
    qs20, qs21, qs30, qs31 = tl.sum(q20, 0), tl.sum(q21, 0), tl.sum(q30, 0), tl.sum(q31, 0)
    m0 = tl.full([], float("-inf"), tl.float32)
    m1, m2, m3 = m0, m0, m0
    l0 = tl.zeros([], tl.float32)
    l1, l2, l3 = l0, l0, l0
    p00, p01, p10, p11, p20, p21, p30, p31 = l0, l0, l0, l0, l0, l0, l0, l0
    if ACC3:
        a00 = tl.zeros([BLOCK_N, GS], tl.float32)
    else:
        a00 = tl.zeros([GS], tl.float32)
    a01, a10, a11, a20, a21, a30, a31 = a00, a00, a00, a00, a00, a00, a00
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=valid, other=0).to(tl.int64)
        base = slot[:, None] * stride_ks + h * stride_kh + offs_w[None, :]
        kf0 = _f32(tl.load(K + base, mask=valid[:, None], other=0), PRMT)
        kf1 = _f32(tl.load(K + base + GS, mask=valid[:, None], other=0), PRMT)
        sp = slot * stride_ss + h * stride_sh
        ks0 = tl.load(KS + sp, mask=valid, other=0.0).to(tl.float32)
        kb0 = tl.load(KB + sp, mask=valid, other=0.0).to(tl.float32)
        ks1 = tl.load(KS + sp + 1, mask=valid, other=0.0).to(tl.float32)
        kb1 = tl.load(KB + sp + 1, mask=valid, other=0.0).to(tl.float32)
        vf0 = _f32(tl.load(V + base, mask=valid[:, None], other=0), PRMT)
        vf1 = _f32(tl.load(V + base + GS, mask=valid[:, None], other=0), PRMT)
        vs0 = tl.load(VS + sp, mask=valid, other=0.0).to(tl.float32)
        vb0 = tl.load(VB + sp, mask=valid, other=0.0).to(tl.float32)
        vs1 = tl.load(VS + sp + 1, mask=valid, other=0.0).to(tl.float32)
        vb1 = tl.load(VB + sp + 1, mask=valid, other=0.0).to(tl.float32)
        s0 = _logits(kf0, kf1, q00, q01, qs00, qs01, ks0, kb0, ks1, kb1, valid)
        s1 = _logits(kf0, kf1, q10, q11, qs10, qs11, ks0, kb0, ks1, kb1, valid)
        s2 = _logits(kf0, kf1, q20, q21, qs20, qs21, ks0, kb0, ks1, kb1, valid)
        s3 = _logits(kf0, kf1, q30, q31, qs30, qs31, ks0, kb0, ks1, kb1, valid)
        m0, l0, a00, a01, p00, p01 = _head_step(s0, m0, l0, a00, a01, p00, p01, vf0, vf1, vs0, vb0, vs1, vb1, ACC3)
        m1, l1, a10, a11, p10, p11 = _head_step(s1, m1, l1, a10, a11, p10, p11, vf0, vf1, vs0, vb0, vs1, vb1, ACC3)
        m2, l2, a20, a21, p20, p21 = _head_step(s2, m2, l2, a20, a21, p20, p21, vf0, vf1, vs0, vb0, vs1, vb1, ACC3)
        m3, l3, a30, a31, p30, p31 = _head_step(s3, m3, l3, a30, a31, p30, p31, vf0, vf1, vs0, vb0, vs1, vb1, ACC3)
    row = b * stride_mb + h * G * stride_mh + s
    orow = b * stride_ob + h * G * stride_oh + s * stride_os
    _head_out(PartO, PartM, PartL, row, orow, m0, l0, a00, a01, p00, p01, GS, ACC3)
    _head_out(PartO, PartM, PartL, row + stride_mh, orow + stride_oh, m1, l1, a10, a11, p10, p11, GS, ACC3)
    _head_out(PartO, PartM, PartL, row + 2 * stride_mh, orow + 2 * stride_oh, m2, l2, a20, a21, p20, p21, GS, ACC3)
    _head_out(PartO, PartM, PartL, row + 3 * stride_mh, orow + 3 * stride_oh, m3, l3, a30, a31, p30, p31, GS, ACC3)


def fma_decode(q, kc, vc, quant, table, lens, block_n=32, warps=8, stages=2, pps=2, acc3=True, prmt=True):
    bsz, hq, d = q.shape
    hkv = kc.shape[1]
    g = hq // hkv
    max_len = table.shape[1]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    want = max(1, (pps * sms) // max(1, bsz * hkv))
    split = max(block_n * 4, triton.cdiv(triton.cdiv(max_len, want), block_n) * block_n)
    num_splits = max(1, triton.cdiv(max_len, split))
    min_split = min(split, 4 * block_n)
    part_o = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    part_m = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    out = torch.empty_like(q)
    ks, kb, vs, vb = quant["k_scale"], quant["k_bias"], quant["v_scale"], quant["v_bias"]
    _fma_split[(bsz, hkv, num_splits)](
        q, kc, vc, ks, kb, vs, vb, table, lens, part_o, part_m, part_l,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1), d ** -0.5,
        min_split, G=g, D=d, BLOCK_N=block_n, GS=quant["group"], ACC3=acc3, PRMT=prmt, num_warps=warps,
        num_stages=stages)
    _merge_kernel[(bsz, hkv)](
        part_o, part_m, part_l, out, lens, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_m.stride(0), part_m.stride(1), out.stride(0), out.stride(1), min_split, num_splits, BLOCK_N=block_n,
        G=g, G_PAD=max(16, g), D=d, MODE=0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="8b:7:4096:8192,8b:16:8192:8192,8b:1:32768:32768,8b:14:4096:8192")
    ap.add_argument("--variants", default="32:8:2:2:1:1,16:4:2:2:1:1,32:4:2:2:1:1,64:8:2:2:1:1,32:8:2:4:1:1,"
                                          "32:8:3:2:1:1,32:8:2:2:0:1,64:8:2:2:0:1,32:8:2:2:1:0")
    args = ap.parse_args()
    print(f"{'B':>4}{'ctx':>6}{'width':>6} {'variant':<16}{'ms':>8}{'vs bf16':>8}{'vs q8':>7}{'err':>9}")
    for spec in args.configs.split(","):
        _, bsz, ctx, width = spec.split(":")
        bsz, ctx, width = int(bsz), int(ctx), int(width)
        sets, k, v, tables, lens, qs = tune_inputs("8b", bsz, width, block=16)
        lens.fill_(ctx)
        kc, vc, quant = packed(k, v, 8)
        ref_ms = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        q8_ms = timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, quant=quant), sets)
        want = decode_attention(qs[0], kc, vc, tables[0], lens, quant=quant).float()
        print(f"{bsz:>4}{ctx:>6}{width:>6} {'bf16':<16}{ref_ms:>8.4f}{1:>8.2f}")
        print(f"{bsz:>4}{ctx:>6}{width:>6} {'q8 tensor':<16}{q8_ms:>8.4f}{q8_ms / ref_ms:>8.2f}{1:>7.2f}")
        for var in args.variants.split(","):
            blk, w, st, pps, acc3, prmt = (int(x) for x in var.split(":"))
            kw = dict(block_n=blk, warps=w, stages=st, pps=pps, acc3=bool(acc3), prmt=bool(prmt))
            try:
                got = fma_decode(qs[0], kc, vc, quant, tables[0], lens, **kw).float()
                err = (got - want).abs().max().item()
                ms = timed(lambda i: fma_decode(qs[i], kc, vc, quant, tables[i], lens, **kw), sets)
            except Exception as e:  # noqa: BLE001
                print(f"{bsz:>4}{ctx:>6}{width:>6} {var:<16} failed: {str(e).splitlines()[0][:80]}")
                continue
            print(f"{bsz:>4}{ctx:>6}{width:>6} {var:<16}{ms:>8.4f}{ms / ref_ms:>8.2f}{ms / q8_ms:>7.2f}{err:>9.2e}",
                  flush=True)
        del k, v, kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
