"""kvbound: LLM inference whose KV cache stays inside a memory bound."""
from .cache import KVCache
from .config import KvboundError, ModelConfig
from .loader import load
from .policies import FullPolicy, H2OPolicy, WindowPolicy, parse_policy

__all__ = ["KVCache", "KvboundError", "ModelConfig", "load", "FullPolicy", "WindowPolicy", "H2OPolicy",
           "parse_policy"]
__version__ = "0.1.0"
