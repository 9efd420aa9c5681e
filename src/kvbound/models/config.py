"""Model hyper-parameters in one flat dataclass, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import KvboundError


SUPPORTED_ARCHS = {
    # HF `architectures[0]` -> family flags
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise KvboundError(f"config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise KvboundError(f"config: num_attention_heads={self.num_heads} is not a multiple of "
                               f"num_key_value_heads={self.num_kv_heads}")

    def check_length(self, prompt_tokens: int, max_tokens: int = 0):
        """Refuse a request that would run past the model's context: positions beyond it were never trained,
        and the output turns to garbage."""
        ctx, total = self.max_position_embeddings, prompt_tokens + max_tokens
        if prompt_tokens > ctx:
            raise KvboundError(f"the prompt has {prompt_tokens:,} tokens, more than the model's context of {ctx:,}")
        if total > ctx:
            raise KvboundError(f"the prompt ({prompt_tokens:,} tokens) plus max_tokens ({max_tokens:,}) is {total:,} "
                               f"tokens, past the model's context of {ctx:,}: lower max_tokens to at most "
                               f"{ctx - prompt_tokens:,}")

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V for every layer, at `bytes_per_elem` (2 for bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHS:
            raise KvboundError(f"{source}: unsupported architecture {arch!r}; "
                               f"supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            return cls(
                arch=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                intermediate_size=cfg["intermediate_size"],
                rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(cfg),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                **SUPPORTED_ARCHS[arch],
            )
        except KeyError as e:
            raise KvboundError(f"{source}: malformed config, missing key {e.args[0]!r}") from None
        except TypeError as e:
            raise KvboundError(f"{source}: malformed config ({e})") from None


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise KvboundError(f"config.json: unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
    return dict(rs, rope_type=kind)
