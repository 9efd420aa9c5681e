"""transformers' generate() with and without `kvbound.hf.install_kv_eviction`, side by side (issue #19).

Random weights in Llama-3.2-1B's shape (bf16, CUDA), one prompt of random token ids per context length,
greedy. For each context and both ways: decode tokens/s (a generate() of --new-tokens minus one of 1 token,
so the prefill cancels), peak memory above the weights during generate(), and the KV bytes the cache holds
at the end. The patched model runs each of --policies: h2o with 4 sinks, --budget heavy hitters and --budget
recent tokens, or a named policy (observed, observed-merge, ...) over the same 4 + 2 x --budget tokens.

PYTHONPATH=src python benchmarks/hf_generate.py --out $OUT [--contexts 4096,8192,16384] [--budget 510]
    [--policies h2o,observed,observed-merge]
Prints a table last; writes hf_generate_<shape>.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=5e5, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def timed_generate(model, ids, new_tokens, device):
    torch.cuda.synchronize() if device == "cuda" else None
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    torch.cuda.synchronize() if device == "cuda" else None
    return time.perf_counter() - start, out


def measure(model, ids, new_tokens, device) -> dict:
    timed_generate(model, ids[:, :64], 4, device)  # warm-up
    t1, _ = timed_generate(model, ids, 1, device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    tn, out = timed_generate(model, ids, new_tokens, device)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    cache = getattr(out, "cache", None) or out.past_key_values  # `cache` from transformers 5.24
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return {"decode_tok_s": (new_tokens - 1) / max(tn - t1, 1e-9), "prefill_s": t1, "peak_bytes": peak,
            "kv_bytes_held": kv, "held_tokens": cache.layers[0].keys.shape[-2]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=510, help="heavy hitters (and as many recent tokens)")
    ap.add_argument("--policies", default="h2o", help="patched runs: h2o or named policies, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    import kvbound.hf as kh
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(contexts) + args.new_tokens + 8)
    model = LlamaForCausalLM(cfg).to(args.device, dtype).eval()
    warm = torch.randint(1, cfg.vocab_size, (1, 2 * args.budget + 64), device=args.device)
    timed_generate(model, warm, 2, args.device)  # cuBLAS, SDPA and each policy's kernels start before the timing
    for policy in args.policies.split(","):
        kh.install_kv_eviction(model, policy, budget=args.budget, n_sink=4, n_recent=args.budget)
        timed_generate(model, warm, 2, args.device)
        kh.remove_kv_eviction(model)
    rows = []
    for ctx in contexts:
        ids = torch.randint(1, cfg.vocab_size, (1, ctx), device=args.device)
        plain = measure(model, ids, args.new_tokens, args.device)
        for policy in args.policies.split(","):
            kh.install_kv_eviction(model, policy, budget=args.budget, n_sink=4, n_recent=args.budget)
            bounded = measure(model, ids, args.new_tokens, args.device)
            kh.remove_kv_eviction(model)
            rows.append({"context": ctx, "policy": policy, "unpatched": plain, "kvbound": bounded})
            print(ctx, policy, plain, bounded, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"hf_generate_{args.shape}.json"), "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    mib = 2 ** 20
    print(f"\n{args.shape} shape, random weights, {dtype}, {args.device}; 4 + {args.budget} + {args.budget} tokens; "
          f"{args.new_tokens} new tokens, greedy")
    print(f"{'context':>8} {'policy':>15} {'tok/s plain':>12} {'tok/s kvbound':>14} {'x':>6} {'prefill s plain':>16} "
          f"{'prefill s kvbound':>18} {'peak MiB plain':>15} {'peak MiB kvbound':>17} {'KV MiB plain':>13} "
          f"{'KV MiB kvbound':>15}")
    for r in rows:
        p, b = r["unpatched"], r["kvbound"]
        print(f"{r['context']:>8} {r['policy']:>15} {p['decode_tok_s']:>12.1f} {b['decode_tok_s']:>14.1f} "
              f"{b['decode_tok_s'] / p['decode_tok_s']:>6.2f} {p['prefill_s']:>16.3f} {b['prefill_s']:>18.3f} "
              f"{p['peak_bytes'] / mib:>15.0f} "
              f"{b['peak_bytes'] / mib:>17.0f} {p['kv_bytes_held'] / mib:>13.1f} {b['kv_bytes_held'] / mib:>15.1f}")


if __name__ == "__main__":
    main()
