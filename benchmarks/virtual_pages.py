"""Virtual-memory KV storage (issue #20): what the CUDA driver's mappings cost, and the memory each storage
commits as a sequence grows.

  map / unmap   microseconds per page for cuMemMap + cuMemSetAccess and for cuMemUnmap (the unmap includes the
                stream sync it needs), over --pages pages, on the real backend (`CudaPages`)
  committed     bytes committed against sequence length for one sequence of the shape: dense pre-allocation of
                the whole context (llama.cpp-style), the paged pool (16-token blocks) and virtual storage
                (pages mapped by `VirtualPages.grow`, the real backend's page size), layer-major and
                token-major; with a window, the layer-major storage's after `drop_before` too

PYTHONPATH=src python benchmarks/virtual_pages.py --out $OUT         (on the GPU; --backend host simulates)
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvbound.cache.virtual import HostPages, VirtualPages

SHAPES = {"qwen3-0.6b": dict(layers=28, kv_heads=8, head_dim=128, context=40960),
          "llama-8b": dict(layers=32, kv_heads=8, head_dim=128, context=131072)}


def mapping_cost(backend, pages: int) -> dict:
    """Mean microseconds per page to map (with access) and to unmap, over one range of `pages` pages."""
    handles = [backend.create() for _ in range(pages)]
    rng = backend.reserve(pages)
    t0 = time.perf_counter()
    for i, h in enumerate(handles):
        backend.map(rng, i, h)
    t1 = time.perf_counter()
    for i in range(pages):
        backend.unmap(rng, i)
    t2 = time.perf_counter()
    backend.free(rng)
    for h in handles:
        backend.release(h)
    return {"pages": pages, "map_us": (t1 - t0) / pages * 1e6, "unmap_us": (t2 - t1) / pages * 1e6}


def committed(backend, shape: dict, lengths: list[int], window: int | None, token_major: bool = False) -> list[dict]:
    """Committed bytes as one sequence grows. Layer-major: one region per layer and K / V, so each grows page by
    page on its own (a page holds page_bytes / token_bytes tokens of one layer); token-major: one region, every
    layer's K and V of a token side by side (a page holds a few tokens of all layers; kernels read a layer
    with a token stride)."""
    token_bytes = shape["kv_heads"] * shape["head_dim"] * 2  # bf16, one of K or V in one layer
    regions = 2 * shape["layers"]
    if token_major:
        token_bytes, regions = token_bytes * regions, 1
    vp = VirtualPages(backend, regions, token_bytes, shape["context"])
    vp.add("seq")
    rows = []
    for n in lengths:
        vp.grow("seq", n)
        if window is not None and n > window:
            vp.drop_before("seq", n - window)
        rows.append({"tokens": n, "dense": shape["context"] * token_bytes * regions,
                     "paged": -(-n // 16) * 16 * token_bytes * regions,
                     "virtual": vp.pages_in_use * backend.page_bytes, "maps": vp.counts["mapped"]})
    vp.release("seq")
    vp.trim()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "host", choices=["cuda", "host"])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--window", type=int, default=4096)
    args = ap.parse_args()
    if args.backend == "cuda":
        from kvbound.cache.virtual import CudaPages
        backend = CudaPages()
    else:
        backend = HostPages()
    shape = SHAPES[args.shape]
    cost = mapping_cost(backend, args.pages)
    lengths = [2 ** k for k in range(6, 16)] + [shape["context"]]
    full = committed(backend, shape, lengths, None)
    windowed = committed(backend, shape, lengths, args.window)
    tokmajor = committed(backend, shape, lengths, None, token_major=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"virtual_pages_{args.shape}_{args.backend}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"args": vars(args), "page_bytes": backend.page_bytes, "cost": cost, "full": full,
                   "window": windowed, "token_major": tokmajor}, f, indent=2)
    mib = 1 << 20
    print(f"{args.shape}, backend {args.backend}, page {backend.page_bytes // 1024} KiB: map {cost['map_us']:.1f} us "
          f"/ unmap {cost['unmap_us']:.1f} us per page (over {cost['pages']} pages)")
    print(f"{'tokens':>7} {'dense MiB':>10} {'paged MiB':>10} {'virtual MiB':>12} {'maps':>6} "
          f"{'window ' + str(args.window):>12} {'token-major':>12} {'maps':>6}")
    for a, b, c in zip(full, windowed, tokmajor):
        print(f"{a['tokens']:>7} {a['dense'] / mib:>10.0f} {a['paged'] / mib:>10.1f} {a['virtual'] / mib:>12.1f} "
              f"{a['maps']:>6} {b['virtual'] / mib:>12.1f} {c['virtual'] / mib:>12.1f} {c['maps']:>6}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["tokens"] for r in full]
    for key, label in [("dense", "dense pre-allocation"), ("paged", "paged pool (16-token blocks)"),
                       ("virtual", "virtual storage")]:
        ax.plot(x, [r[key] / mib for r in full], marker="o", label=label)
    ax.plot(x, [r["virtual"] / mib for r in windowed], marker="x", label=f"virtual, window {args.window}")
    ax.plot(x, [r["virtual"] / mib for r in tokmajor], marker=".", label="virtual, token-major")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="committed KV memory (MiB)",
           title=f"{args.shape}: memory committed for one sequence")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, name + ".png"), dpi=120)


if __name__ == "__main__":
    main()
