"""PyTorch reference attention: the oracle the Triton kernels are tested against, and the CPU path.

Eviction policies need the post-softmax probabilities each cached key received, summed over the query heads
of its GQA group (and over the new query tokens); fused kernels normally throw those away, so these return
them. Score modes are the policies' names: "cumulative" and "ema" take the plain probabilities (EMA is a
way of folding them, `fold_scores`), "normalized" weights each query's probabilities by the number of keys
it saw.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SCORE_MODES = (None, "cumulative", "normalized", "ema")
PIECE_MODES = SCORE_MODES + ("max",)  # a prefill piece's also: each key's highest probability (KVzip's score)


def _check_mode(score_mode, modes=SCORE_MODES):
    if score_mode not in modes:
        raise ValueError(f"unknown score_mode {score_mode!r} (choose from {', '.join(map(str, modes[1:]))})")


def _reduced(probs, score_mode: str, dims) -> torch.Tensor:
    """Probabilities summed over `dims` (the queries and a group's heads), or their maximum with "max"."""
    return probs.amax(dim=dims) if score_mode == "max" else probs.sum(dim=dims)


def layer_sum(step: torch.Tensor) -> torch.Tensor:
    """Probabilities [..., H] with every KV head holding the sum over the layer's heads (granularity "layer": the
    heads keep the same tokens)."""
    return step.sum(-1, keepdim=True).expand_as(step)


def fold_scores(old: torch.Tensor, step: torch.Tensor, score_mode: str, ema_decay: float) -> torch.Tensor:
    """Accumulated scores after one more step's probabilities: an EMA (`a*old + (1-a)*step`) or a sum."""
    if score_mode == "ema":
        return old * ema_decay + step * (1 - ema_decay)
    return old + step


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mode: str | None = None):
    """q: [T, Hq, D] new queries; k, v: [n + T, Hkv, D], the n cached keys then the T new ones (rotated).

    Query t sees every cached key and the new keys 0..t (causal). Returns (out [T, Hq, D], key_scores):
    key_scores is None, or [n + T, Hkv] float32 with, per key, the probability it received summed over
    the query heads of its KV head and over the T queries (weighted by the number of keys each query
    attended to with score_mode="normalized").
    """
    out, scores = causal_attention_batch(q[None], k[None], v[None], score_mode)
    return out[0], None if scores is None else scores[0]


def causal_attention_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mode: str | None = None,
                           last_queries: int | None = None, bias: torch.Tensor | None = None):
    """`causal_attention` for B sequences at once, each with the same numbers of cached and new tokens:
    q [B, T, Hq, D], k and v [B, n + T, Hkv, D]; returns out [B, T, Hq, D] and key_scores [B, n + T, Hkv].
    With `last_queries`, only the last that many queries' probabilities count (SnapKV's observation window).
    bias [B, n + T, Hkv]: added to each key's logits (merged keys' log counts, `cache.merge`). score_mode "max":
    each key's highest probability instead of their sum."""
    _check_mode(score_mode, PIECE_MODES)
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    n = k.shape[1] - t
    scale = d ** -0.5
    if bias is not None:
        return _biased_batch(q, k, v, score_mode, last_queries, bias)
    if t > 1 and flash_ok(q):
        return _flash_batch(q, k, v, score_mode, last_queries)
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
    first = t - min(t, last_queries or t)  # the queries whose probabilities count: [first, t)
    tq = t - first
    # [B, hkv, tq*g, d] @ [B, hkv, d, m] -> [B, hkv, g, tq, m]
    qh = q[:, first:].float().reshape(b, tq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, tq * g, d)
    logits = torch.matmul(qh, k.float().permute(0, 2, 3, 1)).view(b, hkv, tq, g, -1).transpose(2, 3) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[first:], float("-inf"))
    probs = logits.softmax(-1)
    if score_mode == "normalized":
        seen = torch.arange(n + first + 1, n + t + 1, device=q.device, dtype=torch.float32)
        probs = probs * seen[:, None]
    return out, _reduced(probs, score_mode, (2, 3)).transpose(1, 2).contiguous()


