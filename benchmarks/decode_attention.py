"""Decode attention on the GPU: correctness and speed of the Triton kernels, side by side in one run.

    python benchmarks/decode_attention.py [--quick] [--e2e] [--out DIR]

For each shape (SmolLM2 9q/3kv d64; 8B 32q/8kv d128), batch (1/16/64) and context (1k/8k/32k):
  - achieved bandwidth of the bf16 kernel = bytes it must read (K+V of every sequence) / time, as a % of a
    device-to-device copy measured in the same run (bytes read + written / time);
  - score-export overhead: the same kernel with export on / off;
  - fused 8-bit and 4-bit kernels against dequantize-then-attend (gather + dequantize to bf16, then SDPA);
  - the kernel against PyTorch's scaled_dot_product_attention on the same dense data.
Inputs rotate among copies so that each timed call reads memory that is not in L2 (cold L2, as
FlashInfer measures). Each output is checked against SDPA / dequantize-then-attend before timing.
--e2e adds decode tokens/s of a randomly initialised 8B-shaped model through the engine (CUDA graphs),
batch 1/16/64: h2o evicting every step against the full cache at the same physical size.
--e2e-only skips the kernel table.
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvbound.kernels import decode_attention
from kvbound.kernels.packing import dequantize, quantize

SHAPES = {"smollm2": (9, 3, 64), "8b": (32, 8, 128)}


def timed(fn, n_sets, reps=20, rounds=5):
    """Median over rounds of the mean time per call (ms), cycling through n_sets input sets. The calls are
    captured in a CUDA graph and replayed, so launch overhead (Python, Triton's launcher) stays out of
    the kernel times; an engine replays its decode steps the same way."""
    for i in range(3):
        fn(i % n_sets)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    del graph
    return statistics.median(out)


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    # timed eagerly: inside a CUDA graph a copy becomes a memcpy node run by the copy engines, which
    # reached only ~2.7 TB/s on an H200 against ~4.3 TB/s for the SM copy kernel used eagerly
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 10
    del x, y
    return 2 * (2 << 30) / ms / 1e6  # GB/s, read + write


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def one_config(name, bsz, ctx, group=64):
    hq, hkv, d = SHAPES[name]
    per_set_slots = bsz * ctx
    bytes_per_slot = hkv * d * 2 * 2
    sets = max(1, min(16, math.ceil(256e6 / (per_set_slots * bytes_per_slot))))
    slots = per_set_slots * sets
    dev = "cuda"
    k = torch.randn(slots, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(slots, hkv, d, device=dev, dtype=torch.bfloat16)
    # paged-like slot tables: shuffled 16-token blocks, a disjoint region per input set
    tables = []
    for s in range(sets):
        blocks = torch.randperm(per_set_slots // 16, device=dev) * 16 + s * per_set_slots
        tables.append((blocks[:, None] + torch.arange(16, device=dev)).reshape(bsz, ctx).to(torch.int32))
    lens = torch.full((bsz,), ctx, device=dev, dtype=torch.int32)
    qs = [torch.randn(bsz, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    score = torch.zeros(bsz, ctx, hkv, device=dev, dtype=torch.float32)
    row = {"shape": name, "batch": bsz, "ctx": ctx, "sets": sets}

    # correctness first (set 0)
    kd = k[tables[0].long()]  # [B, ctx, Hkv, D]
    vd = v[tables[0].long()]
    sdpa_in = (qs[0][:, :, None], kd.transpose(1, 2), vd.transpose(1, 2))
    ref = F.scaled_dot_product_attention(*sdpa_in, enable_gqa=True)[:, :, 0]
    out = decode_attention(qs[0], k, v, tables[0], lens)
    row["err_bf16"] = rel(out, ref)
    out = decode_attention(qs[0], k, v, tables[0], lens, score=score, score_mode="cumulative")
    row["err_bf16_export"] = rel(out, ref)
    if bsz == 1:  # exported scores vs fp32 probabilities
        logits = torch.einsum("hgd,jhd->hgj", qs[0][0].float().view(hkv, hq // hkv, d), kd[0].float()) * d ** -0.5
        want = logits.softmax(-1).sum(1).T
        row["err_scores"] = rel(score[0], want)
    del kd, vd, sdpa_in

    bytes_dense = per_set_slots * bytes_per_slot
    t_off = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
    t_on = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens, score=score, score_mode="cumulative"), sets)
    row.update(ms_bf16=t_off, ms_bf16_export=t_on, gbs_bf16=bytes_dense / t_off / 1e6,
               export_overhead=t_on / t_off - 1)

    # SDPA on the same data, dense and contiguous per sequence
    dense = [(k[t.long()].transpose(1, 2).contiguous(), v[t.long()].transpose(1, 2).contiguous())
             for t in tables[:max(1, min(sets, 4))]] if bytes_dense * 2 * min(sets, 4) < 30e9 else None
    if dense is not None:
        nd = len(dense)
        row["ms_sdpa"] = timed(lambda i: F.scaled_dot_product_attention(
            qs[i % nd][:, :, None], dense[i % nd][0], dense[i % nd][1], enable_gqa=True), nd)
        del dense

    for bits in (8, 4):
        kc, ks, kb = quantize(k, bits, group)
        vc, vs, vb = quantize(v, bits, group)
        quant = dict(bits=bits, group=group, k_scale=ks, k_bias=kb, v_scale=vs, v_bias=vb)
        kdq, vdq = dequantize(kc, ks, kb, bits, group, torch.bfloat16), dequantize(vc, vs, vb, bits, group,
                                                                                  torch.bfloat16)
        ref_q = decode_attention(qs[0], kdq, vdq, tables[0], lens)
        del kdq, vdq
        out_q = decode_attention(qs[0], kc, vc, tables[0], lens, quant=quant)
        row[f"err_q{bits}"] = rel(out_q, ref_q)
        t_q = timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, quant=quant), sets)

        def deq_then_attend(i):
            idx = tables[i].long()
            kk = dequantize(kc[idx], ks[idx], kb[idx], bits, group, torch.bfloat16)
            vv = dequantize(vc[idx], vs[idx], vb[idx], bits, group, torch.bfloat16)
            return F.scaled_dot_product_attention(qs[i][:, :, None], kk.transpose(1, 2), vv.transpose(1, 2),
                                                  enable_gqa=True)
        t_dq = timed(deq_then_attend, sets, reps=5, rounds=3) if per_set_slots * hkv * d * 16 < 40e9 else float("nan")
        qbytes = per_set_slots * hkv * 2 * (d * bits // 8 + 4 * d // group)
        row.update({f"ms_q{bits}": t_q, f"gbs_q{bits}": qbytes / t_q / 1e6, f"ms_deq{bits}": t_dq})
        del kc, ks, kb, vc, vs, vb
    del k, v
    torch.cuda.empty_cache()
    return row


def e2e(batches=(1, 16, 64), budget=2048, steps=32, rounds=5, profile=False):
    """Decode tokens/s through the engine (CUDA graphs), random 8B-shaped weights: h2o (budget 2048,
    evicting every step: prompts longer than the budget) against the full cache holding about as many
    tokens (2048-token prompts). Both engines are built first, then timed in alternating rounds of
    `steps` steps; the median round counts."""
    from kvbound.models import ModelConfig
    from kvbound.engine import LLMEngine
    from kvbound.engine import SamplingParams
    from kvbound.models import CausalLM
    from kvbound.cache.policies import FullPolicy, H2OPolicy
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500000.0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = CausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    res = {}
    total = steps * (rounds + 1) + 64  # sequences that prefill first also decode during the others' prefill
    for bsz in batches:
        engines = {}
        full_len = budget - steps * (rounds + 2) // 2  # timed rounds hold budget tokens on average
        for name, pol, plen in [("full", FullPolicy(), full_len),
                                ("h2o", H2OPolicy(sink=4, heavy=budget // 2, recent=budget // 2 - 4), budget + 64)]:
            blocks = bsz * (-(-(plen + total) // 16)) + 8
            eng = LLMEngine(model, None, policy=pol, num_blocks=blocks, max_num_seqs=bsz, max_num_batched_tokens=8192,
                            prefill_chunk=512, graph_max_len=plen + total + 16)
            gen = torch.Generator().manual_seed(bsz)
            for _ in range(bsz):
                eng.add_request(torch.randint(0, cfg.vocab_size, (plen,), generator=gen).tolist(),
                                SamplingParams(max_tokens=total, ignore_eos=True))
            while eng.scheduler.waiting or any(s.to_feed() > 1 for s in eng.scheduler.running):
                eng.step()
            for _ in range(steps):  # warm: graphs replayed, every bounded cache evicting
                eng.step(only_finished=True)
            engines[name] = eng
        if profile and bsz in (batches[0], batches[-1]):  # GPU time per kernel of a few steps each
            from torch.profiler import ProfilerActivity, profile as torch_profile
            for name, eng in engines.items():
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(4):
                        eng.step(only_finished=True)
                    torch.cuda.synchronize()
                print(f"--- {name}, batch {bsz}, 4 steps")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))
        times = {name: [] for name in engines}
        for _ in range(rounds):
            for name, eng in engines.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(steps):
                    eng.step(only_finished=True)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
        row = {}
        for name, eng in engines.items():
            ms = statistics.median(times[name]) / steps * 1e3
            caches = [s.cache for s in eng.scheduler.running]
            assert len(caches) == bsz, f"{name}: {len(caches)} of {bsz} sequences still running"
            row[name] = {"ms_step": ms, "tok_s": bsz / ms * 1e3, "cache_tokens": len(caches[0]),
                         "graphs": eng.graphs is not None, "running": len(caches)}
        row["h2o_vs_full"] = row["h2o"]["tok_s"] / row["full"]["tok_s"]
        res[f"b{bsz}"] = row
        print(json.dumps({f"e2e b{bsz}": row}), flush=True)
        del engines
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return res


def tune_inputs(name, bsz, ctx, block=1, ordered=False):
    """Random bf16 K/V pools of enough input sets to exceed L2, slot tables of shuffled `block`-token
    blocks (`ordered`: in order, each sequence's keys one run of slots, as a pool that filled in order holds them),
    queries."""
    hq, hkv, d = SHAPES[name]
    slots = bsz * ctx
    sets = max(1, min(16, math.ceil(256e6 / (slots * hkv * d * 4))))
    k = torch.randn(slots * sets, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    first = torch.arange if ordered else torch.randperm
    tables = [((first(slots // block, device="cuda")[:, None] * block + torch.arange(block, device="cuda"))
               + s * slots).reshape(bsz, ctx).to(torch.int32) for s in range(sets)]
    lens = torch.full((bsz,), ctx, device="cuda", dtype=torch.int32)
    qs = [torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    return sets, k, v, tables, lens, qs


def tune():
    """bf16 kernel time for split factors (programs per SM), block sizes and warps on a few configurations."""
    print(f"{'shape':<8}{'B':>3}{'ctx':>6}{'pps':>4}{'blk':>4}{'warps':>6}{'ms':>8}{'GB/s':>7}")
    for name, bsz, ctx in [("8b", 1, 32768), ("8b", 16, 8192), ("8b", 16, 32768), ("smollm2", 16, 32768),
                           ("smollm2", 64, 8192)]:
        hq, hkv, d = SHAPES[name]
        slots = bsz * ctx
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx)
        for pps in (2, 4, 8, 16):
            for blk in (32, 64):
                for warps in (4, 8):
                    ms = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens, programs_per_sm=pps,
                                                          block_n=blk, num_warps=warps), sets)
                    print(f"{name:<8}{bsz:>3}{ctx:>6}{pps:>4}{blk:>4}{warps:>6}{ms:>8.3f}"
                          f"{slots * hkv * d * 4 / ms / 1e6:>7.0f}", flush=True)
        del k, v
        torch.cuda.empty_cache()


def packed(k, v, bits, group=64):
    """K and V pools as packed codes (or fp8 codes, bits "fp8"), and the `quant` argument of decode_attention that
    describes them."""
    if bits == "fp8":
        from kvbound.cache.quant import Fp8KV
        (kc, ks), (vc, vs) = Fp8KV._pack(k), Fp8KV._pack(v)
        return (kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn),
                dict(bits="fp8", k_scale=ks, v_scale=vs))
    kc, ks, kb = quantize(k, bits, group)
    vc, vs, vb = quantize(v, bits, group)
    return kc, vc, dict(bits=bits, group=group, k_scale=ks, k_bias=kb, v_scale=vs, v_bias=vb)


def head_major(quant):
    """`quant` with its scales and biases stored [Hkv, slots, groups] behind [slots, Hkv, groups] views: a program's
    keys (one head, a page of slots) then read their scales from a few sectors instead of one sector a key."""
    return {name: x.transpose(0, 1).contiguous().transpose(0, 1) if torch.is_tensor(x) else x
            for name, x in quant.items()}


def unpacked(kc, vc, quant):
    """The bf16 K and V that packed pools hold (what the kernel should attend over)."""
    if quant["bits"] == "fp8":
        from kvbound.cache.quant import Fp8KV
        return tuple(Fp8KV._unpack(c.view(torch.uint8), s, torch.bfloat16) for c, s in ((kc, quant["k_scale"]),
                                                                                         (vc, quant["v_scale"])))
    bits = quant["bits"]
    return (dequantize(kc, quant["k_scale"], quant["k_bias"], bits, 64, torch.bfloat16),
            dequantize(vc, quant["v_scale"], quant["v_bias"], bits, 64, torch.bfloat16))


def tried(label, run):
    """run() of one tuning point, or None after printing the label and why it failed (e.g. out of shared memory,
    which some tiles hit): a sweep goes on past such points."""
    try:
        return run()
    except Exception as e:
        print(f"{label}  {type(e).__name__}", flush=True)
        return None


def tune_quant(bits_list=(16, 8, 4), configs=None):
    """Fused 8/4-bit kernels against the bf16 kernel on the same slot tables (16-token blocks): key block
    size, warps and pipeline stages swept for each (the packed kernels convert codes with the fp16 bit
    trick; --tune-quant runs of earlier commits compared it with int->float conversions)."""
    print(f"{'shape':<8}{'B':>3}{'ctx':>6}{'bits':>5}{'blk':>4}{'w':>3}{'st':>3}{'ms':>8}{'vs bf16':>8}")
    tiles = {"8b": [(32, 4), (64, 1), (64, 2), (64, 4), (128, 2), (128, 4), (256, 4)],
             "smollm2": [(64, 4), (128, 2), (128, 4), (256, 4), (256, 8), (512, 4), (512, 8)]}
    configs = configs or [("8b", 16, 32768), ("8b", 64, 8192), ("8b", 1, 32768), ("smollm2", 64, 8192),
                          ("smollm2", 16, 32768)]
    for name, bsz, ctx in configs:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx, block=16)
        ref = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        for bits in bits_list:
            quant, want = None, None
            kc, vc = k, v
            if bits != 16:
                kc, vc, quant = packed(k, v, bits)
                kd, vd = unpacked(kc, vc, quant)
                want = decode_attention(qs[0], kd, vd, tables[0], lens)
                del kd, vd
            for blk, w in tiles[name]:
                for st in (2, 3):
                    kw = dict(quant=quant, block_n=blk, num_warps=w, num_stages=st)
                    label = f"{name:<8}{bsz:>3}{ctx:>6}{bits:>5}{blk:>4}{w:>3}{st:>3}"
                    err = 0.0 if quant is None else tried(
                        label, lambda: rel(decode_attention(qs[0], kc, vc, tables[0], lens, **kw), want))
                    ms = None if err is None else tried(
                        label, lambda: timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, **kw), sets))
                    if ms is not None:
                        print(f"{label}{ms:>8.3f}{ms / ref:>8.2f}  err {err:.1e}", flush=True)
            del kc, vc
        del k, v
        torch.cuda.empty_cache()


def tune_split():
    """Split factor (programs per SM) of the bf16 and packed kernels at their default tiles: packed programs
    have 2 warps, so more of them fit on an SM than the 4 per SM the bf16 kernel was tuned with."""
    print(f"{'shape':<8}{'B':>3}{'ctx':>6}{'bits':>5}{'pps':>4}{'ms':>8}{'vs bf16':>8}")
    for name, bsz, ctx in [("8b", 16, 32768), ("8b", 64, 8192), ("8b", 1, 32768), ("8b", 16, 8192),
                           ("smollm2", 64, 8192), ("smollm2", 16, 32768)]:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx, block=16)
        ref = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        for bits in (16, 8, 4):
            kc, vc, quant = packed(k, v, bits) if bits != 16 else (k, v, None)
            for pps in (2, 4, 8, 16, 32):
                ms = timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, quant=quant,
                                                      programs_per_sm=pps), sets)
                print(f"{name:<8}{bsz:>3}{ctx:>6}{bits:>5}{pps:>4}{ms:>8.3f}{ms / ref:>8.2f}", flush=True)
            del kc, vc
        del k, v
        torch.cuda.empty_cache()


def tune_export():
    """Export on against off (the default tile) for key-block sizes, warps and programs per SM of the kernel
    with export, at the shapes of the end-to-end run (8B, 2k keys) and of the table."""
    print(f"{'shape':<8}{'B':>3}{'ctx':>6}{'blk':>4}{'w':>3}{'pps':>4}{'off ms':>8}{'on ms':>8}{'on/off':>8}")
    for name, bsz, ctx in [("8b", 64, 2048), ("8b", 16, 2048), ("8b", 16, 8192), ("8b", 64, 8192),
                           ("smollm2", 64, 8192), ("smollm2", 16, 32768)]:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx, block=16)
        score = torch.zeros(bsz, ctx, SHAPES[name][1], device="cuda")
        off = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        for blk, w in [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]:
            for pps in (4, 8):
                kw = dict(block_n=blk, num_warps=w, programs_per_sm=pps, score=score, score_mode="cumulative")
                on = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens, **kw), sets)
                print(f"{name:<8}{bsz:>3}{ctx:>6}{blk:>4}{w:>3}{pps:>4}{off:>8.3f}{on:>8.3f}{on / off:>8.3f}",
                      flush=True)
        del k, v
        torch.cuda.empty_cache()


def tune_grid(configs, bits_list, variants=None, ordered=False):
    """Tiles and split sizes (keys per program) of every format on the engine's tables, which are wider than
    their contexts (a graph's width bucket): `configs` of (shape, batch, context, table width, export). With
    export the call also scores (cumulative), as h2o's step does. Each row against bf16's default call.
    variants: instead of the grid, these tiles (keys, warps, stages, programs per SM, `tile_flags`) beside the default.
    ordered: slot tables in order instead of shuffled blocks (`tune_inputs`)."""
    print(f"{'shape':<8}{'B':>4}{'ctx':>6}{'width':>6}{'bits':>5}{'blk':>4}{'w':>3}{'st':>3}{'split':>6}{'ms':>8}"
          f"{'vs bf16':>8}")
    tiles = {64: [(32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 2), (128, 4, 2)],
             128: [(32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 2, 2), (128, 4, 2), (128, 8, 2)]}
    for name, bsz, ctx, width, export in configs:
        d, hkv = SHAPES[name][2], SHAPES[name][1]
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, width, block=16, ordered=ordered)
        lens.fill_(ctx)
        score = torch.zeros(bsz, width, hkv, device="cuda") if export else None
        base = dict(score=score, score_mode="cumulative") if export else {}
        ref = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens, **base), sets)
        for bits in bits_list:
            kc, vc, quant = packed(k, v, bits) if bits != 16 else (k, v, None)
            splits = (lambda blk: [blk * m for m in (1, 2, 4, 8) if blk * m <= width]) if width < 4096 else \
                (lambda blk: [256, 512, 1024, 2048, 4096])
            runs = [(f"{'def':>4}{'':>6}{'def':>6}", {})]
            if bits in (8, 4):  # the default tile with codes converted the portable way (`Tile.permute`), and
                # with scales and biases stored head by head (`head_major`)
                runs.append((f"{'def':>4}{'':>6}{'def':>6}   -", dict(permute=False)))
                runs.append((f"{'def':>4}{'':>6}{'def':>6}   H", dict(quant=head_major(quant))))
            if variants is None:
                runs += [(f"{blk:>4}{w:>3}{st:>3}{split:>6}", dict(block_n=blk, num_warps=w, num_stages=st, split=split))
                         for blk, w, st in tiles[d] for split in splits(blk)]
            else:
                runs += [(f"{blk:>4}{w:>3}{st:>3}{split_label(pps):>6} {flags_label(flags)}",
                          dict(block_n=blk, num_warps=w, num_stages=st, **split_or_programs(blk, pps),
                               **{**flags, "permute": flags["permute"] and bits != 16,
                                  "staged": flags["staged"] and bits != 16,
                                  "value_dot": flags["value_dot"] if bits in (8, 4) else None}))
                         for blk, w, st, pps, flags in variants]
            for tile, run in runs:
                kw = {**base, "quant": quant, **run}
                label = f"{name:<8}{bsz:>4}{ctx:>6}{width:>6}{bits!s:>5}{tile}"
                ms = tried(label, lambda: timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, **kw), sets))
                if ms is not None:
                    print(f"{label}{ms:>8.4f}{ms / ref:>8.2f}", flush=True)
            del kc, vc
        del k, v
        torch.cuda.empty_cache()


def split_label(pps) -> str:
    """A variant's programs per SM (ppsN) or blocks a program (sN), for a table's row."""
    return pps if isinstance(pps, str) else f"pps{pps}"


def split_or_programs(block_n: int, pps) -> dict:
    """A variant's programs per SM, or (sN) its split of N blocks a program, as `decode_attention` keywords."""
    return dict(split=block_n * int(pps[1:])) if isinstance(pps, str) else dict(programs_per_sm=pps)


def value_dot_grid(configs, bits_list):
    """Packed values read as (p * scale) @ codes per group (value_dot on) or dequantized (off), and the kernel's
    choice (None), on `configs` of (shape, batch, context, table width), each against bf16's default call."""
    print(f"{'shape':<8}{'B':>4}{'ctx':>7}{'width':>7}{'bits':>5}{'value_dot':>10}{'ms':>9}{'vs bf16':>8}")
    for name, bsz, ctx, width in configs:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, width, block=16)
        lens.fill_(ctx)
        ref = timed(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        for bits in bits_list:
            kc, vc, quant = packed(k, v, bits)
            for value_dot in (None, True, False):
                ms = timed(lambda i: decode_attention(qs[i], kc, vc, tables[i], lens, quant=quant, value_dot=value_dot),
                           sets)
                print(f"{name:<8}{bsz:>4}{ctx:>7}{width:>7}{bits!s:>5}{value_dot!s:>10}{ms:>9.4f}{ms / ref:>8.2f}",
                      flush=True)
            del kc, vc
        del k, v
        torch.cuda.empty_cache()


def tune_configs(spec: str, fields: int) -> list:
    """shape:int:int...,... -> [(shape, int, ...)], each entry `fields` long (shape first)."""
    configs = []
    for entry in spec.split(","):
        parts = entry.split(":")
        if len(parts) != fields or parts[0] not in SHAPES or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{entry!r} is not {':'.join(['shape'] + ['int'] * (fields - 1))} with shape one of "
                             f"{', '.join(SHAPES)}")
        configs.append((parts[0], *map(int, parts[1:])))
    return configs


TILE_FLAGS = "paired[:permute[:staged[:pairs[:early[:value_dot[:key_dequant[:max_regs]]]]]]]"
FLAG_CHOICES = {"paired": ("-", "k", "v", "kv"), "permute": ("p", "-"), "staged": ("s", "-"), "pairs": ("b", "-"),
                "early": ("e", "-"), "value_dot": ("d", "n", "-"), "key_dequant": ("q", "-")}


def tile_flags(tokens: list) -> dict:
    """A tile spec's trailing flags -> `Tile` fields: paired k, v, kv or - (`Tile.paired`), permute p (the default) or
    -, staged s or - (the default), pairs b or - (the default), early e or - (the default), value_dot d (on), n (off)
    or - (the kernel's rule, the default), key_dequant q or - (the default), max_regs rN (N registers a thread) or -
    (the compiler's, the default). Shared by this script's --tile-variants and the engine's --packed-tiles."""
    defaults = ["-", "p", "-", "-", "-", "-", "-", "-"]
    if len(tokens) > len(defaults):
        raise ValueError(f"{':'.join(tokens)!r}: at most {len(defaults)} flags, {TILE_FLAGS}")
    tokens = list(tokens) + defaults[len(tokens):]
    for (name, choices), token in zip(FLAG_CHOICES.items(), tokens):
        if token not in choices:
            raise ValueError(f"{name} {token!r}: choose from {', '.join(choices)}")
    paired, permute, staged, pairs, early, value_dot, key_dequant, max_regs = tokens
    if max_regs != "-" and not (max_regs[:1] == "r" and max_regs[1:].isdigit() and 24 <= int(max_regs[1:]) <= 255):
        raise ValueError(f"max_regs {max_regs!r}: rN with N registers from 24 to 255, or -")
    return dict(paired=paired.strip("-"), permute=permute == "p", staged=staged == "s", pairs=pairs == "b",
                early=early == "e", value_dot={"d": True, "n": False, "-": None}[value_dot],
                key_dequant=key_dequant == "q", max_regs=None if max_regs == "-" else int(max_regs[1:]))


def flags_label(flags: dict) -> str:
    """The flags as `tile_flags` reads them, for a table's row."""
    return ":".join((flags["paired"] or "-", "p" if flags["permute"] else "-", "s" if flags["staged"] else "-",
                     "b" if flags["pairs"] else "-", "e" if flags["early"] else "-",
                     {True: "d", False: "n", None: "-"}[flags["value_dot"]], "q" if flags["key_dequant"] else "-",
                     "-" if flags["max_regs"] is None else f"r{flags['max_regs']}"))


def tile_variants(spec: str) -> list:
    """keys:warps:stages:programs_per_sm[:TILE_FLAGS],... -> [(keys, warps, stages, programs per SM, flags)], the
    flags as `tile_flags` reads them; programs_per_sm sN instead gives each program N blocks (`Tile.split_blocks`),
    as a string."""
    variants = []
    for entry in spec.split(","):
        parts = entry.split(":")
        if len(parts) < 4 or not all(p.isdigit() for p in parts[:3] + [parts[3].removeprefix("s")]):
            raise ValueError(f"{entry!r} is not keys:warps:stages:programs_per_sm[:{TILE_FLAGS}] (programs_per_sm "
                             "sN: N blocks a program)")
        pps = parts[3] if parts[3].startswith("s") else int(parts[3])
        variants.append((*map(int, parts[:3]), pps, tile_flags(parts[4:])))
    return variants


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small config per shape")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-only", action="store_true")
    ap.add_argument("--e2e-batches", default="1,16,64", help="batch sizes of the e2e comparison")
    ap.add_argument("--profile", action="store_true", help="with --e2e: GPU time per kernel at batch 1")
    ap.add_argument("--tune", action="store_true", help="only sweep split factor / block / warps (bf16 kernel)")
    ap.add_argument("--tune-quant", action="store_true", help="only sweep the fused 8/4-bit kernel variants")
    ap.add_argument("--quant-bits", default="16,8,4", help="with --tune-quant: which widths to sweep (16, 8, 4, fp8)")
    ap.add_argument("--tune-configs", help="with --tune-quant: shape:batch:ctx,... instead of the default five")
    ap.add_argument("--tune-split", action="store_true", help="only sweep programs per SM, bf16 and packed")
    ap.add_argument("--tune-export", action="store_true", help="only sweep the tile of the kernel with export")
    ap.add_argument("--tune-grid", help="only sweep tiles and split sizes of every format (--quant-bits) on "
                    "shape:batch:context:width:export,... (export 0/1), e.g. smollm2:64:257:272:1 (h2o 256 at 64 "
                    "running, as the engine's graph calls it)")
    ap.add_argument("--tile-variants", help="with --tune-grid: time these tiles beside the default call instead of "
                    f"the grid, keys:warps:stages:programs_per_sm[:{TILE_FLAGS}],... (programs_per_sm sN: N blocks "
                    "a program; paired k, v, kv or -; "
                    "permute p, the default, or -; staged s or -; pairs b or -; early e or -; value_dot d, n or -; "
                    "key_dequant q or -), "
                    "e.g. 64:4:2:4,64:4:2:8:-:-,64:4:2:4:-:p:-:b:e; packed formats also time their default tile "
                    "without permute")
    ap.add_argument("--ordered-blocks", action="store_true", help="with --tune-grid: each sequence's blocks in "
                    "order in the pool instead of shuffled (a pool filled in order, as the engine's often is)")
    ap.add_argument("--value-dot-grid", help="only time packed values read with value_dot on, off and the kernel's "
                    "choice (--quant-bits 8 / 4) on shape:batch:context:width,..., e.g. 8b:7:4096:8192")
    ap.add_argument("--query-rows", type=int, default=None, help="pad each program's query heads to at least this "
                    "many rows (triton_decode.MIN_QUERY_ROWS; 16 as before it)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.query_rows is not None:
        if args.query_rows < 1:
            ap.error(f"--query-rows {args.query_rows}: at least 1")
        from kvbound.kernels import triton_decode
        triton_decode.MIN_QUERY_ROWS = args.query_rows
    try:
        if not set(args.quant_bits.split(",")) <= {"16", "8", "4", "fp8"}:
            raise ValueError(f"{args.quant_bits!r}: widths are 16, 8, 4 or fp8")
        bits_list = [b if b == "fp8" else int(b) for b in args.quant_bits.split(",")]
        quant_configs = tune_configs(args.tune_configs, 3) if args.tune_configs else None
        grid_configs = tune_configs(args.tune_grid, 5) if args.tune_grid else None
        variants = tile_variants(args.tile_variants) if args.tile_variants else None
        value_dot_configs = tune_configs(args.value_dot_grid, 4) if args.value_dot_grid else None
    except ValueError as e:
        ap.error(f"--quant-bits / --tune-configs / --tune-grid / --tile-variants / --value-dot-grid: {e}")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.tune:
        return tune()
    if args.tune_quant:
        return tune_quant(bits_list, quant_configs)
    if args.tune_split:
        return tune_split()
    if args.tune_grid:
        return tune_grid(grid_configs, bits_list, variants, args.ordered_blocks)
    if args.value_dot_grid:
        return value_dot_grid(value_dot_configs, bits_list)
    if args.tune_export:
        return tune_export()
    copy = copy_bandwidth()
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    batches, ctxs = ([1, 16], [1024, 8192]) if args.quick else ([1, 16, 64], [1024, 8192, 32768])
    for name in SHAPES if not args.e2e_only else []:
        for bsz in batches:
            for ctx in ctxs:
                t0 = time.time()
                row = one_config(name, bsz, ctx)
                row["pct_copy_bf16"] = 100 * row["gbs_bf16"] / copy
                rows.append(row)
                print(json.dumps(row), f"({time.time() - t0:.1f}s)", flush=True)
    result = {"copy_gbs": copy, "rows": rows}
    if args.e2e or args.e2e_only:
        args.e2e = True
        result["e2e"] = e2e(batches=[int(b) for b in args.e2e_batches.split(",")], profile=args.profile)
        print(json.dumps(result["e2e"]), flush=True)
    with open(os.path.join(args.out, "decode_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ncopy {copy:.0f} GB/s. times in ms; bw = bytes to read / time; export = on/off - 1; "
          f"q8/q4 = fused quantized kernels; deq = dequantize-then-attend; sdpa = torch SDPA on dense data")
    print(f"{'shape':<8}{'B':>3}{'ctx':>6} {'bf16':>7} {'%copy':>6} {'export':>7} {'q8':>7} {'deq8':>7} "
          f"{'q4':>7} {'deq4':>7} {'sdpa':>7} {'err':>8}")
    for r in rows:
        print(f"{r['shape']:<8}{r['batch']:>3}{r['ctx']:>6} {r['ms_bf16']:>7.3f} {r['pct_copy_bf16']:>5.0f}% "
              f"{100 * r['export_overhead']:>+6.1f}% {r['ms_q8']:>7.3f} {r['ms_deq8']:>7.3f} {r['ms_q4']:>7.3f} "
              f"{r['ms_deq4']:>7.3f} {r.get('ms_sdpa', float('nan')):>7.3f} "
              f"{max(r['err_bf16'], r['err_q8'], r['err_q4']):>8.1e}")
    if args.e2e:
        print("e2e 8B-shape decode through the engine (CUDA graphs): ms per step, h2o/full throughput")
        for b, e in result["e2e"].items():
            print(f"  {b:>4}: full {e['full']['ms_step']:.2f} ms ({e['full']['cache_tokens']} tokens), "
                  f"h2o {e['h2o']['ms_step']:.2f} ms ({e['h2o']['cache_tokens']} tokens), "
                  f"ratio {e['h2o_vs_full']:.3f}")


if __name__ == "__main__":
    main()
