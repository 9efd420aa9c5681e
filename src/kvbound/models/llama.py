"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in one file.

The model never owns KV memory. Each attention layer hands its rotated K/V to a cache object's
`attend(layer, q, k, v, positions)`, which stores them in its slots (and may evict). Positions are
passed in explicitly: a position is the number of tokens processed before that token, so RoPE
stays right after eviction shrinks the cache.
Parameter names follow Hugging Face's, except the fused qkv_proj and gate_up_proj (see `fuse_hf_names`).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from .config import ModelConfig


class LayerAttention(Protocol):
    """What the model's attention layers call: the cache (or a batch of caches) stores the new tokens' rotated
    K/V, attends the queries over what it holds plus them, and returns out [T, Hq, D]."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32 or x.is_cuda:  # one fused op (fp32 accumulation, as below)
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.float()
    if rs["rope_type"] == "linear":
        return (inv_freq / rs["factor"]).float()
    # llama3: long wavelengths are divided by `factor`, short ones kept, smooth blend in between
    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2]. Rotate-half convention (HF's)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v projections in one matmul (the loader concatenates HF's q_proj/k_proj/v_proj)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, positions, cache):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if x.is_cuda:  # normalize (Qwen3) and rotate q and k in place inside the projection's output: one kernel
            from ..kernels.triton_decode import rope_inplace
            heads = qkv.view(t, -1, self.d)
            norm = (self.q_norm.weight, self.k_norm.weight, self.h, self.q_norm.eps) if self.qk_norm else None
            rope_inplace(heads, cos, sin, self.h + self.hkv, norm)
            q, k, v = heads.split([self.h, self.hkv, self.hkv], 1)
        else:
            q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
            q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            qk = apply_rope(torch.cat([q, k], 1), cos, sin)  # one rotation for q and k heads
            q, k = qk[:, :self.h], qk[:, self.h:]
        out = cache.attend(self.layer, q, k, v, positions)
        return self.o_proj(out.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused, like qkv
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if x.is_cuda:  # one kernel for silu(gate) * up
            from ..kernels.triton_decode import silu_mul
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: LayerAttention, logits_at=None):
        """input_ids, positions: [T] (a flat run of tokens). Returns float logits [T, vocab], or only at the
        token indices `logits_at` (e.g. -1 for the last token, or each sequence's last token in a batch)."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, cache)
        if logits_at is not None:
            x = x[logits_at].reshape(-1, x.shape[-1])
        return self.lm_head(self.model.norm(x)).float()

    def rerotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys k [N, D] rotated by RoPE at position p, rotated on to p + delta[i] (RoPE angles add up): how a
        cache that re-indexes positions (`KVCache(rotate_keys=...)`) moves its keys."""
        freqs = delta.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        return apply_rope(k[:, None], freqs.cos(), freqs.sin())[:, 0]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_hf_names(tensors: dict) -> dict:
    """Concatenate HF's separate q/k/v (and gate/up) tensors into this model's fused ones, in place."""
    for key in [k for k in tensors if ".q_proj." in k or ".gate_proj." in k]:
        for fused, parts in FUSED.items():
            if f".{parts[0]}." in key:
                names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in tensors for n in names):
                    tensors[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([tensors.pop(n) for n in names])
    return tensors