BIASED_ELEMENTS = 1 << 27  # the most logits one `_biased_batch` call holds: more sequences go in chunks of them


def _biased_batch(q, k, v, score_mode, last_queries, bias):
    """causal_attention_batch with a logit bias per key, in fp32 (no fused kernel takes one), in chunks of sequences
    whose logits fit BIASED_ELEMENTS."""
    each = max(1, BIASED_ELEMENTS // (q.shape[1] * q.shape[2] * k.shape[1]))
    if q.shape[0] > each:
        parts = [_biased_batch(*(x[a:a + each] for x in (q, k, v)), score_mode, last_queries, bias[a:a + each])
                 for a in range(0, q.shape[0], each)]
        return torch.cat([o for o, _ in parts]), None if score_mode is None else torch.cat([s for _, s in parts])
    b, t, hq, d = q.shape
    hkv, m = k.shape[2], k.shape[1]
    g = hq // hkv
    logits = torch.einsum("bthgd,bmhd->bhgtm", q.float().view(b, t, hkv, g, d), k.float()) * d ** -0.5
    logits = logits + bias.float().permute(0, 2, 1)[:, :, None, None, :]
    logits = logits.masked_fill(~_causal_mask(t, m - t, q.device), float("-inf"))
    probs = logits.softmax(-1)  # [B, Hkv, G, T, M]
    out = torch.einsum("bhgtm,bmhd->bthgd", probs, v.float()).reshape(b, t, hq, d).to(q.dtype)
    if score_mode is None:
        return out, None
    first = t - min(t, last_queries or t)
    probs = probs[:, :, :, first:]
    if score_mode == "normalized":
        probs = probs * torch.arange(m - t + first + 1, m + 1, device=q.device, dtype=torch.float32)[:, None]
    return out, _reduced(probs, score_mode, (2, 3)).transpose(1, 2).contiguous()


def fused_sdpa(*args, **kw):
    """SDPA on CUDA through flash / memory-efficient attention: cuDNN's backend plans each new shape anew
    (over a millisecond of host time), and prefill pieces come in many shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*args, **kw)


def varlen_causal_attention(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int):
    """Causal attention of several pieces at once, packed: piece i's queries q[cu_q[i]:cu_q[i+1]] [Tq, Hq, D]
    are its last keys k[cu_k[i]:cu_k[i+1]] [Tk, Hkv, D] (its cached keys come first), the causal mask aligned
    to the bottom right, GQA. On CUDA (half precision) one FlashAttention varlen call for all pieces, however
    their lengths differ; elsewhere the pieces one by one. cu_q, cu_k: int32 [N + 1] on q's device."""
    if flash_ok(q):
        return _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k)[0]
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return torch.cat([causal_attention(q[a:b], k[c:e], v[c:e])[0] for a, b, c, e in zip(bq, bq[1:], bk, bk[1:])])


