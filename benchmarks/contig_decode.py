"""Decode attention over per-sequence contiguous buffers in virtual memory against the paged kernel (issue #20).

    PYTHONPATH=src:benchmarks python3 benchmarks/contig_decode.py --out $OUT      (on the GPU)

For each shape (SmolLM2 9q/3kv d64; 8B 32q/8kv d128), batch (1/16/64) and context (8k/16k/32k), one layer's
bf16 decode kernel (`kernels.decode_attention`, no score export) reads 64 sequences' K/V three ways:
  - paged: a cudaMalloc pool in 16-token blocks, handed out shuffled (a pool that has served for a while),
    read through the [B, context] slot table;
  - virtual, table: each sequence's buffer is one run of slots in a reserved range whose 2 MiB pages are
    mapped (`CudaPages`), read through the same kind of table (base + j);
  - virtual, contiguous: the same buffers with `contiguous=True`, which reads no table (a [B, 1] column).
Batches smaller than 64 rotate over the 64 sequences, so each timed call reads memory that is not in L2.
Times are CUDA-graph replays (`decode_attention.timed`); outputs are checked against the paged ones first.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from decode_attention import SHAPES, timed
from kvbound.cache.virtual import CudaPages
from kvbound.kernels import decode_attention

SEQS, BLOCK = 64, 16


def virtual_buffer(pages: CudaPages, shape, dtype=torch.bfloat16):
    """A tensor of `shape` over a fresh reserved range with every page mapped, and what to free it with."""
    count = -(-math.prod(shape) * torch.empty((), dtype=dtype).element_size() // pages.page_bytes)
    rng, handles = pages.reserve(count), [pages.create() for _ in range(count)]
    for i, h in enumerate(handles):
        pages.map(rng, i, h)

    def free():
        for i in range(count):
            pages.unmap(rng, i)
        for h in handles:
            pages.release(h)
        pages.free(rng)
    return pages.tensor(rng, 0, shape, dtype), free


def one_context(pages, hq, hkv, d, ctx, batches, gen, stages=()):
    """Rows of kernel times for one shape and context, over every batch size."""
    slots = SEQS * ctx
    paged_k = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    paged_v = torch.randn_like(paged_k)
    virt_k, free_k = virtual_buffer(pages, (slots, hkv, d))
    virt_v, free_v = virtual_buffer(pages, (slots, hkv, d))
    blocks = torch.randperm(slots // BLOCK, device="cuda", generator=gen).view(SEQS, ctx // BLOCK)
    paged_table = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device="cuda")).view(SEQS, ctx).int()
    virt_k.copy_(paged_k[paged_table.view(-1).long()])  # the same keys, each sequence's now in one run
    virt_v.copy_(paged_v[paged_table.view(-1).long()])
    base = (torch.arange(SEQS, device="cuda", dtype=torch.int32) * ctx)[:, None]
    virt_table = base + torch.arange(ctx, device="cuda", dtype=torch.int32)
    rows = []
    for bsz in batches:
        sets = SEQS // bsz
        q = torch.randn(sets, bsz, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((bsz,), ctx, device="cuda", dtype=torch.int32)
        outs = [torch.empty(bsz, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        ways = {"paged": (paged_k, paged_v, paged_table, False, None),
                "virtual, table": (virt_k, virt_v, virt_table, False, None),
                "virtual, contiguous": (virt_k, virt_v, base.expand(-1, ctx), True, None)}
        ways.update({f"contiguous, {s} stages": (virt_k, virt_v, base.expand(-1, ctx), True, s) for s in stages})

        def call(way, i):
            k, v, table, contiguous, *st = ways[way]
            return decode_attention(q[i], k, v, table[i * bsz:(i + 1) * bsz], lens, out=outs[i],
                                    contiguous=contiguous, num_stages=st[0] if st else None)
        want = call("paged", 0).clone()
        row = {"batch": bsz, "context": ctx}
        for way in ways:
            got = call(way, 0)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            row[way] = timed(lambda i, w=way: call(w, i), sets)
        row["contiguous / paged"] = row["virtual, contiguous"] / row["paged"]
        rows.append(row)
        print(f"{bsz:>6} {ctx:>8} {row['paged'] * 1e3:>10.1f} {row['virtual, table'] * 1e3:>15.1f} "
              f"{row['virtual, contiguous'] * 1e3:>20.1f} {row['contiguous / paged']:>19.3f}"
              + "".join(f" {s}st {row[f'contiguous, {s} stages'] * 1e3:.1f}" for s in stages), flush=True)
    del paged_k, paged_v, virt_k, virt_v
    torch.cuda.synchronize()
    free_k()
    free_v()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="smollm2,8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--tune-stages", default="", help="also time the contiguous kernel at these pipeline depths")
    args = ap.parse_args()
    pages = CudaPages()
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    stages = [int(s) for s in args.tune_stages.split(",") if s]
    table = {}
    for name in args.shapes.split(","):
        hq, hkv, d = SHAPES[name]
        print(f"{name} ({hq}q/{hkv}kv d{d}), bf16, kernel time in us")
        print(f"{'batch':>6} {'context':>8} {'paged':>10} {'virtual, table':>15} {'virtual, contiguous':>20} "
              f"{'contiguous / paged':>19}", flush=True)
        table[name] = [r for ctx in args.contexts.split(",") for r in one_context(pages, hq, hkv, d, int(ctx),
                                                                                    batches, gen, stages)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "contig_decode.json"), "w") as f:
        json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
