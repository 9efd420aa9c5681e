"""Decode speed on CPU: kvbound vs transformers' generate() on the same SmolLM2 GGUF, in one run.

    python benchmarks/cpu_decode.py [--threads 2] [--new-tokens 128] [--repeats 3]

Both run greedy decoding in float32 from the same prompt; each engine is timed `repeats` times,
alternating, and the median tokens/s is reported. Prefill is timed separately and excluded.
"""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="full")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from kvbound.cache import KVCache
    from kvbound.models import default_model_path, load
    from kvbound.cache.policies import parse_policy
    model, tok = load()
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompt = tok.encode("The history of the city of Paris begins with a small settlement on an island in the "
                        "river Seine, where a Celtic people lived")
    n = args.new_tokens

    def ours():
        cache = KVCache(model.config, parse_policy(args.policy, 64))
        logits = model(torch.tensor(prompt), cache.next_positions(len(prompt)), cache, logits_at=-1)[0]
        cache.advance(len(prompt))
        t = time.perf_counter()
        out = []
        for _ in range(n):
            nxt = int(logits.argmax())
            out.append(nxt)
            logits = model(torch.tensor([nxt]), cache.next_positions(1), cache)[0]
            cache.advance(1)
        return n / (time.perf_counter() - t), out

    def theirs():
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # prefill + 1 token
            t1 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
            t2 = time.perf_counter()
        return n / ((t2 - t1) - (t1 - t0)), out[0, len(prompt):].tolist()

    ours()
    theirs()  # warm-up
    rates = {"kvbound": [], "transformers": []}
    for _ in range(args.repeats):
        r, a = ours()
        rates["kvbound"].append(r)
        r, b = theirs()
        rates["transformers"].append(r)
    same = a[:32] == b[:32]
    k, h = statistics.median(rates["kvbound"]), statistics.median(rates["transformers"])
    print(f"\nSmolLM2-135M fp32, {args.threads} threads, {n} greedy tokens after a {len(prompt)}-token prompt, "
          f"median of {args.repeats}; first 32 tokens identical: {same}")
    print(f"{'engine':<14}{'tokens/s':>10}")
    print(f"{'kvbound':<14}{k:>10.1f}")
    print(f"{'transformers':<14}{h:>10.1f}")
    print(f"ratio kvbound/transformers: {k / h:.2f}")


if __name__ == "__main__":
    main()
