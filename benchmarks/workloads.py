"""The engine under the workloads of issue #15, side by side in one run, each against its floor.

Random weights in Qwen3-0.6B's shape (bf16 on the GPU). Every case runs the engine dry and records each
step: its host time, and whether all its rows decoded (a pure decode step) with how many K/V tokens they
held. Floors, measured in the same run:
  decode   the bytes a pure decode step must read (weights + the running sequences' K/V) over the
           device-to-device copy bandwidth;
  prefill  the model's linear layers alone (every weight matmul at --max-num-batched-tokens rows), per token.

  nano          256 requests, prompt and output lengths U[100, 1024] (nano-vllm's bench), greedy
  <case>-sync   any case without async scheduling (each step's tokens read before the next is built)
  nano-sampled  the same, temperature 0.8, top_p 0.95: the sampled / greedy ratio
  long-full     64 prompts of 8k tokens + 256 out, a pool for a quarter of them, full cache
  long-h2o      the same under h2o (budget 1024): prefill share of the time
  prefill-full  prefill only (1 output token), full cache, 142k prompt tokens
  prefill-h2o   the same prompts under h2o (budget 1024): bounded / full prefill ratio

PYTHONPATH=src:benchmarks python benchmarks/workloads.py --out $OUT [--cases nano,nano-sampled] [--hf]
On the CPU, `--shape tiny --scale 0.02` checks the script in seconds (no floors there).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time

import torch

from kvbound.cache import parse_policy
from kvbound.engine import LLMEngine, SamplingParams
from kvbound.models import ModelConfig
from kvbound.models.llama import CausalLM

SHAPES = {
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, intermediate_size=3072, qk_norm=True, tie_word_embeddings=True,
                       rope_theta=1e6, max_position_embeddings=40960),
    "tiny": dict(arch="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=128, qk_norm=True, tie_word_embeddings=True,
                 max_position_embeddings=40960),
}
CASES = ("nano", "nano-sync", "nano-sampled", "long-full", "long-h2o", "prefill-full", "prefill-h2o")


def build(shape, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(ModelConfig(**SHAPES[shape])).to(dtype).eval()
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy moves (read + write), or nan off the GPU."""
    if device.type != "cuda":
        return float("nan")
    from decode_attention import copy_bandwidth as gbs  # benchmarks/ is on the path as the script's folder
    return gbs() * 1e9


def linear_floor_s_per_token(model, tokens: int) -> float:
    """The weight matmuls of one forward over `tokens` rows, timed alone, per token."""
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(tokens, w.shape[1], device=dev, dtype=dtype) for w in weights}
    for _ in range(2):
        for w in weights:
            x[w.shape[1]] @ w.T
    t0 = sync(dev)
    for w in weights:
        x[w.shape[1]] @ w.T
    return (sync(dev) - t0) / tokens


def run_case(model, prompts, params, policy, engine_args, bytes_per_s) -> dict:
    """Run the engine dry; throughput and the floor figures of its pure decode steps."""
    dev = next(model.parameters()).device
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token = model.config.kv_bytes_per_token(2)
    with LLMEngine(model, None, policy=policy, **engine_args) as eng:
        for p in prompts:
            eng.add_request(p, params)
        decode_s = decode_floor_s = prefill_s = 0.0
        steps = decode_steps = 0
        t0 = sync(dev)
        while eng.has_unfinished():
            running = list(eng.scheduler.running)
            # (an async engine's last call only reads the tokens of sequences that end on them: no decode step)
            pure = (bool(running) and not eng.scheduler.waiting and all(s.to_feed() == 1 for s in running)
                    and not all(s.finishing for s in running))
            held = sum(len(s.cache) for s in running if not s.finishing) if pure else 0
            s0 = time.perf_counter()
            eng.step(only_finished=True)
            # an async engine's step reads the previous step's tokens while this one runs: no sync here
            s1 = sync(dev) if (pure and not eng.async_scheduling) or dev.type != "cuda" else time.perf_counter()
            steps += 1
            if pure:
                decode_steps += 1
                decode_s += s1 - s0
                decode_floor_s += (weight_bytes + held * kv_token) / bytes_per_s
            else:
                prefill_s += s1 - s0
        elapsed = sync(dev) - t0
        stats = dict(eng.scheduler.stats)
    out_tokens = len(prompts) * params.max_tokens
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": out_tokens,
            "elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed,
            "prompt_tok_s": sum(map(len, prompts)) / elapsed, "steps": steps, "decode_steps": decode_steps,
            "decode_floor_ratio": decode_floor_s / decode_s if decode_s else float("nan"),
            "non_decode_share": prefill_s / elapsed, **stats}


