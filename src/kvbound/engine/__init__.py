"""The serving engine: continuous batching over one paged KV pool, each request with its own bounded cache."""
from .generate import generate_ids, prefill
from .llm import LLM
from .llm_engine import CompletionOutput, LLMEngine, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams", "generate_ids", "prefill"]
