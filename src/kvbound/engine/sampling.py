"""Sampling parameters of a request, and choosing every row's next token at once.

`sample_batch` processes all rows of a step together on the logits' device (penalties, min_tokens, temperature,
top-k, top-p, min-p) and moves the chosen tokens to the host in one transfer. Truncated rows sort only their most
likely candidates (a full sort of a 150k vocabulary cost a fifth of a decode step). A seeded request draws its
uniform from (seed, step) alone (a counter-based hash), so it gets the same tokens alone or in any batch, on
any device.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from ..errors import KvboundError
from ..staging import to_device

MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """vLLM's and OpenAI's fields. top_k 0 or -1: off; min_p 0: off; repetition_penalty 1: off."""
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens are not sampled before this many tokens
    stop_token_ids: tuple = field(default_factory=tuple)
    stop: tuple = field(default_factory=tuple)  # strings; the output text ends before the first one (engine)
    logprobs: int | None = None  # return the chosen token's log-probability and this many top alternatives
    n: int = 1  # completions per prompt (the engine forks them after the prompt, sharing its blocks)
    teacher_tokens: tuple = ()  # fed in this order instead of sampled: scores a given continuation (perplexity)

    def __post_init__(self):
        def bad(name, why):
            raise KvboundError(f"{name} must be {why}, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not isinstance(getattr(self, name), numbers.Real) or isinstance(getattr(self, name), bool):
                bad(name, "a number")
        if self.seed is not None and not isinstance(self.seed, numbers.Integral):
            bad("seed", "an integer or None")
        for name in ("n", "max_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "a positive integer")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "an integer >= 1, or 0 / -1 for off")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", "a finite number > 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20]")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a string or a list of non-empty strings")
        for name in ("stop_token_ids", "teacher_tokens"):
            ids = getattr(self, name)
            if isinstance(ids, torch.Tensor):
                ids = ids.tolist()
                setattr(self, name, ids)
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) for t in ids):
                bad(name, "a list of integer token ids")
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(int(t) for t in self.stop_token_ids)
        self.teacher_tokens = tuple(int(t) for t in self.teacher_tokens)
        if len(self.teacher_tokens) > self.max_tokens:
            bad("teacher_tokens", f"at most max_tokens={self.max_tokens} tokens")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (seed, step) alone (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((x ^ (x >> 31)) >> 11) / 2.0 ** 53


def _penalize(x, rows, params, prompts, outputs):
    """Presence, frequency and repetition penalties of `rows`, on x [B, V] in place."""
    dev, vocab = x.device, x.shape[1]
    counts = torch.zeros(len(rows), vocab, device=dev)
    in_prompt = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
    for j, i in enumerate(rows):
        if outputs[i]:
            counts[j].index_add_(0, torch.tensor(outputs[i], device=dev), torch.ones(len(outputs[i]), device=dev))
        if prompts[i]:
            in_prompt[j, torch.tensor(prompts[i], device=dev)] = True
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    r = torch.tensor(rows, device=dev)
    y = x[r]
    y = torch.where(in_prompt | (counts > 0), torch.where(y > 0, y / rep, y * rep), y)
    x[r] = y - pres * (counts > 0) - freq * counts


CANDIDATES = 1024  # truncated rows look for their kept tokens among this many most likely ones first


def _truncated(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _inverse_cdf(probs, keep, u):
    """Index into each row's candidates where the kept mass, in candidate order, first exceeds u * total."""
    cdf = (probs * keep).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[1] - 1)[:, 0]


def _kept(sorted_p, top_k, top_p, min_p):
    """Which of each row's candidates (probabilities in falling order) top-k, top-p and min-p keep ([B, 1] rule
    tensors, top_k 0 for off), and whether the candidates were enough: the first token left out is excluded
    by one of the rules."""
    n = sorted_p.shape[1]
    rank = torch.arange(n, device=sorted_p.device)[None, :]
    mass = sorted_p.cumsum(-1)
    keep = ((top_k <= 0) | (rank < top_k)) & (mass - sorted_p < top_p) & (sorted_p >= min_p * sorted_p[:, :1])
    enough = (top_k > 0) & (top_k <= n) | (mass[:, -1:] >= top_p) | (sorted_p[:, -1:] < min_p * sorted_p[:, :1])
    return keep, enough[:, 0]


