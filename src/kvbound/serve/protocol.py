"""The OpenAI request bodies the server accepts (completions, chat), with vLLM's extra sampling fields and
kvbound's own (`kv_policy`, `kv_budget`, `pin`, `pin_system_prompt`), and turning one into the engine's
SamplingParams. Unknown fields are ignored, as OpenAI does; fields we cannot honour are refused by name."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..engine import SamplingParams
from ..errors import KvboundError


class BadField(KvboundError):
    """A request field we refuse (400), named so that the error object can point at it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestBase(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # kvbound's extensions (the openai client sends them through extra_body)
    kv_policy: str | None = None
    kv_budget: int | None = Field(None, ge=1)
    pin: list[tuple[StrictInt, StrictInt]] | None = None

    def refuse_unsupported(self):
        if self.logit_bias:
            raise BadField("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options needs stream=true")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, seed=self.seed, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                stop=tuple([self.stop] if isinstance(self.stop, str) else (self.stop or ())),
                logprobs=logprobs, n=self.n)
        except KvboundError as e:  # SamplingParams names the field first
            raise BadField(str(e).split(" ", 1)[0], str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(RequestBase):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self):
        super().refuse_unsupported()
        if self.suffix:
            raise BadField("suffix", "suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise BadField("best_of", f"best_of must equal n ({self.n}) when given, got {self.best_of}")
        if self.echo and self.logprobs is not None:
            raise BadField("echo", "echo with logprobs would need the prompt's logprobs, which are not computed")

    def prompts(self) -> list:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p or any(len(x) == 0 for x in p):
            raise BadField("prompt", "prompt must not be empty")
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text or ""}


class ChatRequest(RequestBase):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    pin_system_prompt: bool = True
    tools: list | None = None
    tool_choice: object = None
    response_format: dict | None = None

    def refuse_unsupported(self):
        super().refuse_unsupported()
        if self.tools:
            raise BadField("tools", "tool calls are not supported")
        if self.tool_choice not in (None, "none"):
            raise BadField("tool_choice", "tool calls are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadField("response_format", f"response_format {self.response_format.get('type')!r} is not "
                                              "supported (only text)")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadField("top_logprobs", "top_logprobs needs logprobs=true")

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def length_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