def varlen_attention_lse(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                         used_k: torch.Tensor | None = None):
    """`varlen_causal_attention` that also returns each query's LSE [Hq, Tq] (fp32, natural log of its logits
    scaled by D^-0.5). used_k [N] (int32): piece i's keys are only the first used_k[i] from cu_k[i], so pieces
    may sit in slices longer than they are, and no host sync sizes them on CUDA. max_k: any bound on a piece's
    keys. On CUDA one FlashAttention varlen call; elsewhere the pieces one by one, in fp32."""
    if flash_ok(q):
        return _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_k)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    ends = bk[1:] if used_k is None else [c + u for c, u in zip(bk, used_k.tolist())]
    outs, lses = [], []
    for a, b, c, e in zip(bq, bq[1:], bk, ends):
        out, lse = _attention_lse(q[a:b], k[c:e], v[c:e])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def _attention_lse(q, k, v):
    """One piece's causal attention and LSE, q [T, Hq, D] the last of k, v [n + T, Hkv, D], in fp32."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    logits = torch.einsum("thd,mhd->htm", q.float(), k.float().repeat_interleave(g, 1)) * d ** -0.5
    logits = logits.masked_fill(~_causal_mask(t, k.shape[0] - t, q.device), float("-inf"))
    lse = logits.logsumexp(-1)
    out = torch.einsum("htm,mhd->thd", (logits - lse[..., None]).exp(), v.float().repeat_interleave(g, 1))
    return out.to(q.dtype), lse


def flash_ok(q) -> bool:
    """Whether FlashAttention takes these queries (CUDA, half precision, a head size it supports)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_k=None):
    """FlashAttention's varlen forward: (out [Tq, Hq, D], LSE [Hq, Tq] float32, natural log)."""
    out, lse = torch.ops.aten._flash_attention_forward(q, k.to(q.dtype), v.to(q.dtype), cu_q, cu_k, max_q, max_k,
                                                       0.0, True, False, scale=q.shape[-1] ** -0.5,
                                                       seqused_k=used_k)[:2]
    if lse.dim() == 3:  # older builds pad it per sequence: [N, Hq, max_q]
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        lse = torch.cat([lse[i, :, :n] for i, n in enumerate(lens)], 1)
    return out, lse


def _flash_batch(q, k, v, score_mode, last_queries):
    """causal_attention_batch on CUDA: FlashAttention for the output, and the scores in one more pass over the
    keys from its LSE (`triton_prefill.key_scores`)."""
    b, t, hq, d = q.shape
    m = k.shape[1]
    dev = q.device
    k, v = k.to(q.dtype), v.to(q.dtype)
    cu_q = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (b + 1) * m, m, dtype=torch.int32, device=dev)
    out, lse = _flash_varlen(q.reshape(b * t, hq, d), k.reshape(b * m, -1, d), v.reshape(b * m, -1, d), cu_q, cu_k,
                             t, m)
    out = out.view(b, t, hq, d)
    if score_mode is None:
        return out, None
    from .triton_prefill import key_scores
    first = t - min(t, last_queries or t)
    return out, key_scores(q, k, lse, first, score_mode == "normalized", best=score_mode == "max")


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


def decode_with_scores(q, k, v, ctx_lens, score_mode=None, bias=None):
    """One query per sequence over its first ctx_lens[b] keys: q [B, Hq, D], k, v [B, M, Hkv, D] (gathered,
    any float dtype). Returns (out [B, Hq, D] in q's dtype, this step's probabilities [B, M, Hkv] summed
    over each KV head's query group, 0 past ctx_lens, or None without a score_mode), fp32 accumulation.
    bias [B, M, Hkv]: added to each key's logits (merged keys' log counts, `cache.merge`)."""
    _check_mode(score_mode)
    b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation, as the kernel's
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < ctx_lens.to(q.device)[:, None]  # [B, M]
    logits = torch.einsum("bhgd,bmhd->bhgm", q.to(acc).view(b, hkv, g, d), k.to(acc)) * d ** -0.5
    if bias is not None:
        logits = logits + bias.to(acc).transpose(1, 2)[:, :, None, :]
    probs = logits.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bhgm,bmhd->bhgd", probs, v.to(acc)).reshape(b, hq, d).to(q.dtype)
    if score_mode is None:
        return out, None
    step = probs.sum(2).transpose(1, 2)  # [B, M, Hkv]
    if score_mode == "normalized":
        step = step * ctx_lens.to(step)[:, None, None]
    return out, step


def contiguous_slots(slot_table, ctx_lens) -> torch.Tensor:
    """The slot table of per-sequence buffers (key j of sequence b at slot_table[b, 0] + j), columns past a
    sequence's length pointing at its first slot: what lies past its buffer may be unmapped, or NaN."""
    j = torch.arange(slot_table.shape[1], device=slot_table.device, dtype=slot_table.dtype)
    return slot_table[:, :1] + torch.where(j < ctx_lens.to(slot_table.device)[:, None], j, 0)


