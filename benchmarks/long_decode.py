"""Decode at 16k-32k tokens of context on the lent GPU, full caches (issue #15, item 2): CUDA graphs now
cover any context up to the model's (doubling table widths captured when first needed) where before
steps past 8,192 tokens ran eagerly. Both side by side in one run, against the floor.

Floor: the bytes a pure decode step must read (the weights and every running sequence's K/V) divided by
the device-to-device copy bandwidth measured in the same run. Random weights in SmolLM2's shape with a
40,960-token context (Qwen3's), bf16.

PYTHONPATH=src:benchmarks python benchmarks/long_decode.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from decode_attention import copy_bandwidth  # benchmarks/ is on the path as the script's folder
from engine_throughput import SHAPES, prompts, sync_time
from kvbound.engine import LLMEngine, SamplingParams
from kvbound.models import ModelConfig, build_model


def model(shape):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=40960, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ours = build_model(ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}),
                       hf.state_dict(), device="cuda", dtype=torch.bfloat16)
    del hf
    return ours


def decode_step_ms(m, batch, context, graphs: bool, steps=24, async_scheduling=None) -> tuple[float, float]:
    """Prefill `batch` prompts of `context` tokens, then time steady decode steps (all rows decoding): (ms a
    step, K/V tokens the rows held on average). Rows prefilled first decode while the others prefill (decodes
    go first), so max_tokens leaves room for that: every row still runs in the timed steps."""
    vocab = m.config.vocab_size
    room = 256
    with LLMEngine(m, None, kv_cache_tokens=batch * (context + room) + 4096, max_num_seqs=max(batch, 1),
                   max_num_batched_tokens=16384, prefill_chunk=2048, cuda_graphs=graphs,
                   async_scheduling=async_scheduling) as eng:
        for p in prompts(batch, context, vocab, 1):
            eng.add_request(p, SamplingParams(max_tokens=room - 16, ignore_eos=True))
        while eng.scheduler.waiting or any(s.to_feed() > 1 for s in eng.scheduler.running):
            eng.step()
        for _ in range(3):  # the first wide graph is captured here
            eng.step(only_finished=True)
        held = sum(len(s.cache) for s in eng.scheduler.running) + batch * steps / 2
        t0 = sync_time()
        for _ in range(steps):
            eng.step(only_finished=True)
        elapsed = sync_time() - t0
        sched = eng.scheduler
        assert len(sched.running) == batch and not sched.waiting and not sched.stats["preemptions"], sched.stats
        return 1000 * elapsed / steps, held


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-eager", action="store_true", help="time the graphs only")
    ap.add_argument("--tag", default="", help="appended to the JSON file's name")
    ap.add_argument("--sync", action="store_true", help="also the graphs without async scheduling")
    args = ap.parse_args()
    m = model(args.shape)
    bw = copy_bandwidth() * 1e9  # bytes/s (read + write)
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_token = m.config.kv_bytes_per_token(2)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            eager = float("nan") if args.no_eager else decode_step_ms(m, batch, context, graphs=False)[0]
            graph, held = decode_step_ms(m, batch, context, graphs=True)
            floor_ms = 1000 * (weight_bytes + held * kv_token) / bw
            rows.append(dict(context=context, batch=batch, floor_ms=floor_ms, eager_ms=eager, graph_ms=graph))
            if args.sync:
                rows[-1]["graph_sync_ms"] = decode_step_ms(m, batch, context, graphs=True, async_scheduling=False)[0]
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"long_decode_{args.shape}{args.tag}.json"), "w") as f:
        json.dump({"copy_bandwidth_GBs": bw / 1e9, "weight_bytes": weight_bytes, "rows": rows}, f, indent=2)
    print(f"\n{args.shape} shape, random weights, bf16, full caches; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'context':>8} {'batch':>6} {'floor ms':>9} {'eager ms':>9} {'graph ms':>9} {'eager/floor':>12} "
          f"{'graph/floor':>12}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>6} {r['floor_ms']:>9.2f} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
              f"{r['floor_ms'] / r['eager_ms']:>12.0%} {r['floor_ms'] / r['graph_ms']:>12.0%}"
              + (f"   sync graphs {r['graph_sync_ms']:.2f} ms" if "graph_sync_ms" in r else ""))


if __name__ == "__main__":
    main()
