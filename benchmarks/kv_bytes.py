"""KV bytes each strategy holds for one SmolLM2-shaped sequence after 512 tokens (the cache's own accounting:
K/V data + scales + biases + int32 positions + fp32 scores). Bytes depend on shapes and policy only, so
random K/V stand in for the model.

    python benchmarks/kv_bytes.py [--tokens 512] [--budget 256]
"""
import argparse

import torch

from kvbound.cache import KVCache
from kvbound.models import ModelConfig
from kvbound.eval.strategies import CacheOptions, parse_strategies

SMOLLM2 = ModelConfig(arch="LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, intermediate_size=1536)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    names = ["baseline", "window", "h2o-heavy", "h2o-heavy+kv8", "h2o-heavy+kvmixed",
             "h2o-heavy+kv4", "window+kv8"]
    cfg = SMOLLM2
    torch.manual_seed(0)
    print(f"{'strategy':<22}{'KV held (KiB)':>15}{'full bf16 (KiB)':>17}{'compression':>13}")
    for name, (pol, bits) in parse_strategies(names, args.budget, CacheOptions()).items():
        cache = KVCache(cfg, pol, dtype=torch.bfloat16, kv_bits=bits)
        for _ in range(args.tokens):
            pos = cache.next_positions(1)
            for layer in range(cfg.num_layers):
                cache.attend(layer, torch.randn(1, 9, 64), torch.randn(1, 3, 64), torch.randn(1, 3, 64), pos)
            cache.advance(1)
        m = cache.nbytes()
        print(f"{name:<22}{m['held_bytes'] / 1024:>15.1f}{m['full_bf16_bytes'] / 1024:>17.1f}"
              f"{m['full_bf16_bytes'] / m['held_bytes']:>12.2f}x")


if __name__ == "__main__":
    main()
