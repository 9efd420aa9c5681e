"""A few split-kernel calls of one KV format on the 8B shape (7 sequences x 4k keys in 8k-wide tables), for Nsight
Compute to count: instructions, shared and global loads, stall reasons. `--tune-grid` times; this explains.

ncu --kernel-name _split_kernel --launch-skip 4 --launch-count 1 --metrics <list> \\
    python3 benchmarks/ncu_decode.py 8 [--staged]
"""
import argparse

import torch

from decode_attention import packed, tune_inputs
from kvbound.kernels import decode_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("format", choices=["16", "8", "4", "fp8"])
    ap.add_argument("--staged", action="store_true", help="values staged (`Tile.staged`) in the table's tile")
    args = ap.parse_args()
    sets, k, v, tables, lens, qs = tune_inputs("8b", 7, 8192, block=16)
    lens.fill_(4096)
    fmt = args.format if args.format == "fp8" else int(args.format)
    kc, vc, quant = (k, v, None) if fmt == 16 else packed(k, v, fmt)
    for i in range(6):  # ncu skips the first four (compile, warm-up)
        decode_attention(qs[i % sets], kc, vc, tables[i % sets], lens, quant=quant, staged=args.staged or None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
