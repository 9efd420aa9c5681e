"""kvbound: LLM inference whose KV cache stays inside a memory bound."""
from .cache import FullPolicy, H2OPolicy, KVCache, WindowPolicy, parse_policy
from .engine import LLM, LLMEngine, SamplingParams
from .errors import KvboundError
from .models import ModelConfig, load
from .version import __version__

__all__ = ["LLM", "LLMEngine", "SamplingParams", "KVCache", "KvboundError", "ModelConfig", "load", "FullPolicy",
           "WindowPolicy", "H2OPolicy", "parse_policy", "__version__"]
