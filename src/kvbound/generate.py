"""Single-sequence generation: chunked prefill, then decode with greedy or temperature/top-p sampling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .cache import KVCache
from .config import KvboundError


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
        if self.temperature < 0:
            raise KvboundError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvboundError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float. Greedy at temperature 0; else nucleus sampling over the top-p mass."""
    if p.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / p.temperature, -1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_p[drop] = 0
        return int(idx[torch.multinomial(sorted_p, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


def prefill(model, cache: KVCache, ids: list[int] | torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Feed `ids` in chunks of `chunk` tokens (a bounded cache evicts between chunks); returns last logits."""
    if chunk < 1:
        raise KvboundError(f"prefill chunk must be >= 1, got {chunk}")
    ids = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    logits = None
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        logits = model(part, cache.next_positions(len(part)), cache, logits_at=-1)[0]
        cache.advance(len(part))
    return logits


def generate_ids(model, prompt_ids: list[int], params: SamplingParams, cache: KVCache,
                 eos_ids=(), prefill_chunk: int = 512) -> Iterator[int]:
    """Yields generated token ids one by one, stopping at EOS (not yielded) or max_tokens."""
    if not prompt_ids:
        raise KvboundError("the prompt is empty")
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    logits = prefill(model, cache, prompt_ids, prefill_chunk)
    for i in range(params.max_tokens):
        tok = sample(logits, params, gen)
        if tok in eos_ids and not params.ignore_eos:
            return
        yield tok
        if i + 1 == params.max_tokens:
            return
        x = torch.tensor([tok], device=cache.device)
        logits = model(x, cache.next_positions(1), cache)[0]
        cache.advance(1)