def _draw(x, ps: list[SamplingParams], seeded: list[float | None]):
    """One token per row of logits x [B, V] under temperature, top-k, top-p and min-p: (tokens, check). Rows
    without truncation draw from the whole vocabulary in token order (no sort); truncated rows sort only their
    CANDIDATES most likely tokens. check(dst, dst_rows) (None when the candidates always suffice) finds on the
    host whether they held what the rules keep, and redraws the rows where they did not from the whole sorted
    vocabulary into dst[dst_rows[row]]: the one host sync, left to whoever reads the tokens. A row's uniform is
    seeded[i], or a fresh one. The rows' parameters reach the device through pinned memory (a copy from
    pageable memory would wait for the GPU)."""
    dev, vocab = x.device, x.shape[1]
    rules = to_device([[p.temperature, p.top_k, p.top_p, p.min_p, -1.0 if v is None else v]
                       for p, v in zip(ps, seeded)], dev, torch.float64)
    temp, top_k, top_p, min_p, fixed = (c[:, None] for c in rules.T)
    u = torch.where(fixed[:, 0] >= 0, fixed[:, 0], torch.rand(len(ps), device=dev, dtype=torch.float64)).float()
    probs = torch.softmax(x / temp.float(), -1)
    cut = [_truncated(p) for p in ps]
    if not any(cut):
        return _inverse_cdf(probs, 1.0, u), None
    out = torch.empty(len(ps), dtype=torch.long, device=dev)
    if not all(cut):
        plain = to_device([j for j, c in enumerate(cut) if not c], dev)
        out[plain] = _inverse_cdf(probs[plain], 1.0, u[plain])
    rows = slice(None) if all(cut) else to_device([j for j, c in enumerate(cut) if c], dev)
    rule = [r[rows].float() for r in (top_k, top_p, min_p)]
    sorted_p, idx = probs[rows].topk(min(vocab, CANDIDATES), -1)
    keep, enough = _kept(sorted_p, *rule)
    out[rows] = idx.gather(1, _inverse_cdf(sorted_p, keep, u[rows])[:, None])[:, 0]
    if sorted_p.shape[1] >= vocab:
        return out, None

    def check(dst, dst_rows) -> bool:
        if bool(enough.all()):
            return False
        short = (~enough).nonzero()[:, 0]
        sorted_p, idx = probs[rows][short].sort(-1, descending=True)
        keep, _ = _kept(sorted_p, *(r[short] for r in rule))
        dst[dst_rows[torch.arange(len(ps), device=dev)[rows][short]]] = idx.gather(
            1, _inverse_cdf(sorted_p, keep, u[rows][short])[:, None])[:, 0]
        return True
    return out, check


class Draw:
    """A step's tokens, on the device. `settle()` runs the draw's host check, if it has one (see `_draw`): call
    it before the tokens are read or fed, as late as can be, so the host need not wait for the GPU sooner."""

    def __init__(self, tokens: torch.Tensor, check=None):
        self.tokens, self.check = tokens, check
        self.redrawn = False  # settling drew some tokens again

    def settle(self):
        check, self.check = self.check, None
        if check is not None and check():
            self.redrawn = True


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                 outputs: list[list[int]], seeds: list[int | None], eos_ids=()) -> list[tuple[int, dict | None]]:
    """Row i's next token under params[i], having generated outputs[i] after prompts[i]; seeds[i] makes its draw
    reproducible. Returns (token, logprobs) per row: logprobs is None, or {"logprob": the chosen token's, "top":
    [(token, logprob), ...]} of the model's own distribution (log_softmax of the logits, before processing).
    A row with teacher_tokens left takes the next of them instead of a draw (its logprob is that token's)."""
    draw = next_tokens(logits, params, prompts, outputs, seeds, eos_ids)
    draw.settle()
    return with_logprobs(logits, draw.tokens, params, draw.tokens.tolist())  # the step's one transfer to the host


def next_tokens(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                outputs: list[list[int]], seeds: list[int | None], eos_ids=()) -> Draw:
    """`sample_batch`'s tokens, left on the logits' device: no host sync for any row without penalties or
    min_tokens until the Draw is settled."""
    bsz, vocab = logits.shape
    x = logits.float()
    pen = [i for i, p in enumerate(params) if p.penalized]
    banned_rows = [(i, p) for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens]
    if pen or banned_rows:
        x = x.clone()
    if pen:
        _penalize(x, pen, params, prompts, outputs)
    for i, p in banned_rows:
        banned = [t for t in (*(() if p.ignore_eos else eos_ids), *p.stop_token_ids) if 0 <= t < vocab]
        if banned:
            x[i, banned] = float("-inf")
    tokens = x.argmax(-1)
    forced = [(i, p.teacher_tokens[len(outputs[i])]) for i, p in enumerate(params)
              if len(outputs[i]) < len(p.teacher_tokens)]
    taught = {i for i, _ in forced}
    sampled = [i for i, p in enumerate(params) if p.temperature > 0 and i not in taught]
    check = None
    if sampled:
        u = [seeded_uniform(seeds[i], len(outputs[i])) if seeds[i] is not None else None for i in sampled]
        drawn, drawn_check = _draw(x if len(sampled) == bsz else x[sampled], [params[i] for i in sampled], u)
        at = torch.arange(bsz, device=x.device) if len(sampled) == bsz else to_device(sampled, x.device)
        tokens = drawn if len(sampled) == bsz else tokens.index_put_((at,), drawn)
        if drawn_check is not None:
            check = lambda: drawn_check(tokens, at)  # noqa: E731
    if forced:
        tokens[to_device([i for i, _ in forced], tokens.device)] = to_device([t for _, t in forced], tokens.device)
    return Draw(tokens, check)


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
                  chosen: list[int]) -> list[tuple[int, dict | None]]:
    """(token, logprobs) per row, `chosen` being `tokens` on the host."""
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return [(t, None) for t in chosen]
    lp = torch.log_softmax(logits.float(), -1)
    k = max(w or 0 for w in want)
    top_v, top_i = lp.topk(k, -1) if k else (lp[:, :0], lp[:, :0].long())
    mine = lp.gather(1, tokens[:, None])[:, 0].tolist()
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [(t, None if w is None else {"logprob": mine[i], "top": list(zip(top_i[i][:w], top_v[i][:w]))})
            for i, (t, w) in enumerate(zip(chosen, want))]
