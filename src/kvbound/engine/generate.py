"""One sequence with a cache of its own: chunked prefill, then decode with greedy or temperature/top-p
sampling. The reference the batched engine is tested against, and the path of quantized KV caches."""
from __future__ import annotations

from typing import Iterator

import torch

from ..cache import KVCache
from ..cache.reconstruct import ReadingBatch, ReconstructionPass, next_piece
from ..errors import KvboundError
from .sampling import SamplingParams, sample_batch


def piece_end(start: int, length: int, chunk: int, question_start: int | None = None) -> int:
    """Where the prefill piece from `start` ends: the next multiple of `chunk`, the prompt's end, or where the
    question starts (the context's evictions then never see it, as kvpress compresses a context), the first."""
    end = min(length, (start // chunk + 1) * chunk)
    return end if question_start is None or start >= question_start else min(end, question_start)


def check_question_start(question_start: int | None, length: int):
    if question_start is not None and not 0 < question_start < length:
        raise KvboundError(f"question_start must be in [1, {length}) for a prompt of {length} tokens, "
                           f"got {question_start}")


def prefill(model, cache: KVCache, ids: list[int] | torch.Tensor, chunk: int = 512,
            question_start: int | None = None) -> torch.Tensor:
    """Feed `ids` in pieces of `chunk` tokens, the question (from `question_start`) starting a piece of its
    own (a bounded cache evicts between pieces); returns the last logits. A policy that scores its prompt at once
    (KVzip) first takes the context before the question, or the whole prompt, through `scored_prefill`."""
    if chunk < 1:
        raise KvboundError(f"prefill chunk must be >= 1, got {chunk}")
    check_question_start(question_start, len(ids))
    ids = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    logits, start = None, 0
    if cache.policy.reconstructs and not cache.prompt_scored:  # KVzip: the context is scored at once
        start = question_start or len(ids)
        logits = scored_prefill(model, cache, ids[:start], chunk)
    while start < len(ids):
        part = ids[start:piece_end(start, len(ids), chunk, question_start)]
        logits = model(part, cache.next_positions(len(part)), cache, logits_at=-1)[0]
        cache.advance(len(part))
        start += len(part)
    return logits


def scored_prefill(model, cache: KVCache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """KVzip's prefill (`policies.KVzipPolicy`): `ids` go into a full cache of their own, are read again after
    themselves in pieces of `chunk` tokens, each attending over them and itself (`cache.reconstruct`), and `cache`
    keeps each head's choice by the most attention each token drew. A prompt within the cache's room is written
    as it is. Returns the last logits, the full cache's."""
    if len(ids) < cache.capacity:
        cache.prompt_scored = True
        return prefill(model, cache, ids, chunk)
    held = KVCache(model.config, None, device=cache.device, dtype=next(model.parameters()).dtype)
    logits = prefill(model, held, ids, chunk)
    cache.keep_scored(held, read_again(model, held, ids, chunk, cache.policy))
    held.release()
    return logits


def read_again(model, held, ids: torch.Tensor, chunk: int, policy) -> torch.Tensor:
    """KVzip's second reading of the n tokens `ids` that the unbounded cache `held` holds, whole (`SecondReading`).
    Returns each held token's score [layers, n, H]."""
    reading = SecondReading(held, ids, chunk, policy)
    while not reading.done:
        read_pieces(model, [reading])
    return reading.best


class SecondReading:
    """KVzip's second reading, a piece at a time: the n tokens `ids` that the unbounded cache `held` holds, fed again
    in pieces of `chunk` tokens, each right after them (attending over them and itself) and writing nothing. `best`
    [layers, n, H]: each held token's score, the most attention any query of the reading gave it
    (`cache.reconstruct`), each block of `policy.chunk` tokens scored by its own pieces, which never cross it. The
    engine reads a piece a step (`LLMEngine._read_on`), as it prefills; `read_pieces` reads the next piece of
    several at once."""

    def __init__(self, held, ids: torch.Tensor, chunk: int, policy):
        self.ids, self.chunk, self.block, self.at = ids, chunk, policy.chunk, 0
        self.pass_ = ReconstructionPass(held, policy.sink)

    @property
    def done(self) -> bool:
        return self.at >= len(self.ids)

    @property
    def best(self) -> torch.Tensor:
        return self.pass_.best

    @property
    def piece(self) -> int:
        """Tokens the next piece reads: up to `chunk`, within its block."""
        return next_piece(self.at, self.chunk, len(self.ids), self.block)[0]

    def score_span(self):
        """The next piece scores its block of the context (`ReconstructionPass.span`)."""
        self.pass_.span = next_piece(self.at, self.chunk, len(self.ids), self.block)[1]


def read_pieces(model, readings: list[SecondReading]):
    """One forward reads the next piece of each of `readings`, each right after its own context (positions n on)
    and over it alone (`cache.reconstruct.ReadingBatch`): the engine reads every second reading under way at once."""
    parts = [r.ids[r.at:r.at + r.piece] for r in readings]
    for r in readings:
        r.score_span()
    ids = torch.cat(parts)
    positions = torch.cat([torch.arange(len(r.ids), len(r.ids) + len(p), device=ids.device)
                           for r, p in zip(readings, parts)])
    model(ids, positions, ReadingBatch([r.pass_ for r in readings], [len(p) for p in parts]), logits_at=-1)
    for r, p in zip(readings, parts):
        r.at += len(p)


def generate_ids(model, prompt_ids: list[int], params: SamplingParams, cache: KVCache,
                 eos_ids=(), prefill_chunk: int = 512, question_start: int | None = None) -> Iterator[int]:
    """Yields generated token ids one by one, stopping at EOS (not yielded) or max_tokens. question_start: as
    `prefill`'s."""
    if not prompt_ids:
        raise KvboundError("the prompt is empty")
    if cache.rotate_keys is None:
        model.config.check_length(cache.seen + len(prompt_ids), params.max_tokens)
    elif cache.capacity + min(prefill_chunk, len(prompt_ids)) > model.config.max_position_embeddings:
        raise KvboundError(f"re-indexed positions reach {cache.capacity + min(prefill_chunk, len(prompt_ids)):,}: "
                           f"the cache's {cache.capacity:,} slots plus a prefill chunk of "
                           f"{min(prefill_chunk, len(prompt_ids)):,} pass the model's context of "
                           f"{model.config.max_position_embeddings:,}; lower the budget or --prefill-chunk")
    logits = prefill(model, cache, prompt_ids, prefill_chunk, question_start)
    out: list[int] = []
    for i in range(params.max_tokens):
        (tok, _), = sample_batch(logits[None], [params], [list(prompt_ids)], [out], [params.seed], eos_ids)
        if (tok in eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            return
        out.append(tok)
        yield tok
        if i + 1 == params.max_tokens:
            return
        x = torch.tensor([tok], device=cache.device)
        logits = model(x, cache.next_positions(1), cache)[0]
        cache.advance(1)
