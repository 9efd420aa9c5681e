"""Experiment (not the engine's code): the split kernel of kvbound.kernels with its score-export stores
done three ways, to see what the export costs inside the split kernel. KIND 0: no E store (only the
per-block maxima); 1: tl.store as in kernels.py; 2: E and maxima stored by inline PTX in the registers'
own layout (no layout conversion through shared memory); 3: E laid out [B, Hkv, keys, G], one contiguous
run per block; 4: the same stores as 1, all into one small L2-resident tile (no DRAM writes); 5: fp32 E."""
import torch
import triton
import triton.language as tl

from kvbound.kernels import _codes, _dequant, _dot, _packed_qk


@triton.jit
def _st16(ptr, x, mask):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b16 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,h,r", [ptr.to(tl.int64), x, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _st32(ptr, x, mask):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptr.to(tl.int64), x, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _split_exp(Q, K, V, KS, KB, VS, VB, SlotTable, CtxLen, PartO, PartM, PartL, E, MBlk,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_eb, stride_eh, stride_xb, stride_xh,
                  scale, split,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BITS: tl.constexpr, GS: tl.constexpr, EXPORT: tl.constexpr, IEEE: tl.constexpr, KIND: tl.constexpr):
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
    q_row = b * stride_qb + tl.where(gmask, heads, 0)[:, None] * stride_qh  # padded heads read head 0, unused
    if BITS == 16:
        q = tl.load(Q + q_row + offs_d[None, :]).to(tl.float32) * scale
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=valid, other=0).to(tl.int64)
        kv_ptr = slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
        if BITS == 16:
            qk = _dot(q, tl.trans(tl.load(K + kv_ptr, mask=valid[:, None], other=0.0)), IEEE)
        else:
            qk = _packed_qk(Q, K, KS, KB, slot, h, valid, q_row, stride_ks, stride_kh, stride_ss, stride_sh, scale,
                            G_PAD, BLOCK_N, D, BITS, GS, IEEE)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        if EXPORT:
            if KIND == 1:
                tl.store(E + b * stride_eb + heads[:, None] * stride_eh + offs_n[None, :], p.to(E.dtype.element_ty),
                         mask=gmask[:, None] & valid[None, :])
            if KIND == 3:  # E as [B, Hkv, keys, G]: one contiguous run of BLOCK_N * G values per block
                tl.store(E + b * stride_eb + h * stride_eh + offs_n[None, :] * G + offs_g[:, None],
                         p.to(E.dtype.element_ty), mask=gmask[:, None] & valid[None, :])
            if KIND == 4:  # same stores, all into one L2-resident [16, BLOCK_N] tile per KV head: no DRAM writes
                tl.store(E + h * stride_eh * G + heads[:, None] * 0 + offs_g[:, None] * stride_eh
                         + tl.arange(0, BLOCK_N)[None, :], p.to(E.dtype.element_ty), mask=gmask[:, None] & valid[None, :])
            if KIND == 5:  # fp32 E: twice the bytes
                tl.store(E + b * stride_eb + heads[:, None] * stride_eh + offs_n[None, :], p,
                         mask=gmask[:, None] & valid[None, :])
            if KIND == 2:
                _st16(E + b * stride_eb + heads[:, None] * stride_eh + offs_n[None, :], p.to(tl.float16),
                      gmask[:, None] & valid[None, :])
            if KIND == 2:
                _st32(MBlk + b * stride_xb + heads * stride_xh + j0 // BLOCK_N, m_new.to(tl.int32, bitcast=True), gmask)
            else:
                tl.store(MBlk + b * stride_xb + heads * stride_xh + j0 // BLOCK_N, m_new, mask=gmask)
        l = l * alpha + tl.sum(p, 1)
        if BITS == 16:
            v = tl.load(V + kv_ptr, mask=valid[:, None], other=0.0)
        else:
            v = _dequant(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, IEEE)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE)
        m = m_new
    tl.store(PartO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_d[None, :], acc,
             mask=gmask[:, None])
    tl.store(PartM + b * stride_mb + heads * stride_mh + s, m, mask=gmask)
    tl.store(PartL + b * stride_mb + heads * stride_mh + s, l, mask=gmask)




def split_only(q, k, v, table, lens, kind, export=True, block_n=64, num_warps=4, programs_per_sm=4):
    """One launch of the split kernel as kvbound.kernels.decode_attention makes it (bf16), returning E."""
    bsz, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    max_len = table.shape[1]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = max(1, (programs_per_sm * sms) // max(1, bsz * hkv))
    split = max(block_n * 4, triton.cdiv(triton.cdiv(max_len, want), block_n) * block_n)
    ns = triton.cdiv(max_len, split)
    part_o = torch.empty(bsz, hq, ns, d, device=q.device)
    part_m = torch.empty(bsz, hq, ns, device=q.device)
    part_l = torch.empty_like(part_m)
    e = torch.zeros(bsz, hq, max_len, device=q.device, dtype=torch.float16)
    if kind == 5:
        e = torch.zeros(bsz, hq, max_len, device=q.device, dtype=torch.float32)
    if kind == 3:
        e = torch.zeros(bsz, hkv, max_len, g, device=q.device, dtype=torch.float16)
    m_blk = torch.zeros(bsz, hq, triton.cdiv(max_len, block_n), device=q.device)
    kern = _split_exp[(bsz, hkv, ns)](
        q, k, v, k, k, k, k, table, lens, part_o, part_m, part_l, e, m_blk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        e.stride(0), e.stride(1), m_blk.stride(0), m_blk.stride(1), d ** -0.5, split,
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, BITS=16, GS=d, EXPORT=export,
        IEEE=False, KIND=kind, num_warps=num_warps)
    REGS[(kind, export, block_n, d)] = (kern.n_regs, kern.n_spills, kern.metadata.shared)
    return e, m_blk


REGS = {}


def main():
    from decode_attention import timed, tune_inputs
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'shape':<8}{'B':>3}{'ctx':>6}{'blk':>4}{'off us':>8}{'kind0':>7}{'kind1':>7}{'kind2':>7}{'kind3':>7}{'kind4':>7}{'kind5':>7}  same")
    for name, bsz, ctx in [("8b", 64, 2048), ("8b", 64, 8192), ("8b", 16, 32768), ("smollm2", 64, 8192)]:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx, block=16)
        for blk in (64, 128):
            e1, m1 = split_only(qs[0], k, v, tables[0], lens, 1, block_n=blk)
            e2, m2 = split_only(qs[0], k, v, tables[0], lens, 2, block_n=blk)
            e3, m3 = split_only(qs[0], k, v, tables[0], lens, 3, block_n=blk)
            hq, hkv = qs[0].shape[1], k.shape[1]
            same = (torch.equal(e1, e2) and torch.equal(m1, m2)
                    and torch.equal(e1, e3.permute(0, 1, 3, 2).reshape(e1.shape)))
            off = timed(lambda i: split_only(qs[i], k, v, tables[i], lens, 0, export=False, block_n=blk), sets)
            t = [timed(lambda i: split_only(qs[i], k, v, tables[i], lens, kd, block_n=blk), sets) for kd in (0, 1, 2, 3, 4, 5)]
            print(f"{name:<8}{bsz:>3}{ctx:>6}{blk:>4}{1e3 * off:>8.1f}" + "".join(f"{x / off:>7.3f}" for x in t)
                  + f"  {same}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    print("(kind, export, block_n, d): (registers per thread, spills, shared bytes)")
    for key, val in sorted(REGS.items()):
        print(key, val)


if __name__ == "__main__":
    main()
