"""The decode split kernel compiled for sm_90 on the CPU, no GPU needed: registers a thread, spill instructions,
SASS instructions and shared bytes of one tile on a narrow call (h2o 256's 272-wide tables, scores exported). It
specializes arguments as the runtime does (pointers and multiples of 16 divisible by 16, ones constant), so with
the device's Triton version its counts equal Nsight Compute's there (results/codegen_narrow_regs_sm90.log).

PYTHONPATH=src:<Triton 3.6 installed apart> python3 benchmarks/kernel_registers.py '{"bits": 8, "pairs": true}' ...
Each config is JSON: shape (8b or smollm2), bits (16, 8, 4 or "fp8"), rows (query rows; G's power of two by
default), and any field of `Tile` (keys, warps, stages, pairs, early, key_dequant, value_dot, permute, paired,
max_regs) over the tile the kernel takes for that format's narrow call (`kernel_tile`). One line each: registers,
spill instructions, SASS instructions, shared bytes, the most common opcodes.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from decode_attention import SHAPES  # query heads, KV heads, head_dim; benchmarks/ is on the path as the script's
from kvbound.kernels import triton_decode
WIDTH, SEQS = 272, 64
KEYS = {"shape", "bits", "rows", *triton_decode.Tile._fields} - {"split_blocks", "programs_per_sm", "staged"}


def int_args(hq, hkv, d, bits, fp8, keys, split):
    """The narrow call's integer arguments, as `decode_attention` passes them (bf16 reads no scales: strides 0)."""
    row = d if bits in (16, 8) or fp8 else d // 2
    groups = 1 if fp8 else (0 if bits == 16 else d // 64)
    blocks, splits = -(-WIDTH // keys), -(-WIDTH // split)
    zeros = ("stride_rpr", "stride_rpj", "stride_rks", "stride_rkh", "stride_rss", "stride_rsh", "ring_row_entries",
             "stride_cb", "stride_cn")
    return dict(stride_qb=hq * d, stride_qh=d, stride_ks=hkv * row, stride_kh=row, stride_ss=hkv * groups,
                stride_sh=groups, stride_tb=WIDTH, stride_ob=hq * splits * d, stride_oh=splits * d, stride_os=d,
                stride_mb=hq * splits, stride_mh=splits, stride_eb=hq * WIDTH, stride_eh=WIDTH, stride_xb=hq * blocks,
                stride_xh=blocks, split=min(split, 4 * keys), **dict.fromkeys(zeros, 0))


def compile_tile(cfg: dict):
    """The compiled kernel of one config: its fields over the format's narrow tile."""
    hq, hkv, d = SHAPES[cfg.get("shape", "8b")]
    g = hq // hkv
    fmt = cfg.get("bits", 8)
    tile = triton_decode.kernel_tile(fmt, d, SEQS, WIDTH, cuda=True, scores=True)
    tile = tile._replace(**{k: v for k, v in cfg.items() if k in tile._fields})
    bits, fp8 = (16, True) if fmt == "fp8" else (fmt, False)
    value_dot = (d == 128 and bits in (8, 4)) if tile.value_dot is None else tile.value_dot and bits in (8, 4)
    consts = dict(G=g, G_PAD=cfg.get("rows") or triton.next_power_of_2(g), D=d, BLOCK_N=tile.keys, BITS=bits,
                  GS=64 if bits in (8, 4) else d, EXPORT=True, IEEE=False, VDOT=value_dot, FP8=fp8, CONTIG=False,
                  RESID=False, SINK=0, RECENT=0, PAIR_K="k" in tile.paired, PAIR_V="v" in tile.paired,
                  PERMUTE=tile.permute, STAGED=False, PAIRS=tile.pairs and value_dot and bits == 8, EARLY=tile.early,
                  KDEQ=tile.key_dequant and bits in (8, 4), COUNT=False, COUNT_ROWS=False)
    code = "*fp8e4nv" if fp8 else ("*bf16" if bits == 16 else "*u8")
    pointers = dict(Q="*bf16", K=code, V=code, E="*fp16", PartO="*fp32", PartM="*fp32", PartL="*fp32", MBlk="*fp32",
                    Count="*fp32", **dict.fromkeys(("KS", "KB", "VS", "VB", "RKS", "RKB", "RVS", "RVB"), "*fp16"),
                    **dict.fromkeys(("RK", "RV"), "*u8"),
                    **dict.fromkeys(("SlotTable", "CtxLen", "RPos", "RRows", "RFirst", "CountRows"), "*i32"))
    ints = int_args(hq, hkv, d, bits, fp8, tile.keys, (tile.split_blocks or 4) * tile.keys)
    fn = triton_decode._split_kernel
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = "fp32"
        elif ints[name] == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = dict(num_warps=tile.warps, num_stages=tile.stages or 3)
    if tile.max_regs:
        options["maxnreg"] = tile.max_regs
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def counts(kernel) -> dict:
    """Registers, spill instructions, SASS instructions and shared bytes, from cuobjdump on the kernel's cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True)
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                               check=True)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass.stdout)
    top = collections.Counter(op.split(".")[0] for op in ops).most_common(8)
    return dict(regs=int(re.search(r"REG:(\d+)", usage.stdout).group(1)),
                spills=sum(op.startswith(("STL", "LDL")) for op in ops), sass=len(ops),
                shared=kernel.metadata.shared, top=" ".join(f"{op}:{n}" for op, n in top))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help=f"JSON objects of {', '.join(sorted(KEYS))}")
    args = ap.parse_args()
    configs = []
    for text in args.configs:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            ap.error(f"{text!r} is not JSON: {e}")
        if not isinstance(cfg, dict) or set(cfg) - KEYS or cfg.get("shape", "8b") not in SHAPES \
                or cfg.get("bits", 8) not in (16, 8, 4, "fp8"):
            ap.error(f"{text!r}: an object of {', '.join(sorted(KEYS))}; shape one of {', '.join(SHAPES)}, bits one "
                     "of 16, 8, 4, \"fp8\"")
        configs.append(cfg)
    print(f"Triton {triton.__version__}, sm_90")
    print(f"{'config':<60} {'regs':>5} {'spills':>6} {'sass':>6} {'shared':>7}  top opcodes")
    for cfg, text in zip(configs, args.configs):
        r = counts(compile_tile(cfg))
        print(f"{text:<60} {r['regs']:>5} {r['spills']:>6} {r['sass']:>6} {r['shared']:>7}  {r['top']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