def ring_entry(pos, sink: int, recent: int):
    """Mixed widths' ring entry of each position: sinks by position, the window by position modulo recent + 1."""
    return torch.where(pos < sink, pos, sink + pos % (recent + 1))


def ring_held(pos, first, sink: int, recent: int):
    """Which positions `pos` [B, ...] (-1: none) read their residual in a step from `first` (an int or [B]): the
    sinks and the `recent` positions before `first`."""
    first = torch.as_tensor(first, device=pos.device).reshape(-1, *[1] * (pos.dim() - 1))
    return (pos >= 0) & ((pos < sink) | (pos >= first - recent))


def add_residuals(k, v, resid, group):
    """Residual reads (`decode_attention(resid=)`; the PyTorch route's too): keys and values [B, M, H, D] of local
    slots [0, M) whose positions (resid["pos"] at resid["rows"]) hold a residual add it from its ring entry."""
    from .packing import dequantize
    rows = resid["rows"].long()
    p = resid["pos"][rows, :k.shape[1]].long()
    held = ring_held(p, resid["first"], resid["sink"], resid["recent"])[..., None]
    at = (rows[:, None, None], ring_entry(p.clamp(min=0), resid["sink"], resid["recent"]),
          torch.arange(p.shape[-1], device=p.device))
    return [torch.where(held, (x.float() + dequantize(*(t[at] for t in ring), 4, group)).to(x.dtype), x)
            for x, ring in ((k, resid["k"]), (v, resid["v"]))]


def paged_decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, score=None, score_mode=None,
                           ema_decay=0.95, quant=None, contiguous=False, resid=None, layer=False, count=None):
    """The reference of the Triton decode kernel (same arguments): one query per sequence over the keys at
    slot_table[b, :ctx_lens[b]] of the pools, GQA; `score` [B, max_len, Hkv] folds in this step's
    probabilities (`fold_scores`) for the valid keys only. Packed pools (quant=dict(bits=, group=,
    k_scale=, k_bias=, v_scale=, v_bias=), or bits="fp8" with k_scale, v_scale) are dequantized first.
    contiguous: key j of sequence b is at slot_table[b, 0] + j. resid: mixed widths' residuals (`add_residuals`).
    layer: every KV head folds in the probabilities summed over the layer's heads (granularity "layer", whose
    heads hold the same token in the same slot). count [B, max_len, Hkv]: the tokens each key stands for, whose log
    its logits gain (merged keys). Returns out [B, Hq, D] in q's dtype."""
    idx = contiguous_slots(slot_table, ctx_lens).long() if contiguous else slot_table.long()
    if quant is None:
        k, v = k_pool[idx], v_pool[idx]  # [B, M, Hkv, D]
    elif quant["bits"] == "fp8":  # float8 codes times a scale per token and head
        k, v = ((pool[idx].float() * quant[f"{side}_scale"][idx].float()).to(q.dtype)
                for pool, side in ((k_pool, "k"), (v_pool, "v")))
    else:
        from .packing import dequantize
        bits, group = quant["bits"], quant["group"]
        k = dequantize(k_pool[idx], quant["k_scale"][idx], quant["k_bias"][idx], bits, group)
        v = dequantize(v_pool[idx], quant["v_scale"][idx], quant["v_bias"][idx], bits, group)
        if resid is not None:
            k, v = add_residuals(k, v, resid, group)
    out, step = decode_with_scores(q, k, v, ctx_lens, score_mode, None if count is None else count.log())
    if step is not None:
        step = layer_sum(step) if layer else step
        valid = torch.arange(idx.shape[1], device=q.device)[None, :, None] < ctx_lens.to(q.device)[:, None, None]
        score.copy_(torch.where(valid, fold_scores(score, step, score_mode, ema_decay), score))
    return out
