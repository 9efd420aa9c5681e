"""KV caches: eviction policies, the per-sequence cache, its storage (dense / paged / quantized) and the
attention steps shared by a single cache and the engine's batches."""
from .block_pool import BlockPool
from .kv_cache import KVCache, MultiCache, sequence_cache
from .policies import FullPolicy, H2OPolicy, Policy, WindowPolicy, parse_policy
from .quant import parse_kv_bits

__all__ = ["BlockPool", "KVCache", "MultiCache", "FullPolicy", "H2OPolicy", "Policy", "WindowPolicy",
           "parse_policy", "parse_kv_bits", "sequence_cache"]
