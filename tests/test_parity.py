"""Numerical parity with Hugging Face transformers on small random configs (Llama, Qwen2, Qwen3)."""
import pytest
import torch
from tokenizers import Tokenizer, models

transformers = pytest.importorskip("transformers")

from kvbound.cache import KVCache  # noqa: E402
from kvbound.models import load  # noqa: E402
from kvbound.cache.policies import H2OPolicy, WindowPolicy  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    return {
        "llama": LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
        "llama-tied-llama3rope": LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=True,
                                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=32, rope_theta=1e6,
                             tie_word_embeddings=False),
    }


def _save(cfg, tmp_path, seed):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    return hf


@pytest.mark.parametrize("name", ["llama", "llama-tied-llama3rope", "qwen2", "qwen3"])
def test_prefill_and_decode_match_transformers(name, tmp_path):
    cfg = _configs()[name]
    hf = _save(cfg, tmp_path, seed=hash(name) % 1000)
    model, _ = load(tmp_path)
    assert model.config.arch == cfg.architectures[0] if cfg.architectures else True
    ids = torch.randint(0, cfg.vocab_size, (1, 13))
    cache = KVCache(model.config)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    ours = model(ids[0], cache.next_positions(13), cache)
    cache.advance(13)
    torch.testing.assert_close(ours, out.logits[0], atol=2e-4, rtol=1e-4)
    past = out.past_key_values
    for _ in range(20):
        nxt = out.logits[:, -1:].argmax(-1)
        with torch.no_grad():
            out = hf(nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        ours = model(nxt[0], cache.next_positions(1), cache)
        cache.advance(1)
        torch.testing.assert_close(ours[0], out.logits[0, -1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", [WindowPolicy(budget=64, sink=4), H2OPolicy(sink=2, heavy=30, recent=32),
                                    H2OPolicy(sink=2, heavy=30, recent=32, score="ema", granularity="layer")])
def test_bounded_policy_with_budget_over_length_equals_full(policy, tmp_path):
    hf_cfg = _configs()["llama"]
    _save(hf_cfg, tmp_path, seed=3)
    model, _ = load(tmp_path)
    ids = torch.randint(0, hf_cfg.vocab_size, (40,))
    full, bounded = KVCache(model.config), KVCache(model.config, policy)
    for c in (full, bounded):
        c.logits = model(ids[:8], c.next_positions(8), c)
        c.advance(8)
    for i in range(8, 40):
        a = model(ids[i:i + 1], full.next_positions(1), full)
        b = model(ids[i:i + 1], bounded.next_positions(1), bounded)
        full.advance(1)
        bounded.advance(1)
        assert torch.equal(a, b)
