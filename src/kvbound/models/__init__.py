"""Models: config, loading (GGUF files and Hugging Face directories), tokenizer, the Llama family."""
from .config import ModelConfig
from .llama import CausalLM, LayerAttention
from .loader import build_model, default_model_path, load

__all__ = ["ModelConfig", "CausalLM", "LayerAttention", "build_model", "default_model_path", "load"]
