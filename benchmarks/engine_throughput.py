"""Engine throughput on the lent GPU (issue #6), everything side by side in one run.

Random weights in real shapes (cost per token does not depend on weight values); transformers and kvbound
run the very same weights (kvbound's model is built from the transformers model's state dict).

  offline   N requests of random prompts at once: kvbound's engine against transformers' generate() with
            one static batch of all N (equal prompt lengths, so no padding) and transformers'
            continuous batching (generate_batch). Output tokens per second.
  bounded   4k-token prompts in one fixed KV memory: the full cache against h2o (budget 256). The most
            sequences each fits at once, and the decode throughput with all of those (at most
            --max-bounded-seqs) running at once, after their prefill.

PYTHONPATH=src python benchmarks/engine_throughput.py --shape smollm2 --offline 256 --bounded --out $OUT
Prints a table last; --out DIR writes engine_<shape>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decode_attention import TILE_FLAGS, copy_bandwidth, tile_flags  # benchmarks/ is on the path as the script's folder
from kvbound.models import ModelConfig
from kvbound.engine import LLMEngine
from kvbound.engine import SamplingParams
from kvbound.models import build_model
from kvbound.cache.policies import H2OPolicy, parse_policy
from kvbound.eval.strategies import split_strategies
from kvbound.cache import block_pool
from kvbound.kernels import triton_decode

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e5),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=5e5),
}


TILE_TABLES = {"long": triton_decode.TILES_LONG, "mid": triton_decode.TILES, "short": triton_decode.TILES_SHORT,
               "narrow": triton_decode.TILES_NARROW, "many": triton_decode.TILES_LONG_MANY,
               "few": triton_decode.TILES_LONG_FEW}
KERNEL_TILES = {name: dict(table) for name, table in TILE_TABLES.items()}  # the kernel's own, to go back to
KERNEL_ROWS = triton_decode.MIN_QUERY_ROWS
TILE_FORM = ("[long:|many:|few:|mid:|short:|narrow:]format:head_dim:keys:warps:stages[:split_blocks[:programs_per_sm"
             f"[:{TILE_FLAGS}]]]")


def tile_entries(spec: str) -> list:
    """(table, (format, head_dim), Tile) of each entry of a --packed-tiles list; format 16 (bf16), 8, 4 or fp8,
    split_blocks 0 for none (programs per SM decide), the flags as `decode_attention.tile_flags` reads them."""
    entries = []
    for tile in spec.split(",") if spec else []:
        fields = tile.split(":")
        if fields[0] == "rows":  # rows:N pads each program's query heads to at least N rows (MIN_QUERY_ROWS)
            if len(fields) != 2 or not fields[1].isdigit() or int(fields[1]) < 1:
                raise ValueError(f"{tile!r} is not rows:N with N a whole number of rows")
            entries.append(("rows", None, int(fields[1])))
            continue
        table = fields.pop(0) if fields[0] in TILE_TABLES else "long"
        numbers = next((i for i, f in enumerate(fields[1:], 1) if not f.isdigit()), len(fields))
        fields, flags = fields[:numbers], fields[numbers:]
        if not 5 <= len(fields) <= 7 or fields[0] not in ("16", "8", "4", "fp8"):
            raise ValueError(f"{tile!r} is not {TILE_FORM} with format 16, 8, 4 or fp8")
        fmt, d, keys, warps, stages, *rest = fields
        split_blocks, pps = [int(f) for f in rest] + [0, 4][len(rest):]
        entries.append((table, (fmt if fmt == "fp8" else int(fmt), int(d)),
                        triton_decode.Tile(int(keys), int(warps), int(stages), split_blocks or None, pps,
                                           **tile_flags(flags))))
    return entries


def use_tiles(entries):
    """The kernel's tile tables (bf16's entries among them) as they ship, with `entries` set over them."""
    for name, table in TILE_TABLES.items():
        table.clear()
        table.update(KERNEL_TILES[name])
    triton_decode.MIN_QUERY_ROWS = KERNEL_ROWS
    for name, key, tile in entries:
        if name == "rows":
            triton_decode.MIN_QUERY_ROWS = tile
        else:
            TILE_TABLES[name][key] = tile


def models(shape, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=16384, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
    ours = build_model(ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}),
                       hf.state_dict(), device="cuda", dtype=dtype)
    return hf, ours


def steady_decode(model, policy, blocks, context, cap, vocab, steps=32, profile=False, kv_bits=None,
                  kv_storage="paged", tile_sweep=(), tiles=()):
    """As many `context`-token requests as fit in `blocks` (at most `cap`): prefill them all, then time
    `steps` decode steps with every one of them running. Returns fit, running, prefill and decode figures.
    tile_sweep: (label, entries) of tiles to try over `tiles` on the same running batch after that, each timed as
    the step's graph captured again with them (graph_ms_tiles); `tiles` alone after."""
    bs = 16
    out_len = 160  # a full cache's blocks hold its prompt and this many tokens
    need = -(-(policy.budget + 1) // bs) if policy.budget is not None else -(-(context + out_len) // bs)
    fit = blocks // need
    n = min(fit, cap)
    if policy.budget is not None:  # long enough to still decode when the last prompt is in: a step prefills at most
        out_len = 1024 + 2 * n * context // 8192  # 8,192 tokens, fewer as more decode beside them
    eng = LLMEngine(model, None, policy=policy, num_blocks=blocks, max_num_seqs=n, max_num_batched_tokens=8192,
                    prefill_chunk=512, kv_bits=kv_bits, kv_storage=kv_storage)
    for p in prompts(2, min(context, 1024), vocab, 98):  # the policy's kernels compile before the timing
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for p in prompts(n, context, vocab, 1):
        eng.add_request(p, params)
    t0 = sync_time()
    while eng.scheduler.waiting or any(s.to_feed() > 1 or s.reading for s in eng.scheduler.running):
        eng.step()  # a KVzip prompt's prefill ends when its second reading has scored it (`Sequence.reading`)
    # the first decode of the caches that finished prefill last runs eagerly (and compiles that path's
    # kernels); a few steps later every step replays a graph: those are the steady state timed below
    t1 = sync_time()
    for _ in range(4):
        eng.step(only_finished=True)
    td = sync_time()
    if profile:  # where a steady decode step's time goes: kernels on the GPU, calls on the host
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
        for meta in eng.caches.stacked.values():  # layers of different budgets: how wide groups read each layer
            if meta.planned:
                plans = meta.plan_rows[sorted(meta.holders)].float()  # the rows caches hold now
                print(f"read widths (place rows) summed over layers: {sum(meta.layer_width)}; the rows' plans: "
                      f"{plans.sum(1).mean():.0f} on average over {len(plans)} rows\n  widths {meta.layer_width}\n"
                      f"  plans' mean {[round(x) for x in plans.mean(0).tolist()]}")
        td = sync_time()
    pages = eng.pool.pages

    def mapping():  # virtual storage's host time in driver calls, and its maps and unmaps
        return (pages.map_seconds, pages.counts["mapped"] + pages.counts["unmapped"]) if pages else (0.0, 0)
    before = mapping()
    for _ in range(steps):
        eng.step(only_finished=True)
    t2 = sync_time()
    after = mapping()
    running = len(eng.scheduler.running)
    growth = {}
    if pages:  # a growing batch's maps per step, from its bytes per token (page crossings of one window vary)
        per_map = 1000 * pages.map_seconds / max(1, pages.counts["mapped"])
        if policy.budget is None:  # bounded caches map nothing once they hold their budget
            expected = running * eng.pool.block_bytes / eng.pool.block_size / pages.page_bytes
            growth = dict(ms_per_map=per_map, maps_per_step_expected=expected, map_ms_expected=per_map * expected)
    res = dict(fit=fit, running=running, prefill_s=t1 - t0, prefill_tok_s=n * context / (t1 - t0),
               decode_tok_s=running * steps / (t2 - td), step_ms=1000 * (t2 - td) / steps,
               graph_ms=replay_ms(eng), write_ms=write_ms(eng.pool, running, model.config.num_layers),
               committed_gib=eng.pool.committed_bytes / 2**30, preemptions=eng.scheduler.stats["preemptions"],
               recomputed_tokens=eng.scheduler.stats["recomputed_tokens"],
               map_ms=1000 * (after[0] - before[0]) / steps, maps_per_step=(after[1] - before[1]) / steps, **growth)
    if tile_sweep and eng.graphs is not None and eng.graphs.last is not None:
        res["graph_ms_tiles"] = {}
        for label, entries in tile_sweep:
            use_tiles([*tiles, *entries])
            eng.graphs.graphs.pop(eng.graphs.last)  # captured again at its next step, with these tiles
            for _ in range(3):
                eng.step(only_finished=True)
            res["graph_ms_tiles"][label] = replay_ms(eng)
        use_tiles(tiles)
    eng.close()
    return res


def replay_ms(eng, reps=20) -> float:
    """A decode step's GPU time: the graph the last step replayed, replayed alone (no host work, which moves the
    small model's step by up to a third between runs), median of 5 rounds."""
    graphs = eng.graphs
    if graphs is None or graphs.last is None:
        return float("nan")
    graph = graphs.graphs[graphs.last]
    graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def write_ms(pool, rows, layers, reps=20):
    """A decode step's KV writes alone: `rows` new tokens into every layer of the pool (quantized on the way in
    for packed pools: the quantize-on-write cost)."""
    k = torch.randn(rows, pool.kv_heads, pool.head_dim, device="cuda", dtype=torch.bfloat16)
    slots = pool.block_slots([b for b in range(len(pool.ref)) if pool.ref[b] > 0])  # held: their pages are mapped
    slots = slots[torch.randperm(len(slots), device="cuda")[:rows]]
    graph = torch.cuda.CUDAGraph()  # replayed, as the decode step's writes are: no launch overhead counted
    with torch.cuda.graph(graph):
        for layer in range(layers):
            pool.write(layer, slots, k, k)
    graph.replay()
    t0 = sync_time()
    for _ in range(reps):
        graph.replay()
    return 1000 * (sync_time() - t0) / reps


def prompts(n, length, vocab, seed=0):
    return torch.randint(1, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def sync_time():
    torch.cuda.synchronize()
    return time.perf_counter()


def run_engine(model, reqs, out_len, policy=None, num_blocks=None, max_num_seqs=256, mnbt=8192):
    """Returns (seconds, output tokens, decode tokens/s in all-decode steps, peak running, stats)."""
    eng = LLMEngine(model, None, policy=policy, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=mnbt, prefill_chunk=512)
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for p in reqs:
        eng.add_request(p, params)
    peak, dec_tok, dec_s = 0, 0, 0.0
    t0 = sync_time()
    while eng.has_unfinished():
        s0 = time.perf_counter()
        before = [(s, s.to_feed()) for s in eng.scheduler.running]
        eng.step(only_finished=True)
        s1 = time.perf_counter()  # no sync: an async engine reads a step's tokens while the next one runs
        running = len(eng.scheduler.running)
        peak = max(peak, running)
        if before and all(f == 1 for _, f in before) and not eng.scheduler.waiting:
            dec_tok += len(before)
            dec_s += s1 - s0
    t1 = sync_time()
    return t1 - t0, len(reqs) * out_len, dec_tok / dec_s if dec_s else float("nan"), peak, eng.scheduler.stats


def run_hf_generate(hf, reqs, out_len):
    ids = torch.tensor(reqs, device="cuda")
    t0 = sync_time()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                      do_sample=False)
    t1 = sync_time()
    return t1 - t0, (out.shape[1] - ids.shape[1]) * ids.shape[0]


def run_hf_batch(hf, reqs, out_len):
    from transformers.generation import GenerationConfig
    gc = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    t0 = sync_time()
    res = hf.generate_batch(reqs, generation_config=gc, progress_bar=False)
    t1 = sync_time()
    return t1 - t0, sum(len(r.generated_tokens) for r in res.values())


def check(shape):
    """fp32, kernels and graphs on: every request's greedy tokens from the batched engine equal a
    single-sequence run on the same GPU (per-sequence path, no batching, no graphs)."""
    from kvbound.cache import KVCache
    from kvbound.engine import generate_ids
    from kvbound.cache.policies import WindowPolicy
    hf, ours = models(shape, torch.float32)
    del hf
    vocab = ours.config.vocab_size
    pols = [None, H2OPolicy(sink=4, heavy=60, recent=64), WindowPolicy(budget=96, sink=4), None,
            H2OPolicy(sink=4, heavy=60, recent=64, score="ema"), H2OPolicy(sink=2, heavy=40, recent=22)]
    reqs = [prompts(1, n, vocab, 10 + i)[0] for i, n in enumerate([40, 300, 150, 700, 90, 64])]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    h2o = H2OPolicy(sink=4, heavy=60, recent=64)
    runs = {"mixed policies (batched groups)": (reqs, pols),  # the same policy for all: whole steps replay graphs
            "all h2o (evict graphs)": ([prompts(1, 200 + 37 * i, vocab, 30 + i)[0] for i in range(5)], [h2o] * 5),
            "all full (append graphs)": ([prompts(1, 50 + 23 * i, vocab, 40 + i)[0] for i in range(5)], [None] * 5)}
    same = total = 0
    for name, (rs, ps) in runs.items():
        eng = LLMEngine(ours, None, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=512, prefill_chunk=128)
        ids = [eng.add_request(r, params, p) for r, p in zip(rs, ps)]
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] = o.outputs[0].token_ids
        ok = sum(list(generate_ids(ours, r, params, KVCache(ours.config, p, device="cuda"), (), 128)) == got[rid]
                 for rid, r, p in zip(ids, rs, ps))
        graphs = sorted({f"{k.kind}x{b}" for k, b, _ in eng.graphs.parts()})
        print(f"check ({shape}, fp32) {name}: {ok}/{len(rs)} requests give the same greedy tokens batched as "
              f"alone; graphs {graphs}")
        same, total = same + ok, total + len(rs)
    return same, total


