"""Building OpenAI response bodies from the engine's updates: one accumulator per completion, shared by the
streaming and the whole-response paths, so that both give the same text."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..models.tokenizer import StreamDecoder


@dataclass
class Choice:
    """One completion as it accumulates. Streamed text holds back what could still turn out to be the start
    of a stop string; once finished, the text is the engine's (cut before the stop string)."""
    index: int
    decoder: StreamDecoder | None  # None: not streamed, the text comes whole at the end
    holdback: int  # the longest stop string's length - 1
    prefix: str = ""  # echoed prompt text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    decoded: str = ""  # text decoded so far
    sent: int = 0  # characters of `decoded` (or of the final text) already streamed
    final: str | None = None
    finish_reason: str | None = None
    tokens_evicted: int = 0
    peak_kv_bytes: int = 0

    def take(self, delta) -> str:
        """Fold in one CompletionDelta; returns the text that may be streamed now."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if self.decoder is not None and delta.token_ids:
            self.decoded += self.decoder.push(*delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.final = delta.text if delta.text is not None else self.decoded
            self.tokens_evicted, self.peak_kv_bytes = delta.tokens_evicted, delta.peak_kv_bytes
            out, self.sent = self.final[self.sent:], len(self.final)
            return out
        upto = max(self.sent, len(self.decoded) - self.holdback)
        out, self.sent = self.decoded[self.sent:upto], upto
        return out

    @property
    def text(self) -> str:
        return self.prefix + (self.final if self.final is not None else self.decoded)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special=False)


def completion_logprobs(tokenizer, entries: list[dict], tokens: list[int], offset: int = 0) -> dict:
    """The legacy completions `logprobs` object of these tokens."""
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets, at = [], offset
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[dict], tokens: list[int]) -> dict:
    """The chat `logprobs` object ({"content": [...]}) of these tokens."""
    def item(t, lp):
        s = token_text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**item(t, e["logprob"]), "top_logprobs": [item(a, lp) for a, lp in e["top"]]}
                        for t, e in zip(tokens, entries)]}


def usage(prompt_lens: list[int], choices: list[Choice], cached: int) -> dict:
    done = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": sum(prompt_lens), "completion_tokens": done, "total_tokens": sum(prompt_lens) + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kv_report(policy, choices: list[Choice]) -> dict:
    """kvbound's extension: the policy, its pinned token spans (a chat's system prompt included), and the tokens
    evicted and peak KV bytes of the request's completions together."""
    return {"policy": policy.describe(), "pinned": [list(span) for span in getattr(policy, "pinned", ())],
            "tokens_evicted": sum(c.tokens_evicted for c in choices),
            "peak_kv_bytes": sum(c.peak_kv_bytes for c in choices)}
