"""The merge kernel alone (`triton_merge.merge_victims`): each (sequence, KV head) merges its victim into its most
similar kept key, 64 rows x 257 keys in the SmolLM2 (3 KV heads, d 64) and 8B (8, d 128) shapes, observed's weight.
A CUDA graph of 50 launches (`decode_attention.timed`), the median of 20 replays: us a launch, per shape, format and
similarity-search tile (the default is `search_tile`'s choice; a tree older than `search_tile` runs its own tile,
and without `default` the tiles below are timed too). Run once per tree, with its src on PYTHONPATH:

    PYTHONPATH=src python3 benchmarks/merge_kernel.py after bf16,8,4,fp8 default
    PYTHONPATH=.before/src python3 benchmarks/merge_kernel.py before bf16,8,4,fp8     # before_after.py export REV
"""
import sys

import torch
from decode_attention import timed  # benchmarks/ is on the path as the script's folder

from kvbound.cache.quant import Fp8KV
from kvbound.kernels import triton_merge as tm
from kvbound.kernels.packing import quantize

SHAPES = {"smollm2": (64, 3, 64), "8b": (64, 8, 128)}
WIDTH = 257
FORMATS = [16 if f == "bf16" else f if f == "fp8" else int(f) for f in sys.argv[2].split(",")]


def setup(bsz, heads, d, bits, gen):
    slots = bsz * WIDTH
    k = torch.randn(slots, heads, d, device="cuda", generator=gen)
    v = torch.randn(slots, heads, d, device="cuda", generator=gen)
    quant = None
    if bits in (8, 4):
        kc, ks, kb = quantize(k, bits, 32)
        vc, vs, vb = quantize(v, bits, 32)
        quant = dict(bits=bits, group=32, k_scale=ks, k_bias=kb, v_scale=vs, v_bias=vb)
        k, v = kc, vc
    elif bits == "fp8":  # as the pool packs it
        (kc, ks), (vc, vs) = Fp8KV._pack(k), Fp8KV._pack(v)
        quant = dict(bits="fp8", k_scale=ks, v_scale=vs)
        k, v = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
    else:
        k, v = k.bfloat16(), v.bfloat16()
    table = torch.randperm(slots, device="cuda", generator=gen).view(bsz, WIDTH).to(torch.int32)
    rows = torch.arange(bsz, device="cuda")
    pos = torch.stack([torch.randperm(4000, device="cuda", generator=gen)[:WIDTH] + 4 for _ in range(bsz * heads)])
    pos = pos.view(bsz, heads, WIDTH).transpose(1, 2).contiguous().to(torch.int32)
    pos[:, :4] = torch.arange(4, device="cuda", dtype=torch.int32)[:, None]
    score = torch.rand(bsz, WIDTH, heads, device="cuda", generator=gen)
    count = torch.ones(bsz, WIDTH, heads, device="cuda")
    victim = torch.randint(4, WIDTH, (bsz, heads), device="cuda", generator=gen)
    lens = torch.full((bsz,), WIDTH, device="cuda", dtype=torch.int32)
    newest = pos.flatten(1).amax(1)
    return (k, v, table, rows, pos, score, count, victim, lens, 4, "age"), dict(newest=newest, quant=quant)


def main():
    tree = sys.argv[1]
    tiles = [None]
    if hasattr(tm, "search_tile") and sys.argv[3:] != ["default"]:
        default = tm.search_tile
        tiles = [None] + [dict(BLOCK=bl, num_warps=w, STAGES=s) for bl, w, s in (
            (64, 4, 1), (64, 4, 2), (128, 4, 1), (128, 4, 2))]
    for shape, (bsz, heads, d) in SHAPES.items():
        for bits in FORMATS:
            gen = torch.Generator(device="cuda").manual_seed(0)
            args, kw = setup(bsz, heads, d, bits, gen)
            for tile in tiles:
                if tile is not None:
                    if tile["BLOCK"] * d // (32 * tile["num_warps"]) > 256:
                        continue
                    tm.search_tile = lambda width, d, bits, fp8, t=tile: t
                try:
                    us = 1000 * timed(lambda _: tm.merge_victims(*args, **kw), 1, reps=50, rounds=20)
                except Exception as e:  # a tile that does not compile
                    print(f"{tree:6} {shape:8} {bits!s:4} {tile} FAILED {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                finally:
                    if tile is not None:
                        tm.search_tile = default
                name = "default" if tile is None else f"b{tile['BLOCK']}w{tile['num_warps']}s{tile['STAGES']}"
                print(f"{tree:6} {shape:8} {bits!s:4} {name:12} {us:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
