"""Attention kernels: the PyTorch reference (CPU path and test oracle) and the Triton kernels (CUDA).

`decode_attention` is the one dispatch point for paged decode attention: the Triton kernel on CUDA, the
reference elsewhere. Triton is imported only on CUDA, so CPU users need not install it.
"""
from __future__ import annotations

from .reference import (SCORE_MODES, causal_attention, causal_attention_batch, contiguous_slots, decode_with_scores,
                        flash_ok, fold_scores, fused_sdpa, layer_sum, paged_decode_attention, varlen_attention_lse,
                        varlen_causal_attention)


def decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, **kw):
    """Paged decode attention with optional score export (arguments of `triton_decode.decode_attention`)."""
    if q.is_cuda:
        from . import triton_decode
        return triton_decode.decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, **kw)
    return paged_decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, **kw)


__all__ = ["SCORE_MODES", "causal_attention", "causal_attention_batch", "contiguous_slots", "decode_attention",
           "decode_with_scores", "flash_ok", "fold_scores", "fused_sdpa", "layer_sum", "paged_decode_attention",
           "varlen_attention_lse", "varlen_causal_attention"]
