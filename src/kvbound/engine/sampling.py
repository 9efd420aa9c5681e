"""Sampling parameters of a request, and choosing the next token from logits."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import KvboundError


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1  # completions per prompt (the engine forks them after the prompt, sharing its blocks)

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise KvboundError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KvboundError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise KvboundError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvboundError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float. Greedy at temperature 0; else nucleus sampling over the top-p mass."""
    if p.temperature == 0:
        return int(logits.argmax())
    if generator is not None:  # a seeded draw happens where its generator lives (CPU), whatever the logits' device
        logits = logits.to(generator.device)
    probs = torch.softmax(logits.float() / p.temperature, -1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_p[drop] = 0
        return int(idx[torch.multinomial(sorted_p, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
