"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in one file.

The model never owns KV memory. Each attention layer hands its rotated K/V to a cache object's
`attend(layer, q, k, v, positions)`, which stores them in its slots (and may evict). Positions are
passed in explicitly: a position is the number of tokens processed before that token, so RoPE
stays right after eviction shrinks the cache.
Parameter names follow Hugging Face's, so a HF state dict loads as is.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
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
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, positions, cache):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cache.attend(self.layer, q, k, v, positions)
        return self.o_proj(out.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


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
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, logits_at=None):
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

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