def warm(model, vocab):
    run_engine(model, prompts(4, 32, vocab, 99), 4)


def matmul_floor(model, reqs_n, in_len, out_len, mnbt=8192):
    """A lower bound on the offline run's time from work no engine can skip: every linear layer's matmul
    (cuBLAS, the model's own weights, replayed in a CUDA graph) for the prefill in mnbt-token chunks and
    for each decode step of reqs_n sequences, plus reading each decode step's KV cache (average length) at
    the device-to-device copy bandwidth measured here. Attention compute, norms, RoPE, sampling and host
    work are left out, so the real floor is higher."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    cfg = model.config

    def gemm_ms(tokens, head_tokens):
        xs = {m.in_features: torch.randn(tokens, m.in_features, device="cuda", dtype=torch.bfloat16)
              for m in linears}
        xh = xs[cfg.hidden_size][:head_tokens]

        def step():
            for m in linears:
                torch.nn.functional.linear(xs[m.in_features], m.weight)
            torch.nn.functional.linear(xh, model.lm_head.weight)
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        del g, xs
        return sorted(times)[2]

    copy_gbs = copy_bandwidth()
    prompt_tokens = reqs_n * in_len
    chunks = [min(mnbt, prompt_tokens - i) for i in range(0, prompt_tokens, mnbt)]
    prefill_ms = sum(gemm_ms(c, min(c, reqs_n)) for c in chunks)
    decode_gemm_ms = gemm_ms(reqs_n, reqs_n)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    avg_ctx = in_len + out_len / 2
    kv_ms = reqs_n * avg_ctx * kv_per_token / copy_gbs / 1e6
    total_s = (prefill_ms + (out_len - 1) * (decode_gemm_ms + kv_ms)) / 1e3
    return dict(prefill_gemm_ms=prefill_ms, decode_gemm_ms=decode_gemm_ms, decode_kv_ms=kv_ms, copy_gbs=copy_gbs,
                seconds=total_s, tok_s=reqs_n * out_len / total_s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--offline", type=int, default=256, help="concurrent requests in the offline run (0: skip)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--bounded", action="store_true", help="run the h2o vs full at 4k context comparison")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-gib", type=float, default=4.0, help="KV memory of the bounded comparison")
    ap.add_argument("--max-bounded-seqs", type=int, default=256, help="run at most this many of those that fit")
    ap.add_argument("--policies", default="full,h2o", help="policies of the bounded comparison (names or specs)")
    ap.add_argument("--budget", type=int, default=256, help="KV budget of the named bounded policies")
    ap.add_argument("--kv-formats", default="bf16", help="pool formats of the bounded comparison: bf16, 8, 4, fp8, "
                    "mixed (heavy=4,recent=8; h2o policies) (issue #17: --kv-formats bf16,8,4,fp8,mixed)")
    ap.add_argument("--kv-storage", default="paged", help="pool storage of the bounded comparison: paged, "
                    "virtual, or both (issue #20: paged,virtual)")
    ap.add_argument("--page-mib", default=str(block_pool.POOL_PAGE_BYTES >> 20),
                    help="virtual storage's page sizes, MiB (whole 2 MiB granules): each is a run")
    ap.add_argument("--packed-tiles", default=None, help=f"decode tiles to try instead of the kernel's: {TILE_FORM},"
                    "... for tables of at least LONG_KEYS keys (the default), the middle ones, calls of fewer than "
                    "SHORT_KEYS keys in all, or tables narrower than NARROW_KEYS (e.g. fp8:64:256:4:2, "
                    "narrow:8:64:64:4:2:2, long:16:128:128:4:2:0:2)")
    ap.add_argument("--tile-sweep", default=None, help="with --bounded: tile lists (--packed-tiles' form) separated by "
                    "';', each over --packed-tiles and timed on every run's running batch after its own timing, by "
                    "capturing the step's graph again (no new prefill), e.g. "
                    "'narrow:8:64:64:4:2:2;narrow:8:64:32:4:2'; an entry rows:N pads query heads to at least N rows "
                    "(rows:16, as before MIN_QUERY_ROWS)")
    ap.add_argument("--profile", action="store_true", help="with --bounded: GPU and host time per kernel of a few "
                    "steady decode steps of each run")
    ap.add_argument("--skip-hf-batch", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="first compare batched engine outputs with single runs")
    ap.add_argument("--floor", action="store_true", help="with --offline: also the matmul + KV-read floor")
    args = ap.parse_args()
    try:
        tiles = tile_entries(args.packed_tiles)
        sweep = [(spec, tile_entries(spec)) for spec in args.tile_sweep.split(";")] if args.tile_sweep else []
    except ValueError as e:
        ap.error(f"--packed-tiles / --tile-sweep: {e}")
    use_tiles(tiles)
    dtype = torch.bfloat16
    checked = check(args.shape) if args.check else None
    hf, ours = models(args.shape, dtype)
    vocab = ours.config.vocab_size
    warm(ours, vocab)
    rows, res = [], {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "check": checked}
    if args.offline:
        import transformers
        res["transformers"] = transformers.__version__
        reqs = prompts(args.offline, args.input_len, vocab)
        blocks = args.offline * -(-(args.input_len + args.output_len) // 16) + 64
        sec, toks, dec, peak, stats = run_engine(ours, reqs, args.output_len, num_blocks=blocks,
                                                 max_num_seqs=args.offline)
        res["kvbound"] = dict(seconds=sec, tokens=toks, tok_s=toks / sec, decode_tok_s=dec, peak=peak)
        rows.append(("kvbound engine", args.offline, toks / sec, dec, peak))
        run_hf_generate(hf, reqs[:4], 4)  # warm
        sec, toks = run_hf_generate(hf, reqs, args.output_len)
        res["hf_generate"] = dict(seconds=sec, tokens=toks, tok_s=toks / sec)
        rows.append(("transformers generate()", args.offline, toks / sec, float("nan"), args.offline))
        if args.floor:
            fl = matmul_floor(ours, args.offline, args.input_len, args.output_len)
            res["floor"] = fl
            rows.append(("floor: matmuls + KV reads only", args.offline, fl["tok_s"], float("nan"), args.offline))
        if not args.skip_hf_batch:
            try:
                run_hf_batch(hf, reqs[:4], 4)
                sec, toks = run_hf_batch(hf, reqs, args.output_len)
                res["hf_generate_batch"] = dict(seconds=sec, tokens=toks, tok_s=toks / sec)
                rows.append(("transformers generate_batch", args.offline, toks / sec, float("nan"), float("nan")))
            except Exception as e:  # report, do not hide, a peer that fails here
                res["hf_generate_batch"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                rows.append((f"generate_batch failed: {type(e).__name__}", args.offline, float("nan"),
                             float("nan"), float("nan")))
    del hf
    torch.cuda.empty_cache()
    if args.bounded:
        from kvbound.cache.quant import MIXED, ring_bytes
        from kvbound.cli.options import token_bytes
        cfg = ours.config
        res["bounded"] = {"kv_gib": args.kv_gib, "context": args.context}
        for fmt in args.kv_formats.split(","):
            named = {"bf16": None, "fp8": "fp8", "mixed": MIXED}
            bits = named[fmt] if fmt in named else int(fmt)
            block_bytes = token_bytes(cfg, torch.bfloat16, bits, 64) * 16
            for name in split_strategies(args.policies):
                pol = parse_policy(name, args.budget)
                blocks = int(args.kv_gib * 2**30 // block_bytes)
                if fmt == "mixed":  # each sequence's window residuals come out of the same bytes
                    need = -(-(pol.budget + 1) // 16)
                    blocks = int(args.kv_gib * 2**30 // (need * block_bytes + ring_bytes(cfg, pol, 64))) * need
                label = name if fmt == "bf16" and args.kv_formats == "bf16" else f"{name}, {fmt}"
                caps = [args.max_bounded_seqs]
                bf16 = res["bounded"].get(f"{name}, bf16")
                if fmt != "bf16" and bf16 and bf16["running"] < caps[0]:
                    caps.append(bf16["running"])  # also at bf16's count: the per-sequence speed
                runs = [(c, "paged", 0) for c in caps[1:]]
                for st in args.kv_storage.split(","):
                    runs += [(caps[0], st, 0)] if st == "paged" else [(caps[0], st, int(m)) for m in
                                                                      args.page_mib.split(",")]
                for cap, storage, mib in runs:
                    block_pool.POOL_PAGE_BYTES = mib << 20
                    r = steady_decode(ours, pol, blocks, args.context, cap, vocab, kv_bits=bits, kv_storage=storage,
                                      profile=args.profile, tile_sweep=sweep, tiles=tiles)
                    key = label if cap == caps[0] else f"{label}, as many as bf16"
                    key += f", virtual {mib} MiB pages" if storage == "virtual" else ""
                    res["bounded"][key] = dict(r, blocks=blocks)
                    rows.append((f"{args.context}-token prompts, {key}", r["running"], float("nan"),
                                 r["decode_tok_s"], r["fit"], r["step_ms"], r["graph_ms"], r["write_ms"], r["map_ms"],
                                 r.get("map_ms_expected", float("nan")), r["committed_gib"], r["prefill_tok_s"]))
                    for spec, ms in r.get("graph_ms_tiles", {}).items():
                        rows.append((f"  tiles {spec}", r["running"], float("nan"), float("nan"), r["fit"],
                                     float("nan"), ms, float("nan"), float("nan"), float("nan"), float("nan"),
                                     float("nan")))
                    print(key, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"engine_{args.shape}.json"), "w") as f:
            json.dump(res, f, indent=2)
    print(f"\n{args.shape} on {res['device']}, bf16, random weights; offline: {args.input_len} in / "
          f"{args.output_len} out")
    print(f"{'run':<50} {'seqs':>6} {'out tok/s':>10} {'decode tok/s':>13} {'peak / fit':>11} {'step ms':>8} "
          f"{'graph ms':>9} {'write ms':>9} {'map ms':>8} {'map ms, growth':>14} {'GiB':>6} {'prefill tok/s':>14}")
    for name, n, tps, dec, peak, *step in rows:
        step = "".join(f" {x:>8.2f} " for x in step)
        print(f"{name:<50} {n:>6} {tps:>10.0f} {dec:>13.0f} {peak:>11}{step}")
    if "hf_generate" in res:
        print(f"kvbound / generate(): {res['kvbound']['tok_s'] / res['hf_generate']['tok_s']:.2f}x")
    if "floor" in res:
        fl = res["floor"]
        print(f"floor: prefill matmuls {fl['prefill_gemm_ms']:.0f} ms, decode step matmuls {fl['decode_gemm_ms']:.2f} ms "
              f"+ KV read {fl['decode_kv_ms']:.2f} ms (copy {fl['copy_gbs']:.0f} GB/s); at most "
              f"{fl['tok_s'] / res['hf_generate']['tok_s']:.2f}x generate() for any engine; kvbound reaches "
              f"{res['kvbound']['tok_s'] / fl['tok_s']:.0%} of the floor's rate")


if __name__ == "__main__":
    main()
