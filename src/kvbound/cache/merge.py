"""Merging evicted tokens into kept ones instead of dropping them (a policy's `merge`; issue #18).

An evicted token's key and value are averaged into the kept key of its KV head most like it (cosine similarity;
never a sink or pinned token, which stay as they came), weighted by each one's rank (`merge="rank"`) or by the tokens
each already stands for (`"count"`). The kept key then stands for both: its count grows by the victim's, and
attention adds log(count) to its logit, so it draws the attention that its tokens would draw apart
(`attention_bias`). On SmolLM2 at 2,048 tokens and budget 256 it keeps 0.34-0.41x of the window's perplexity loss,
against 0.50-0.58x for observed-attention eviction alone (RESULTS.md, "Perplexity over length").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import KvboundError

SIMILARITIES = 1 << 24  # (evicted, kept) similarities computed at once: a long piece's scratch stays at 64 MiB


def attention_bias(count: torch.Tensor | None) -> torch.Tensor | None:
    """The logit each held token gets from the tokens it stands for: log(count) (None without merging)."""
    return None if count is None else count.log()


def merge_mode(policy) -> str | None:
    """What a token weighs in a merge, as the merge kernel names it: "count", or the policy's rank source."""
    if not policy.merge:
        return None
    return "count" if policy.merge == "count" else policy.rank_source


def merge_weight(policy, pos: torch.Tensor, score: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """Each token's weight in an average, [..., M, H]: its rank (kept positive) or its count."""
    if policy.merge == "rank":
        return policy.rank(pos, score).float() + 1e-6
    return count


def _most_similar(unit, dropped, target_ok):
    """Each of `dropped` [B, N, H]'s highest cosine similarity among the candidates `target_ok` allows, and which."""
    at = dropped[..., None].expand(-1, -1, -1, unit.shape[-1])
    sim = torch.einsum("bnhd,bmhd->bnmh", unit.gather(1, at), unit)
    return sim.masked_fill_(~target_ok[:, None], float("-inf")).max(2)


def merge_into_kept(k, v, count, weight, dropped, target_ok):
    """Merge the tokens at indices `dropped` [B, N, H] (each head's N evicted ones) of candidates k, v [B, M, H, D]
    (as attention reads them) into the most similar candidate that `target_ok` [B, M, H] allows; a token with none
    allowed is dropped. count, weight [B, M, H]. Returns k, v and count after the merge, each evicted token's target
    [B, N, H] (meaningful where `merged` [B, N, H]), and which candidates took a token, `took` [B, M, H]."""
    def at(x, idx):  # idx [B, N, H] as indices into x's tokens, for every channel of x
        return idx[..., None].expand(-1, -1, -1, x.shape[-1])
    unit = F.normalize(k.float(), dim=-1)
    step = max(1, SIMILARITIES // target_ok.numel())
    blocks = [_most_similar(unit, dropped[:, i:i + step], target_ok) for i in range(0, max(dropped.shape[1], 1), step)]
    best, target = (torch.cat(x, 1) for x in zip(*blocks))
    merged = best > float("-inf")
    w_drop = torch.where(merged, weight.gather(1, dropped), 0.0)
    den = weight.float().scatter_add(1, target, w_drop)
    took = torch.zeros_like(count).scatter_add(1, target, merged.to(count.dtype)) > 0

    def mix(x):  # K or V (their widths may differ: MLA's)
        num = (x.float() * weight[..., None]).scatter_add(1, at(x, target), x.gather(1, at(x, dropped)).float()
                                                          * w_drop[..., None])
        return torch.where(took[..., None], (num / den[..., None]).to(x.dtype), x)
    count = count.scatter_add(1, target, torch.where(merged, count.gather(1, dropped), 0.0))
    return mix(k), mix(v), count, target, merged, took
