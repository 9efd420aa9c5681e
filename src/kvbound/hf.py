"""`import kvbound.hf`: bounded KV for Hugging Face transformers models (see `kvbound.integrations.hf`)."""
from .integrations.hf import (EvictingLayer, KVBoundCache, install_kv_eviction,  # noqa: F401
                              remove_kv_eviction, reset_eviction_scores)

__all__ = ["EvictingLayer", "KVBoundCache", "install_kv_eviction", "remove_kv_eviction", "reset_eviction_scores"]