@contextlib.contextmanager
def profiled(on: bool, path: str):
    """torch.profiler around a case (off: nothing); the operators' table, by device time, goes to `path`."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield
    keys = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for key in keys:  # where the device's time goes, then the host's
            f.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60) + "\n")


def lengths(n, lo, hi, seed):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def token_prompts(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def hf_generate_batch(model_shape, prompts, out_len, device):
    """transformers' continuous batching on the same prompts (random weights of the same shape)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.generation import GenerationConfig
    s = SHAPES[model_shape]
    cfg = Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                      num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    gc = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    t0 = sync(torch.device(device))
    res = hf.generate_batch(prompts, generation_config=gc, progress_bar=False)
    elapsed = sync(torch.device(device)) - t0
    return sum(len(r.generated_tokens) for r in res.values()) / elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (CPU checks)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--hf", action="store_true", help="also transformers' generate_batch on the nano prompts")
    ap.add_argument("--profile", action="store_true",
                    help="write each case's top operators by device and host time (torch.profiler) to --out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build(args.shape, dev, dtype)
    vocab = model.config.vocab_size
    bw = copy_bandwidth(dev)
    mnbt = args.max_num_batched_tokens
    lin_s = linear_floor_s_per_token(model, mnbt)

    def n(x, least=1):
        return max(least, int(round(x * args.scale)))

    nano_in = token_prompts(lengths(n(256), n(100), n(1024), 0), vocab, 0)
    nano_out = max(1, int(sum(lengths(n(256), n(100), n(1024), 1)) / n(256)))  # one length for all: the mean
    long_prompts = token_prompts([n(8192)] * n(64), vocab, 2)
    pre_prompts = token_prompts([n(1024)] * n(139), vocab, 3)  # 142k tokens at scale 1
    h2o = parse_policy("h2o", n(1024, 8))
    base = dict(max_num_batched_tokens=mnbt, prefill_chunk=min(2048, mnbt), max_num_seqs=256)
    big_pool = dict(base, kv_cache_tokens=n(256) * (n(1024) * 2 + 64))
    quarter = dict(base, kv_cache_tokens=max(n(64) // 4, 1) * (n(8192) + n(256) + 16))
    greedy = SamplingParams(max_tokens=nano_out, ignore_eos=True)
    runs = {
        "nano": (nano_in, greedy, None, big_pool),
        "nano-sampled": (nano_in, SamplingParams(max_tokens=nano_out, ignore_eos=True, temperature=0.8, top_p=0.95),
                         None, big_pool),
        "long-full": (long_prompts, SamplingParams(max_tokens=n(256), ignore_eos=True), None, quarter),
        "long-h2o": (long_prompts, SamplingParams(max_tokens=n(256), ignore_eos=True), h2o, quarter),
        "prefill-full": (pre_prompts, SamplingParams(max_tokens=1, ignore_eos=True), None,
                         dict(base, kv_cache_tokens=sum(map(len, pre_prompts)) + 4096)),
        "prefill-h2o": (pre_prompts, SamplingParams(max_tokens=1, ignore_eos=True), h2o,
                        dict(base, kv_cache_tokens=sum(map(len, pre_prompts)) + 4096)),
    }
    results = {}
    for name in args.cases.split(","):
        prompts, params, policy, eng_args = runs[name.removesuffix("-sync")]
        if name.endswith("-sync"):
            eng_args = dict(eng_args, async_scheduling=False)
        run_case(model, prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), policy, eng_args, bw)  # warm
        with profiled(args.profile, os.path.join(args.out, f"workloads_profile_{name}.txt")):
            results[name] = run_case(model, prompts, params, policy, eng_args, bw)
        results[name]["prefill_vs_linear_floor"] = (lin_s * results[name]["prompt_tokens"] /
                                                   results[name]["elapsed_s"]) if name.startswith("prefill") else None
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in results[name].items()}, flush=True)
    if args.hf and "nano" in results:
        results["nano"]["hf_generate_batch_tok_s"] = hf_generate_batch(args.shape, nano_in, nano_out, args.device)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"workloads_{args.shape}.json"), "w") as f:
        json.dump({"args": vars(args), "copy_bytes_per_s": bw, "linear_floor_s_per_token": lin_s,
                   "results": results}, f, indent=2)
    print(f"\n{args.shape} shape, random weights, {dtype}, {args.device}; copy {bw / 1e12:.2f} TB/s; "
          f"linear layers alone {1 / lin_s:,.0f} tok/s")
    print(f"{'case':<14} {'out tok/s':>10} {'prompt tok/s':>13} {'decode/floor':>13} {'prefill/floor':>14} "
          f"{'non-decode':>11}")
    for name, r in results.items():
        pf = r["prefill_vs_linear_floor"]
        print(f"{name:<14} {r['output_tok_s']:>10.0f} {r['prompt_tok_s']:>13.0f} {r['decode_floor_ratio']:>13.0%} "
              f"{'' if pf is None else f'{pf:.0%}':>14} {r['non_decode_share']:>11.0%}")
    ratios = {"sampled / greedy (target >= 0.9)": ("nano-sampled", "nano", "output_tok_s"),
              "async / sync scheduling, nano": ("nano", "nano-sync", "output_tok_s"),
              "async / sync scheduling, nano-sampled": ("nano-sampled", "nano-sampled-sync", "output_tok_s"),
              "bounded / full prefill (target >= 0.6)": ("prefill-h2o", "prefill-full", "prompt_tok_s")}
    for label, (a, b, key) in ratios.items():
        if a in results and b in results:
            print(f"{label}: {results[a][key] / results[b][key]:.3f}")
    if "hf_generate_batch_tok_s" in results.get("nano", {}):
        print(f"transformers generate_batch on the nano prompts: {results['nano']['hf_generate_batch_tok_s']:,.0f} "
              f"tok/s ({results['nano']['output_tok_s'] / results['nano']['hf_generate_batch_tok_s']:.1f}x slower "
              "than kvbound)")


if __name__ == "__main__":
    main()
