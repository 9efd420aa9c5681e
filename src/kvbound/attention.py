"""Attention over cached slots plus the new tokens, optionally returning per-key attention scores.

This PyTorch version is the reference (the oracle in tests) and the CPU path. Eviction policies need
the post-softmax probabilities each cached key received, summed over the query heads of its GQA group
(and over the new query tokens); fused kernels normally throw those away, so we return them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mode: str | None = None):
    """q: [T, Hq, D] new queries; k, v: [n + T, Hkv, D], the n cached keys then the T new ones (rotated).

    Query t sees every cached key and the new keys 0..t (causal). Returns (out [T, Hq, D], key_scores):
    key_scores is None, or [n + T, Hkv] float32 with, per key, the probability it received summed over
    the query heads of its KV head and over the T queries; with score_mode="normalized" each query's
    probabilities are first multiplied by the number of keys it attended to.
    """
    out, scores = attend_batch(q[None], k[None], v[None], score_mode)
    return out[0], None if scores is None else scores[0]


def attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mode: str | None = None):
    """`attend` for B sequences at once, each with the same numbers of cached and new tokens:
    q [B, T, Hq, D], k and v [B, n + T, Hkv, D]; returns out [B, T, Hq, D] and key_scores [B, n + T, Hkv]."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    n = k.shape[1] - t
    scale = d ** -0.5
    mask = None if t == 1 else _causal_mask(t, n, q.device)
    if mask is not None and q.is_cuda:
        out = _causal_cuda(q, k.to(q.dtype), v.to(q.dtype), n, scale)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=mask, scale=scale, enable_gqa=hq != hkv).transpose(1, 2)
    if score_mode is None:
        return out, None
    # The scores come from the same logits recomputed in fp32; the output stays SDPA's, so a policy that
    # has not evicted anything yet gives bit-identical logits to the full cache.
    g = hq // hkv
    # [B, hkv, t*g, d] @ [B, hkv, d, m] -> [B, hkv, g, t, m]
    qh = q.float().view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    logits = torch.matmul(qh, k.float().permute(0, 2, 3, 1)).view(b, hkv, t, g, -1).transpose(2, 3) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(-1)
    if score_mode == "normalized":
        seen = torch.arange(n + 1, n + t + 1, device=q.device, dtype=torch.float32)
        probs = probs * seen[:, None]
    elif score_mode != "sum":
        raise ValueError(f"unknown score_mode {score_mode!r}")
    return out, probs.sum(dim=(2, 3)).transpose(1, 2).contiguous()


def fused_sdpa(*args, **kw):
    """SDPA on CUDA through flash / memory-efficient attention: cuDNN's backend plans each new shape anew
    (over a millisecond of host time), and prefill pieces come in many shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*args, **kw)


def _causal_cuda(q, k, v, n, scale):
    """Prefill chunks on CUDA, q [B, T, Hq, D] after n cached keys: a causal mask aligned to the bottom
    right instead of a boolean mask, so SDPA can take a fused kernel."""
    from torch.nn.attention.bias import causal_lower_right
    t, hq = q.shape[1], q.shape[2]
    g = hq // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(g, 2).transpose(1, 2)
    vh = v.repeat_interleave(g, 2).transpose(1, 2)
    if n == 0:
        return fused_sdpa(qh, kh, vh, is_causal=True, scale=scale).transpose(1, 2)
    bias = causal_lower_right(t, n + t)
    return fused_sdpa(qh, kh, vh, attn_mask=bias, scale=scale).transpose(1, 2)


def _causal_mask(t: int, n: int, device) -> torch.Tensor:
    """[T, n+T] bool, True where query t may attend key m."""
    return torch.arange(n + t, device=device)[None, :] <= (n + torch.arange(t, device=device))[:, None]


def paged_decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, scale=None, score=None, score_mode=None,
                           ema_decay=0.95, quant=None):
    """The reference of kernels.decode_attention (same arguments): one query per sequence over the keys at
    slot_table[b, :ctx_lens[b]] of the pools, GQA; `score` [B, max_len, Hkv] gets this step's probabilities
    (summed over each KV head's query group) added ("sum"), weighted by the number of keys ("normalized"),
    or folded in as an EMA ("ema"), for the valid keys only. Packed pools (quant=dict(bits=, group=,
    k_scale=, k_bias=, v_scale=, v_bias=)) are dequantized first. Returns out [B, Hq, D] in q's dtype."""
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    idx = slot_table.long()
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation, as the kernel's
    if quant is None:
        k, v = k_pool[idx].to(acc), v_pool[idx].to(acc)  # [B, M, Hkv, D]
    else:
        from .quant import dequantize
        bits, group = quant["bits"], quant["group"]
        k = dequantize(k_pool[idx], quant["k_scale"][idx], quant["k_bias"][idx], bits, group, acc)
        v = dequantize(v_pool[idx], quant["v_scale"][idx], quant["v_bias"][idx], bits, group, acc)
    valid = torch.arange(idx.shape[1], device=q.device)[None, :] < ctx_lens.to(q.device)[:, None]  # [B, M]
    logits = torch.einsum("bhgd,bmhd->bhgm", q.to(acc).view(b, hkv, g, d), k) * scale
    probs = logits.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bhgm,bmhd->bhgd", probs, v).reshape(b, hq, d).to(q.dtype)
    if score_mode is not None:
        step = probs.sum(2).transpose(1, 2)  # [B, M, Hkv]
        if score_mode == "normalized":
            step = step * ctx_lens.to(step)[:, None, None]
        if score_mode == "ema":
            new = score * ema_decay + step * (1 - ema_decay)
        elif score_mode in ("sum", "normalized"):
            new = score + step
        else:
            raise ValueError(f"unknown score_mode {score_mode!r}")
        score.copy_(torch.where(valid[:, :, None], new, score))
    return out


def decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, **kw):
    """The one dispatch point for paged decode attention: the Triton kernel on CUDA, the reference elsewhere."""
    if q.is_cuda:
        from .kernels import decode_attention as kernel
        return kernel(q, k_pool, v_pool, slot_table, ctx_lens, **kw)
    return paged_decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, **kw)
