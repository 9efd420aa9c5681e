"""Triton key scores of a prefill piece: what each key's attention probabilities add up to (or their highest), in
one pass.

A bounded cache's prefill piece needs, per key and KV head, the post-softmax probability it received, summed
over the query heads of its group and over the piece's queries (H2O's scores; SnapKV's observation window is
the last queries only). FlashAttention gives the output and each query's log-sum-exp (LSE) but throws the
probabilities away; with the LSE, p = exp(q.k * scale - LSE) is exact for each (query, key) pair alone. So this
kernel recomputes q.k on the tensor cores, one program per block of keys and KV head, and sums p down the
queries that can see the block (causal): half the work of the attention, and no [queries x keys] matrix in
memory.

`reference.causal_attention_batch` is the reference (fp32 logits, masked softmax, sum), tested against this on
the CPU through TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


@triton.jit
def _key_scores_kernel(Q, K, Lse, Out, Starts, Used, t, m_keys, n_cached, first, scale_log2,
                       stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_lh, stride_ob, stride_ot,
                       G: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, NORMALIZED: tl.constexpr, IEEE: tl.constexpr, VARLEN: tl.constexpr,
                       BEST: tl.constexpr = False):
    jb = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    if VARLEN:  # sequence b's keys are Used[b] rows of K (and of Out) from row Starts[b]
        m_keys = tl.load(Used + b)
        n_cached = m_keys - t
        K += tl.load(Starts + b).to(tl.int64) * stride_kt
        Out += tl.load(Starts + b).to(tl.int64) * stride_ot
    else:
        K += b * stride_kb
        Out += b * stride_ob
    offs_n = jb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_P)
    key_ok = offs_n < m_keys
    k = tl.load(K + offs_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lo = tl.maximum(first, jb * BLOCK_N - n_cached)  # earlier queries see none of this block's keys
    lo = lo - lo % BLOCK_M
    for g in range(G):
        head = kvh * G + g
        for i0 in range(lo, t, BLOCK_M):
            offs_m = i0 + tl.arange(0, BLOCK_M)
            q_ok = (offs_m < t) & (offs_m >= first)
            q = tl.load(Q + (b * t + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                        mask=q_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            lse = tl.load(Lse + head * stride_lh + b * t + offs_m, mask=q_ok, other=0.0) * LOG2E
            if IEEE:  # float32 inputs: no TF32 rounding on the GPU
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2 - lse[:, None]
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None]
            seen = q_ok[:, None] & key_ok[None, :] & (offs_n[None, :] <= n_cached + offs_m[:, None])
            p = tl.where(seen, tl.exp2(s), 0.0)
            if NORMALIZED:  # each query's probabilities weighted by the number of keys it saw
                p = p * (n_cached + offs_m + 1).to(tl.float32)[:, None]
            if BEST:  # KVzip's score: the highest probability, not their sum
                acc = tl.maximum(acc, tl.max(p, 0))
            else:
                acc += tl.sum(p, 0)
    tl.store(Out + offs_n * stride_ot + kvh, acc, mask=key_ok)


def key_scores(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, first: int = 0,
               normalized: bool = False, starts: torch.Tensor | None = None, used: torch.Tensor | None = None,
               max_keys: int = 0, best: bool = False) -> torch.Tensor:
    """q [B, t, Hq, D] (the piece's queries), k [B, n + t, Hkv, D] (its cached keys, then its own), lse
    [Hq, B * t] (natural-log LSE of each query's logits, scaled by D^-0.5, as FlashAttention returns it).
    Returns [B, n + t, Hkv] float32: each key's probability summed over its group's query heads and over
    queries first..t-1 that see it (weighted by n + i + 1 with `normalized`; with `best`, its highest one).
    Varlen (`varlen_attention_lse`'s packing): k [rows, Hkv, D], sequence b's keys the used[b] rows from
    starts[b] (int32 [B], at most max_keys), its own t last; returns [rows, Hkv], 0 in rows no sequence uses."""
    bsz, t, hq, d = q.shape
    hkv = k.shape[-2]
    varlen = starts is not None
    m_keys = max_keys if varlen else k.shape[1]
    q = q.reshape(bsz * t, hq, d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if varlen:
        out = torch.zeros(k.shape[0], 1, hkv, dtype=torch.float32, device=q.device)
        k = k[:, None]
    else:
        out = torch.empty(bsz, m_keys, hkv, dtype=torch.float32, device=q.device)
    block_n = 64
    grid = (triton.cdiv(m_keys, block_n), hkv, bsz)
    _key_scores_kernel[grid](q, k, lse, out, starts, used, t, m_keys, m_keys - t, first, d ** -0.5 * LOG2E.value,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), lse.stride(0),
                             out.stride(0), out.stride(1), G=hq // hkv, D=d, D_P=max(16, triton.next_power_of_2(d)),
                             BLOCK_M=64, BLOCK_N=block_n, NORMALIZED=normalized,
                             IEEE=q.dtype == torch.float32, VARLEN=varlen, BEST=best, num_warps=4, num_stages=2)
    return out[:, 0] if varlen else out
