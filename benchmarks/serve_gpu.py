"""`kvbound bench serve` on the lent GPU with random weights in SmolLM2's shape (issue #6).

The real checkpoint cannot travel to the GPU machine in one call, and cost per token does not depend on
weight values, so this writes a Hugging Face directory with random weights and a stand-in tokenizer
(prompts are random token ids anyway), then runs the CLI on it exactly as a user would.

PYTHONPATH=src python benchmarks/serve_gpu.py --out $OUT -- --rate 100 --duration 20
Everything after `--` goes to `kvbound bench serve`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from tokenizers import Tokenizer, models

SHAPES = {  # transformers config class, its arguments
    "smollm2": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                    tie_word_embeddings=True, rope_theta=1e5, max_position_embeddings=8192)),
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960)),
    "8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256, rope_theta=5e5,
                               max_position_embeddings=131072)),  # Llama-3.1-8B: GPU-bound steps
}


def random_model_dir(path: str, shape: str = "smollm2") -> str:
    import transformers
    config_class, kwargs = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 8B's random init is slow on the host
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    vocab = {f"t{i}": i for i in range(kwargs["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t2"}, f)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="serve_smollm2")
    args, rest = ap.parse_known_args()
    rest = [a for a in rest if a != "--"]
    from kvbound.cli import main as cli
    with tempfile.TemporaryDirectory() as d:
        random_model_dir(d)
        os.makedirs(args.out, exist_ok=True)
        rc = cli(["bench", "serve", "--model", d, "--json", os.path.join(args.out, args.name + ".json"),
                  "--plot", os.path.join(args.out, args.name + ".png"), *rest])
    sys.exit(rc)


if __name__ == "__main__":
    main()
