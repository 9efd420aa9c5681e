"""A few split-kernel calls of one KV format for Nsight Compute to count: instructions, shared and global loads,
stall reasons, occupancy. By default the 8B shape at 7 sequences x 4k keys in 8k-wide tables; `--narrow SHAPE:B`
instead B sequences of h2o 256's 257 keys in 272-wide tables, exporting scores as its evict step does.
`--tune-grid` times; this explains.

ncu --kernel-name _split_kernel --launch-skip 4 --launch-count 1 --metrics <list> \\
    python3 benchmarks/ncu_decode.py 8 [--staged] [--narrow 8b:32]
"""
import argparse

import torch

from decode_attention import SHAPES, packed, tune_inputs
from kvbound.kernels import decode_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("format", choices=["16", "8", "4", "fp8"])
    ap.add_argument("--staged", action="store_true", help="values staged (`Tile.staged`) in the table's tile")
    ap.add_argument("--narrow", metavar="SHAPE:B", help="B sequences of 257 keys in 272-wide tables, with scores")
    args = ap.parse_args()
    name, bsz, width, ctx = "8b", 7, 8192, 4096
    if args.narrow:
        name, _, b = args.narrow.partition(":")
        if name not in SHAPES or not b.isdigit() or int(b) < 1:
            ap.error(f"--narrow {args.narrow}: SHAPE:B with SHAPE one of {', '.join(SHAPES)} and B sequences")
        bsz, width, ctx = int(b), 272, 257
    sets, k, v, tables, lens, qs = tune_inputs(name, bsz, width, block=16)
    lens.fill_(ctx)
    scores = dict(score=torch.zeros(bsz, width, SHAPES[name][1], device="cuda"), score_mode="cumulative") \
        if args.narrow else {}
    fmt = args.format if args.format == "fp8" else int(args.format)
    kc, vc, quant = (k, v, None) if fmt == 16 else packed(k, v, fmt)
    for i in range(6):  # ncu skips the first four (compile, warm-up)
        decode_attention(qs[i % sets], kc, vc, tables[i % sets], lens, quant=quant, staged=args.staged or None,
                         **scores)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
