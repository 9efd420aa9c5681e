"""`LLM`: the convenience front of the engine (vLLM's shape): `LLM(model=...).generate(prompts,
SamplingParams(...))` returns results in input order; `stream` yields one completion's tokens as they come."""
from __future__ import annotations

from typing import Iterator

import torch
from tqdm import tqdm

from ..errors import KvboundError
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams


class LLM:
    """`LLM(model=PATH or None, **engine_args).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model=None, device: str = "cpu", dtype=torch.float32, **engine_args):
        from ..models import load
        if isinstance(model, torch.nn.Module):
            self.model, tokenizer = model, engine_args.pop("tokenizer", None)
        else:
            self.model, tokenizer = load(model, device=device, dtype=dtype)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.model, tokenizer, **engine_args)

    def close(self):
        """Free the engine's pool, metadata and graphs now (also on leaving a `with LLM(...) as llm:` block)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts, params: SamplingParams | list | None = None, policies=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, token ids, or a list of either. params / policies: one for all or one per
        prompt. Returns one RequestOutput per prompt, in input order."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, token ids or a dict (`LLMEngine.add_request`)
        n = len(prompts)
        params = params if isinstance(params, list) else [params] * n
        policies = policies if isinstance(policies, list) else [policies] * n
        if len(params) != n or len(policies) != n:
            raise KvboundError(f"got {n} prompts but {len(params)} sampling params and {len(policies)} policies")
        ids = []
        try:
            for p, sp, pol in zip(prompts, params, policies):
                ids.append(self.engine.add_request(p, sp, pol))
        except BaseException:  # a bad prompt refuses the call whole: those queued before it do not run later
            for i in ids:
                self.engine.abort(i)
            raise
        results = {}
        bar = tqdm(total=n, desc="generate", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step(only_finished=True):
                results[out.request_id] = out
                bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def chat(self, messages, params: SamplingParams | list | None = None, policies=None, use_tqdm: bool = True,
             pin_system_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role": ..., "content": ...}) or a list of them, each rendered
        with the model's chat template and generated as `generate` does. Under a bounded policy a leading
        system message's tokens are pinned (never evicted) unless pin_system_prompt=False."""
        from .chat import with_pinned_system
        if self.tokenizer is None:
            raise KvboundError("chat needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        policies = policies if isinstance(policies, list) else [policies] * len(convs)
        if len(policies) != len(convs):
            raise KvboundError(f"got {len(convs)} conversations but {len(policies)} policies")
        prompts = [self.tokenizer.apply_chat_template(c) for c in convs]
        policies = [with_pinned_system(p or self.engine.default_policy, self.tokenizer, c) if pin_system_prompt else p
                    for p, c in zip(policies, convs)]
        return self.generate(prompts, params, policies, use_tqdm)

    def stream_text(self, prompt, params: SamplingParams | None = None, policy=None) -> Iterator[str]:
        """`stream`, as text pieces (a piece waits for the bytes that complete a character)."""
        from ..models.tokenizer import StreamDecoder
        if self.tokenizer is None:
            raise KvboundError("stream_text needs a tokenizer")
        decoder = StreamDecoder(self.tokenizer)
        for tok in self.stream(prompt, params, policy):
            piece = decoder.push(tok)
            if piece:
                yield piece

    def stream(self, prompt, params: SamplingParams | None = None, policy=None) -> Iterator[int]:
        """Token ids of one completion as they are generated. Requests added to `self.engine` by hand keep
        running meanwhile; their outputs are not collected here."""
        return self.engine.stream(self.engine.add_request(prompt, params, policy))
