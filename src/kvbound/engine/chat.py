"""Conversations: the model's chat template, the system prompt pinned under bounded policies, and a session
that keeps one KV cache between turns, so each turn feeds only its new text."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterator

from ..cache import sequence_cache
from .generate import generate_ids
from .sampling import SamplingParams


def with_pinned_system(policy, tokenizer, messages: list[dict]):
    """`policy` with the tokens of the conversation's leading system messages pinned (never evicted), where
    the policy is bounded: instructions and safety text must not be lost to eviction."""
    system = [m for m in messages[:1] if m.get("role") == "system"]
    if policy is None or not policy.bounded or not system:
        return policy
    head = tokenizer.encode(tokenizer.apply_chat_template(system, add_generation_prompt=False))
    full = tokenizer.encode(tokenizer.apply_chat_template(messages))
    n = len(os.path.commonprefix([head, full]))  # the system block as the whole prompt tokenizes it
    return replace(policy, pinned=policy.pinned + ((0, n),)) if n else policy


class ChatSession:
    """One conversation with a cache of its own: `send(text)` yields the reply's text pieces as they come."""

    def __init__(self, model, tokenizer, policy=None, system: str | None = None, params: SamplingParams | None = None,
                 prefill_chunk: int = 512, pin_system_prompt: bool = True, **cache_args):
        """cache_args: KVCache's device, dtype, kv_bits, kv_group_size, quantized_kv_start."""
        self.model, self.tokenizer = model, tokenizer
        self.params = params or SamplingParams(max_tokens=256)
        self.messages = [{"role": "system", "content": system}] if system else []
        if pin_system_prompt and self.messages:
            policy = with_pinned_system(policy, tokenizer, self.messages + [{"role": "user", "content": ""}])
        self.cache = sequence_cache(model.config, policy, **cache_args)
        self.chunk = prefill_chunk
        self.seen_text = ""  # the rendered conversation the cache holds, the last reply included

    def send(self, text: str) -> Iterator[str]:
        from ..models.tokenizer import StreamDecoder
        self.messages.append({"role": "user", "content": text})
        rendered = self.tokenizer.apply_chat_template(self.messages)
        # the template renders earlier turns as the cache saw them; where it does not quite (a reply it trims),
        # feed from where the texts part
        new_text = rendered[len(os.path.commonprefix([rendered, self.seen_text])):]
        ids = self.tokenizer.encode(new_text, add_bos=None if self.cache.seen == 0 else False)
        stream, reply = StreamDecoder(self.tokenizer), []
        for tok in generate_ids(self.model, ids, self.params, self.cache, self.tokenizer.eos_ids, self.chunk):
            reply.append(tok)
            yield stream.push(tok)
        answer = self.tokenizer.decode(reply)
        self.messages.append({"role": "assistant", "content": answer})
        # a reply cut by max_tokens ends with a token sampled but not yet fed; one ended by EOS was all fed
        fed = reply[:-1] if len(reply) == self.params.max_tokens else reply
        self.seen_text = rendered + self.tokenizer.decode(fed)
