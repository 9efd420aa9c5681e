"""Triton decode attention over a slot-indexed KV pool that also exports attention scores.

One query token per sequence; each sequence reads its keys through its own slot table (local key j
lives in pool slot `slot_table[b, j]`), GQA, split-K ("flash decoding") with a stable merge, fp32
accumulation. K/V are bf16/fp16/fp32, packed 8/4-bit codes with per-group fp16 scale and bias, or float8 e4m3 codes
with an fp16 scale per token and head (vLLM's fp8 KV; q.k and p @ v take the scale once per key).
Packed keys are never dequantized: with k = code * scale + bias per group, q.k = sum over groups of
scale * (q . codes) + bias * sum(q), so the tensor cores multiply the raw codes and the scales apply once
per key and group. Packed values at d=128 take the same route: p @ (code * scale + bias) per group is
(p * scale) @ code + p @ bias (`_value_group`), so their codes go from shared memory to the tensor
cores with only the fp16 conversion on the way (8-bit's read as byte pairs, `Tile.pairs`, whose 16-bit tiles
the transposed shared-memory read takes whole); at d=64 they are dequantized in fp16 registers
(code * scale + bias) and pass through shared memory as fp16 before p @ V (faster there).
Codes become fp16 by a bit trick (`_codes`; compiled, four at a time by byte permutes in inline PTX,
`Tile.permute`), not int->float conversions, which bound the kernel; the tensor-core inputs of the packed path
are then fp16 (q, p, codes, values; exact for codes below 256; q * d^-0.5 and values must stay under fp16's
65504, which the fp16 scales already assume).
Other variants measured slower (git history of benchmarks/README.md, sessions 3-5).

Score export: H2O needs, per cached key and KV head, the post-softmax probability summed over the
query heads of its group. The exact probability needs the softmax normaliser over *all* splits, so the
split kernel writes, per key and query head, exp(logit - m) in half precision, where m is its running
maximum at that key block (stored once per block), and the merge kernel keeps each head's final maximum
M and normaliser L. A fold kernel, parallel over key blocks with every KV head of a key in one row,
adds p = e * exp(m - M) / L summed over the group into the score buffer (sum, EMA, or weighted by the
number of attended keys). Turned off (EXPORT=False), that code is compiled out.

The fold kernel can also pick each head's eviction victim in the same pass (`decode_attention(...,
victim=...)`): the engine's steady-state bounded decode (`evict_decode`) is then five launches per layer
(store, split, merge, fold, victim) with no PyTorch ops between them. Policies that rank by the keys
themselves (KNorm, KeyDiff) score them in the fold kernel, which reads them back as the store does; KeyDiff's
anchor (the sum of a head's unit keys) is summed per block by one more launch before it.

`reference.py` holds the PyTorch reference these kernels are tested against (TRITON_INTERPRET=1 on CPU);
the fused evict step's reference is the PyTorch route of `cache.steps.evict_decode`.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .reference import SCORE_MODES

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as triton.jit decides: no inline PTX then
MODE_IDS = {mode: i for i, mode in enumerate(SCORE_MODES)}  # 0: no export, 1 cumulative, 2 normalized, 3 ema
RANK_IDS = {rank: i for i, rank in enumerate(("attention", "age", "key-norm", "key-diff"))}  # `Policy.rank_source`


class Tile(NamedTuple):
    """The split kernel's launch: keys per block, warps, pipeline stages (None: Triton's), and how many keys each
    program takes: `split_blocks` blocks, or (None) enough programs to put programs_per_sm on every SM, each at least
    4 blocks. paired: whose per-group scales and biases ("k", "v", both or none) a key's two groups (d=128)
    read in one load each instead of one load a group; it changes the compiled code either way. permute: packed codes
    become fp16 by byte permutes in inline PTX (`_codes`) where the kernel is compiled. staged: packed or fp8 values
    become fp16 before their layout change into the dot's operand (`_staged`). pairs: 8-bit values' codes are read
    two bytes a load, each byte pair giving an even and an odd column (`_pair_codes`), as 4-bit's nibbles do.
    value_dot: packed values go to the dot as codes, scaled through p (`decode_attention`'s value_dot; None: its rule,
    on at d=128 only), where the group fits and no residuals are read. early: a block's packed codes and scales (a
    key's two groups, and values read through the dot) all load before its first dot, so the reads overlap.
    key_dequant: packed keys become fp16 in registers (code * scale + bias) for one q.k dot over the head, instead of
    a dot per group of raw codes scaled after it (`_packed_qk`): fewer dots where few keys leave latency to save.
    max_regs: registers a thread may hold (ptxas's maxnreg; None: the compiler's count). Fewer let more programs
    share an SM, at the cost of spills: 8-bit's narrow tile at d=128 takes 168 (3 programs an SM) against bf16's 120
    (4), results/codegen_narrow_regs_sm90.log."""
    keys: int
    warps: int
    stages: int | None = None
    split_blocks: int | None = None
    programs_per_sm: int = 4
    paired: str = ""
    permute: bool = True
    staged: bool = False
    pairs: bool = False
    value_dot: bool | None = None
    early: bool = False
    key_dequant: bool = False
    max_regs: int | None = None


# (bits or "fp8" or 16 for bf16, head_dim) -> the kernel's Tile on the GPU; packed formats' middle tables:
# 4-bit at d=128 reads both groups' scales paired (its long tables take this entry too): 64 x 2k keys 0.170 -> 0.164 ms,
# 7 x 4k (8k tables) 0.050 -> 0.047, 1 x 32k 0.068 -> 0.065, 16 x 8k 0.167 -> 0.162 (bf16: 0.186, 0.047, 0.059, 0.182);
# 8-bit read slower paired: V's up to 1.8x on long tables, K's 1.07x -> 1.14x at 16 x 8k
# (results/paired_scales_h100.log).
# Before byte permutes, 8-bit's middle tables at d=128 took 64-key blocks and 8 programs an SM (its short entry now):
# 1.55-1.66x bf16 -> 1.30-1.38x, with h2o's scores 1.37-1.53x -> 1.17-1.26x (16-64 sequences, 1-2k keys); an 8B
# h2o-2048 engine step at 29 running 11.64 -> 10.56 ms. K's paired scales or 128-key blocks lost with scores
# (results/tune_grid_middle_8bit_h100.log)
# Codes become fp16 by inline PTX's byte permutes (`Tile.permute`), except in 8-bit's middle and narrow tables at d=64,
# where that ran 1.12x -> 1.51x and 1.08x -> 1.23x bf16 (64 x 1k keys in 2k tables, 64 x 257 in 272), and 4-bit's long
# ones at d=64 with few sequences (TILES_LONG_MANY). At d=128, 4-bit went 0.90-1.09x -> 0.82-1.05x bf16 and 8-bit
# 1.07-1.29x -> 1.06-1.27x (results/permute_tiles_h100.log, kernel alone)
# 8-bit's middle tables at d=128 take the long ones' tile since its codes take permutes: 1.27-1.43x bf16 -> 1.03-1.12x
# (16-128 sequences, 1-2k keys in 2k tables; the short entry keeps 64 keys where 4 x 1.5k went 1.32x -> 1.39x;
# results/middle_8bit_h100.log); an 8B full-cache step at 1k prompts 8.64 -> 8.56 ms at 27 running (bf16 8.26) and
# 10.92 -> 10.36 at 52 (results/middle_8bit_engine_h100.log)
# fp8's at d=128 take 64-key blocks, 3 stages, with values staged (`Tile.staged`; not where the call exports scores,
# which ran 1.10x -> 1.17x bf16 staged): 1.10-1.23x bf16 -> 0.80-0.90x (16-64 sequences, 1-2k keys in 2k tables;
# results/staged_values_h100.log)
# 8-bit's values at d=128 are read as byte pairs (`Tile.pairs`): the same tile went 1.16x -> 1.09x bf16 at 7 x 4k in 8k
# tables, 1.03x -> 1.00x at 16 x 8k, 1.06x -> 1.04x at 1 x 32k, 1.03x -> 1.02x at 16 x 2k (results/byte_pairs_h100.log)
TILES = {(8, 128): Tile(128, 8, 3, programs_per_sm=2, pairs=True), (4, 128): Tile(128, 2, 2, paired="kv"),
         (8, 64): Tile(128, 4, 2, permute=False), (4, 64): Tile(256, 4, 2),
         ("fp8", 128): Tile(64, 4, 3, staged=True)}
# ... where a call has fewer than SHORT_KEYS keys in all (batch x context), which few large tiles serve badly
# (4-bit at d=64 was measured on h2o 256's 257-key tables at 64 running, 1.79 -> 1.75 ms a step,
# results/engine_packed_tiles_sweep_smollm2_h100.log; such narrow tables now take TILES_NARROW first, so this entry
# serves short calls over wider tables, where it has not been timed)
# (fp8's at d=128 keeps bf16's: staged it ran 1.00x -> 1.07x bf16 at 8 x 1k keys, results/staged_values_h100.log)
TILES_SHORT, SHORT_KEYS = {(4, 128): Tile(32, 4, 3), (4, 64): Tile(64, 4, 2),
                            (8, 128): Tile(64, 4, 2, programs_per_sm=8), ("fp8", 128): Tile(64, 4, None)}, 32768
# ... where the table is narrower than NARROW_KEYS, as bounded caches' are (checked first): two 64-key blocks a
# program (8-bit and 4-bit at d=128: four, below), every format. At 257 keys, d=64, 64 and 256 sequences, they took the
# call with scores (split, merge, fold) from 17.5 / 22.9 / 22.3 / 19.7 us (bf16 / 8 / 4 / fp8) to 16.0 / 17.1 / 17.9 /
# 16.3, and from 37.7 / 53.7 / 58.9 / 42.7 to 33.1 / 43.4 / 45.6 / 41.2; 8B's d=128 at 64 from 57.9 / 52.2 (8 / 4) to
# 48.1 / 46.9 (results/tune_grid_short_h100.log)
# fp8's at d=128 take its middle tile: 1.19x -> 0.92x bf16 at 64 x 257 keys (results/staged_values_h100.log)
# 8-bit's and 4-bit's at d=64 take values through the dot as codes, 8-bit's read as byte pairs: with scores, 64 x 257
# keys 1.088x -> 1.049x bf16 (8-bit), 1.096x -> 1.074x (4-bit); 256 x 257 1.297x -> 1.213x, 1.309x -> 1.251x
# (results/narrow_value_dot_h100.log)
# With scores at 257 keys in 272-wide tables (h2o 256's), the engine's step, graph ms on an H100, before -> after
# (results/narrow_tiles_engine_h100.log): at d=64 (SmolLM2 shape, 64 running, bf16 1.52) 8-bit's loads all before
# its first dot (`Tile.early`), 1.585 -> 1.538, and 4-bit's keys dequantized for one dot (`Tile.key_dequant`) with
# early loads, 1.585 -> 1.532; at d=128 (8B shape, 32 running, bf16 7.45) four-block splits in 3 stages, as bf16's,
# 8-bit 7.677 -> 7.613 and, keys dequantized, 4-bit 7.601 -> 7.540. Kernel alone (results/narrow_tiles_h100.log,
# section 4) they gained at 769 keys and without scores, except 8-bit at d=128 over 769 keys (1.19x -> 1.23x bf16)
# and 4-bit at d=128 at 64 x 257 (1.08x -> 1.12x); 8-bit's keys dequantized gained nothing (section 3).
TILES_NARROW, NARROW_KEYS = {**{(f, 64): Tile(64, 4, 2, split_blocks=2) for f in (16, "fp8")},
                             (8, 64): Tile(64, 4, 2, split_blocks=2, pairs=True, value_dot=True, early=True),
                             (4, 64): Tile(64, 4, 2, split_blocks=2, value_dot=True, early=True, key_dequant=True),
                             (8, 128): Tile(64, 4, 3, split_blocks=4),
                             (4, 128): Tile(64, 4, 3, split_blocks=4, key_dequant=True),
                             ("fp8", 128): Tile(64, 4, 3, staged=True)}, 1024
# ... and where its table is at least LONG_KEYS wide: at d=64, 256-key blocks took a full-cache engine step of 43
# sequences x 4k (8k-wide graph tables) from 3.57 to 3.21 ms (8-bit) and from 3.97 to 2.91 ms (fp8), against bf16's
# 3.24 (results/engine_kvformats_long_tiles_smollm2_h100.log; GPU time of the step's graph, H100); 4-bit's with 8
# warps from 3.36 to 3.02 (results/engine_packed_tiles_sweep_smollm2_h100.log). At d=128, 128-key blocks and two
# programs an SM (8-bit with 8 warps): 1 x 32k keys from 69.4 / 84.1 / 75.4 us (bf16 / 8 / fp8) to 59.3 / 64.6 /
# 52.4, 7 x 4k (8k tables) from 51.2 / 61.1 / 58.6 to 47.9 / 56.6 / 43.0 (results/tune_grid_long_h100.log)
# 8-bit's at d=128 take TILES' entry, three stages since its codes take permutes: 1.03-1.16x bf16 against
# 1.07-1.19x in the kernel, an 8B engine step at 7 x 4k 8.57 -> 8.51 ms (bf16 8.13) and at 7 x 8k 10.02 -> 9.94
# (results/eight_bit_stages_h100.log)
# 8-bit's at d=128 with values as byte pairs: 64-key blocks, 4 warps, 4 programs an SM, 1.16x -> 1.02x bf16 at 7 x 4k
# in 8k tables, 1.12x -> 0.96x at 14 x 4k, 1.03x -> 0.88x at 16 x 8k (results/byte_pairs_h100.log); calls of under
# FEW_SEQS sequences keep 128-key blocks (TILES_LONG_FEW: 1 x 32k ran 1.09x in 64-key ones, 1.04x in 128-key ones);
# a block's codes and scales all load before its first dot (`Tile.early`): 7 x 4k in 8k tables 1.00x -> 0.91x bf16,
# 16 x 8k 0.89x -> 0.78x (4-bit's tile read it 0.92x -> 1.06x and 0.82x -> 0.95x, so it stays off there;
# results/early_loads_h100.log)
TILES_LONG = {(8, 64): Tile(256, 4, 2), ("fp8", 64): Tile(256, 4, 2), (4, 64): Tile(256, 8, 2, permute=False),
              **{(f, 128): Tile(128, 4, 2, programs_per_sm=2) for f in (16, "fp8")},
              (8, 128): Tile(64, 4, 2, programs_per_sm=4, pairs=True, early=True)}
LONG_KEYS = 4096
TILES_LONG_FEW, FEW_SEQS = {(8, 128): Tile(128, 8, 3, programs_per_sm=2, pairs=True)}, 4
# ... and where MANY_SEQS or more sequences read long tables: 4-bit at d=64 in 128-key blocks with permutes took the
# SmolLM2-shape engine step at its full fit of 155 x 4k from 8.27 to 6.51 ms; at 43 running it took 3.06 -> 3.56, so
# fewer keep TILES_LONG's entry (results/permute_engine_h100.log)
TILES_LONG_MANY, MANY_SEQS = {(4, 64): Tile(128, 4, 2)}, 96
# ... and where the call also exports scores (h2o's evict step), middle and long tables: 8-bit at d=128 with 16
# programs an SM on middle tables, 1.26x -> 1.18x bf16 at 29 x 2k and 1.20x -> 1.15x at 64 x 1k in 2k tables; with 4
# warps on long ones, 1.62x -> 1.30x at 7 x 4k in 8k tables (results/tile_variants_h100.log). In the engine (8B,
# h2o 4096, 7 running) 9.54 -> 9.03 ms a step, bf16 8.36; h2o 2048 at 29 running 10.60 -> 10.52
# (results/scores_tiles_engine_h100.log)
TILES_SCORES = {(8, 128): Tile(64, 4, 2, programs_per_sm=16)}
# (8-bit's long ones read values as byte pairs: 1.30x -> 1.25x bf16 at 7 x 4k, results/byte_pairs_h100.log; and all
# of a block's codes and scales before its first dot, `Tile.early`: 1.26x -> 1.19x. Early loads ran slower in every
# other 8-bit tile at d=128: 1.05x -> 1.48x at 1 x 32k (TILES_LONG_FEW), 1.01x -> 1.42x at 16 x 2k and 1.09x -> 1.53x
# at 64 x 1k (TILES), 1.15x -> 1.30x at 29 x 2k with scores (TILES_SCORES); results/early_loads_h100.log)
TILES_LONG_SCORES = {(8, 128): Tile(128, 4, 2, programs_per_sm=2, pairs=True, early=True)}

# A program's query heads (one KV head's) pad to a power of two, not to an MMA tile's 16 rows: Triton (3.6 on the
# device) pads a small dot itself, and the softmax, scales and exported scores then work on G rows instead of 16.
# Kernel alone with scores, 257 keys in 272-wide tables, H200 (results/query_rows_h200.log): SmolLM2 (G 3) at 685
# sequences bf16 69.6 -> 65.0 us, 8-bit 98.5 -> 86.9, 4-bit 93.0 -> 74.1, fp8 100.4 -> 76.3; 8B (G 4) at 120 55.9 ->
# 53.9, 77.7 -> 68.0, 71.4 -> 57.3, 74.0 -> 58.7; no wider table slowed beyond noise. The h2o engine step at bf16's
# whole fit, graph ms (results/engine_query_rows_h200.log): SmolLM2 at 685 5.52 / 6.35 / 6.16 / 6.46 -> 5.41 / 6.17 /
# 5.48 / 5.71 (bf16 / 8 / 4 / fp8); 8B at 120 7.33 / 8.12 / 7.91 / 7.85 -> 7.32 / 8.24 / 7.71 / 7.46
MIN_QUERY_ROWS = 1


@triton.jit
def _split_kernel(Q, K, V, KS, KB, VS, VB, SlotTable, CtxLen, PartO, PartM, PartL, E, MBlk,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_eb, stride_eh, stride_xb, stride_xh,
                  scale, split,
                  RPos, RRows, RFirst, stride_rpr, stride_rpj,
                  RK, RKS, RKB, RV, RVS, RVB, stride_rks, stride_rkh, stride_rss, stride_rsh, ring_row_entries,
                  Count, CountRows, stride_cb, stride_cn,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BITS: tl.constexpr, GS: tl.constexpr, EXPORT: tl.constexpr, IEEE: tl.constexpr,
                  VDOT: tl.constexpr, FP8: tl.constexpr, CONTIG: tl.constexpr,
                  RESID: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, PAIR_K: tl.constexpr,
                  PAIR_V: tl.constexpr, PERMUTE: tl.constexpr, STAGED: tl.constexpr = False,
                  PAIRS: tl.constexpr = False, EARLY: tl.constexpr = False, KDEQ: tl.constexpr = False,
                  COUNT: tl.constexpr = False, COUNT_ROWS: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(CtxLen + b)
    split = _seq_split(n, split, tl.num_programs(2), BLOCK_N)
    start = s * split
    end = tl.minimum(start + split, n)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = h * G + offs_g
    q_row = b * stride_qb + tl.where(gmask, heads, 0)[:, None] * stride_qh  # padded heads read head 0, unused
    if BITS == 16 or KDEQ:
        q = tl.load(Q + q_row + offs_d[None, :]).to(tl.float32) * scale
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    W: tl.constexpr = GS if BITS == 8 else GS // 2  # code bytes per group of a token's values
    # each loaded unit of a group's values holds two columns, an even and an odd one (4-bit's nibbles, or 8-bit's
    # byte pairs): two accumulators of WA columns each
    TWO: tl.constexpr = BITS == 4 or PAIRS
    WA: tl.constexpr = GS // 2 if TWO else GS
    if VDOT:  # packed values, one or two groups per head, go to the tensor cores as raw codes, like the keys
        acc = tl.zeros([G_PAD, WA], tl.float32)  # group 0 (4-bit: its even columns, from the low nibbles)
        if D // GS == 2:
            acc_hi = tl.zeros([G_PAD, WA], tl.float32)  # group 1
        if TWO:  # the odd columns (high nibbles or bytes); only declared where used, or the loop carries them
            acc_odd = tl.zeros([G_PAD, WA], tl.float32)
            if D // GS == 2:
                acc_hi_odd = tl.zeros([G_PAD, WA], tl.float32)
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)
    if RESID:  # mixed widths: the window's and sinks' residuals, by position (`cache.quant.RecentResiduals`)
        ring_row = tl.load(RRows + b).to(tl.int64)
        first = tl.load(RFirst + b).to(tl.int64)
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if CONTIG:  # the sequence's keys are one run of slots from its first: no table reads
            slot = tl.load(SlotTable + b * stride_tb).to(tl.int64) + offs_n
        else:
            slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=valid, other=0).to(tl.int64)
        kv_ptr = slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
        if VDOT and EARLY:  # the values' codes and scales load beside the keys', so both reads are in flight at once
            v_codes, vs, vb, v_codes_hi, vs_hi, vb_hi = _value_loads(V, VS, VB, slot, h, valid, stride_ks, stride_kh,
                                                                     stride_ss, stride_sh, W, WA, D // GS, PAIRS,
                                                                     PAIR_V, True)
        if FP8:  # e4m3 codes (exact in fp16, one conversion) with a scale per token and head: (q . codes) * scale
            sp = slot * stride_ss + h * stride_sh
            k = tl.load(K + kv_ptr, mask=valid[:, None], other=0.0).to(tl.float16)
            qk = _dot(q, tl.trans(k), IEEE) * tl.load(KS + sp, mask=valid, other=0.0).to(tl.float32)[None, :]
        elif BITS == 16:
            qk = _dot(q, tl.trans(tl.load(K + kv_ptr, mask=valid[:, None], other=0.0)), IEEE)
        elif KDEQ:
            k = _dequant(K, KS, KB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, IEEE,
                         PERMUTE)
            qk = _dot(q, tl.trans(k), IEEE)
        else:
            qk = _packed_qk(Q, K, KS, KB, slot, h, valid, q_row, stride_ks, stride_kh, stride_ss, stride_sh, scale,
                            G_PAD, BLOCK_N, D, BITS, GS, IEEE, PAIR_K, PERMUTE, EARLY)
        if RESID:
            p_key = tl.load(RPos + ring_row * stride_rpr + offs_n * stride_rpj + h, mask=valid, other=-1).to(tl.int64)
            held = valid & _ring_held(p_key, first, SINK, RECENT)
            rslot = ring_row * ring_row_entries + tl.where(held, _ring_entry(p_key, SINK, RECENT), 0)
            qk += _packed_qk(Q, RK, RKS, RKB, rslot, h, held, q_row, stride_rks, stride_rkh, stride_rss, stride_rsh,
                             scale, G_PAD, BLOCK_N, D, 4, GS, IEEE, PAIR_K, PERMUTE, False)
        if COUNT:  # a merged key's logit gains the log of the tokens it stands for (`cache.merge`)
            c_row = tl.load(CountRows + b).to(tl.int64) if COUNT_ROWS else b
            qk += tl.log(tl.load(Count + c_row * stride_cb + offs_n * stride_cn + h, mask=valid, other=1.0))[None, :]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - m_new[:, None])
        if EXPORT:
            tl.store(E + b * stride_eb + heads[:, None] * stride_eh + offs_n[None, :], p.to(E.dtype.element_ty),
                     mask=gmask[:, None] & valid[None, :])
            tl.store(MBlk + b * stride_xb + heads * stride_xh + j0 // BLOCK_N, m_new, mask=gmask)
        l = l * alpha + tl.sum(p, 1)
        if VDOT:
            if not EARLY:
                v_codes, vs, vb, v_codes_hi, vs_hi, vb_hi = _value_loads(V, VS, VB, slot, h, valid, stride_ks,
                                                                         stride_kh, stride_ss, stride_sh, W, WA,
                                                                         D // GS, PAIRS, PAIR_V, False)
            ps, pb = _value_group(p, vs, vb)
            if TWO:
                even, odd = _pair_codes(v_codes, False, BITS, PERMUTE), _pair_codes(v_codes, True, BITS, PERMUTE)
                acc = _codes_dot(acc, alpha, ps, pb, even, valid, STAGED, IEEE)
                acc_odd = _codes_dot(acc_odd, alpha, ps, pb, odd, valid, STAGED, IEEE)
            else:
                acc = _codes_dot(acc, alpha, ps, pb, _codes(v_codes, PERMUTE), valid, STAGED, IEEE)
            if D // GS == 2:
                if not EARLY:
                    v_codes_hi, vs_hi, vb_hi = _value_hi(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss,
                                                         stride_sh, vs_hi, vb_hi, W, WA, PAIRS, PAIR_V)
                ps, pb = _value_group(p, vs_hi, vb_hi)
                if TWO:
                    even, odd = (_pair_codes(v_codes_hi, False, BITS, PERMUTE),
                                 _pair_codes(v_codes_hi, True, BITS, PERMUTE))
                    acc_hi = _codes_dot(acc_hi, alpha, ps, pb, even, valid, STAGED, IEEE)
                    acc_hi_odd = _codes_dot(acc_hi_odd, alpha, ps, pb, odd, valid, STAGED, IEEE)
                else:
                    acc_hi = _codes_dot(acc_hi, alpha, ps, pb, _codes(v_codes_hi, PERMUTE), valid, STAGED, IEEE)
        elif FP8:  # p @ (codes * scale) = top * ((p * scale / top) @ codes), top the row's largest p * scale: fp16
            v = _staged(tl.load(V + kv_ptr, mask=valid[:, None], other=0.0).to(tl.float16), valid, STAGED)
            ps = p * tl.load(VS + sp, mask=valid, other=0.0).to(tl.float32)[None, :]
            top = tl.maximum(tl.max(ps, 1), 1e-30)
            acc = acc * alpha[:, None] + _dot(ps * (1.0 / top)[:, None], v, IEEE) * top[:, None]
        else:
            if BITS == 16:
                v = tl.load(V + kv_ptr, mask=valid[:, None], other=0.0)
            else:
                v = _dequant(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS,
                             IEEE, PERMUTE)
                if RESID:
                    v += _dequant(RV, RVS, RVB, rslot, h, held, stride_rks, stride_rkh, stride_rss, stride_rsh, D, 4,
                                  GS, IEEE, PERMUTE)
            acc = acc * alpha[:, None] + _dot(p, v, IEEE)
        m = m_new
    o_ptr = PartO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os
    if VDOT:
        offs_c = tl.arange(0, WA)[None, :] * (2 if TWO else 1)
        tl.store(o_ptr + offs_c, acc / PV_SCALE, mask=gmask[:, None])
        if TWO:
            tl.store(o_ptr + offs_c + 1, acc_odd / PV_SCALE, mask=gmask[:, None])
        if D // GS == 2:
            tl.store(o_ptr + GS + offs_c, acc_hi / PV_SCALE, mask=gmask[:, None])
            if TWO:
                tl.store(o_ptr + GS + offs_c + 1, acc_hi_odd / PV_SCALE, mask=gmask[:, None])
    else:
        tl.store(o_ptr + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(PartM + b * stride_mb + heads * stride_mh + s, m, mask=gmask)
    tl.store(PartL + b * stride_mb + heads * stride_mh + s, l, mask=gmask)


@triton.jit
def _ring_entry(p, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Mixed widths' ring entry of position p, as `reference.ring_entry`."""
    return tl.where(p < SINK, p, SINK + p % (RECENT + 1))


@triton.jit
def _ring_held(p, first, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Mixed widths: which positions p (-1: none) read their residual in a step from `first`, as
    `reference.ring_held`: the sinks and the `recent` positions before it."""
    return (p >= 0) & ((p < SINK) | (p >= first - RECENT))


MERGE_CHUNK = 16  # splits `_merge_kernel` loads at once
PV_SCALE: tl.constexpr = tl.constexpr(64.0)  # keeps p * v_scale clear of fp16 subnormals; exact (a power of 2)


@triton.jit
def _scale_bias(S, B, sp, valid):
    """Scale and bias of one group of the keys at offsets `sp`, in fp32."""
    return (tl.load(S + sp, mask=valid, other=0.0).to(tl.float32),
            tl.load(B + sp, mask=valid, other=0.0).to(tl.float32))


@triton.jit
def _paired_scales(S, B, sp, valid):
    """Scale and bias of a key's two groups, in fp32, in one load each (a key's scales lie side by side)."""
    pair = sp[:, None] + tl.arange(0, 2)[None, :]
    s0, s1 = tl.split(tl.load(S + pair, mask=valid[:, None], other=0.0).to(tl.float32))
    b0, b1 = tl.split(tl.load(B + pair, mask=valid[:, None], other=0.0).to(tl.float32))
    return s0, b0, s1, b1


@triton.jit
def _value_codes_ptr(V, slot, h, stride_ks, stride_kh, W: tl.constexpr, WA: tl.constexpr, PAIRS: tl.constexpr):
    """Pointers to a block's first group of value codes: W bytes a key, or (PAIRS) WA 16-bit byte pairs, the same
    bytes as 16-bit units (strides are even: a head's codes are whole units)."""
    if PAIRS:
        units = V.to(tl.pointer_type(tl.uint16))
        ptr = units + (slot[:, None] * stride_ks + h * stride_kh) // 2 + tl.arange(0, WA)[None, :]
    else:
        ptr = V + slot[:, None] * stride_ks + h * stride_kh + tl.arange(0, W)[None, :]
    return ptr


@triton.jit
def _value_loads(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, W: tl.constexpr,
                 WA: tl.constexpr, NG: tl.constexpr, PAIRS: tl.constexpr, PAIR_V: tl.constexpr, BOTH: tl.constexpr):
    """A block's value codes with their scales and biases, group 0's then group 1's (NG 2): both groups' (BOTH), or
    group 0's with group 1's scales where PAIR_V reads them in the same load, group 1's rest left to `_value_hi`
    (group 0's stand in until then)."""
    if PAIR_V and NG == 2:
        vs, vb, vs_hi, vb_hi = _paired_scales(VS, VB, slot * stride_ss + h * stride_sh, valid)
    else:
        vs, vb = _scale_bias(VS, VB, slot * stride_ss + h * stride_sh, valid)
        vs_hi, vb_hi = vs, vb
    codes = tl.load(_value_codes_ptr(V, slot, h, stride_ks, stride_kh, W, WA, PAIRS), mask=valid[:, None], other=0)
    codes_hi = codes
    if BOTH and NG == 2:
        codes_hi, vs_hi, vb_hi = _value_hi(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh,
                                           vs_hi, vb_hi, W, WA, PAIRS, PAIR_V)
    return codes, vs, vb, codes_hi, vs_hi, vb_hi


@triton.jit
def _value_hi(V, VS, VB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, vs_hi, vb_hi, W: tl.constexpr,
              WA: tl.constexpr, PAIRS: tl.constexpr, PAIR_V: tl.constexpr):
    """Group 1's value codes, and its scale and bias unless PAIR_V read them with group 0's (`vs_hi`, `vb_hi`)."""
    if not PAIR_V:
        vs_hi, vb_hi = _scale_bias(VS, VB, slot * stride_ss + h * stride_sh + 1, valid)
    ptr = _value_codes_ptr(V, slot, h, stride_ks, stride_kh, W, WA, PAIRS) + WA
    return tl.load(ptr, mask=valid[:, None], other=0), vs_hi, vb_hi


@triton.jit
def _value_group(p, vs, vb):
    """One group of packed value columns for p @ (code * scale + bias) = (p * scale) @ code + p @ bias:
    p * scale and p @ bias (both times PV_SCALE); the raw codes then reach the tensor cores as they are
    (`_codes_dot`): no per-element dequantize and no fp16 copy of the values in shared memory."""
    return p * (vs * PV_SCALE)[None, :], tl.sum(p * (vb * PV_SCALE)[None, :], 1)[:, None]


@triton.jit
def _staged(v, valid, STAGED: tl.constexpr):
    """STAGED: the values' fp16 tile through a select, which Triton does not hoist past the layout change into the
    dot's operand: the codes become fp16 before shared memory, read back transposed by ldmatrix, instead of
    byte by byte."""
    if STAGED:
        return tl.where(valid[:, None], v, 0.0)
    return v


@triton.jit
def _codes_dot(acc, alpha, ps, pb, codes, valid, STAGED: tl.constexpr, IEEE: tl.constexpr):
    """acc * alpha + (p * scale) @ codes + p @ bias, in units of 1 / PV_SCALE; codes as exact fp16 (`_codes`),
    staged or not (`_staged`)."""
    return acc * alpha[:, None] + _dot(ps, _staged(codes, valid, STAGED), IEEE) + pb


@triton.jit
def _codes(c, PERMUTE: tl.constexpr):
    """Integer codes (< 256) -> exact fp16 without int->float conversions, which bound the packed kernel
    on the GPU: 0x6400 | c is the fp16 bit pattern of 1024 + c, so one OR and one subtract. PERMUTE (compiled
    only): bytes four at a time through two byte permutes and two paired subtracts (`_BYTES_TO_HALVES`)."""
    if PERMUTE:
        return tl.inline_asm_elementwise(_BYTES_TO_HALVES, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _nibble_codes(c, ODD: tl.constexpr, PERMUTE: tl.constexpr):
    """The low (ODD: high) nibbles of packed 4-bit codes as exact fp16 (`_codes`)."""
    if PERMUTE:
        return tl.inline_asm_elementwise(_HIGH_NIBBLES if ODD else _LOW_NIBBLES, "=r,=r,r", [c], dtype=tl.float16,
                                         is_pure=True, pack=4)
    return _codes((c >> 4) if ODD else (c & 0xF), False)


@triton.jit
def _pair_codes(c, ODD: tl.constexpr, BITS: tl.constexpr, PERMUTE: tl.constexpr):
    """The even (ODD: odd) columns of a unit holding two: 4-bit's low (high) nibbles, or the low (high) bytes of
    8-bit's 16-bit byte pairs."""
    if BITS == 4:
        return _nibble_codes(c, ODD, PERMUTE)
    if PERMUTE:
        return tl.inline_asm_elementwise(_HIGH_BYTES if ODD else _LOW_BYTES, "=r,r", [c], dtype=tl.float16,
                                         is_pure=True, pack=2)
    return _codes((c >> 8) if ODD else (c & 0xFF), False)


# Two 16-bit byte pairs of $1 -> their low (or high) bytes as two fp16 in $0: one lop3 ((a & b) | c) puts the exponent
# bits of 1024 above each byte, then the paired subtract takes the 1024 off
_BYTE_PAIRS_TO_HALVES = """{{
.reg .b32 k, t;
mov.b32 k, 0x64006400;
shr.b32 t, $1, {shift};
lop3.b32 $0, t, 0x00ff00ff, 0x64006400, 0xea;
sub.f16x2 $0, $0, k;
}}"""
_LOW_BYTES: tl.constexpr = tl.constexpr(_BYTE_PAIRS_TO_HALVES.format(shift=0))
_HIGH_BYTES: tl.constexpr = tl.constexpr(_BYTE_PAIRS_TO_HALVES.format(shift=8))


# Four bytes of $2 -> four fp16 in $0, $1: prmt puts 0x64 above each byte (the bits of 1024 + code), and a paired
# subtract takes the 1024 off
_BYTES_TO_HALVES: tl.constexpr = tl.constexpr("""{
.reg .b32 k;
mov.b32 k, 0x64006400;
prmt.b32 $0, $2, 0x64646464, 0x4140;
prmt.b32 $1, $2, 0x64646464, 0x4342;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
}""")
# ... and of four bytes' nibbles (low: shift 0, high: shift 4): each byte into a 16-bit lane, shifted, masked to
# its nibble and given the exponent bits of 1024 in one lop3 ((a & b) | c), then the paired subtract
_NIBBLES_TO_HALVES = """{{
.reg .b32 k, t0, t1;
mov.b32 k, 0x64006400;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shr.b32 t0, t0, {shift};
shr.b32 t1, t1, {shift};
lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea;
lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
}}"""
_LOW_NIBBLES: tl.constexpr = tl.constexpr(_NIBBLES_TO_HALVES.format(shift=0))
_HIGH_NIBBLES: tl.constexpr = tl.constexpr(_NIBBLES_TO_HALVES.format(shift=4))


@triton.jit
def _dequant(P, S, B, slot, h, valid, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr,
             BITS: tl.constexpr, GS: tl.constexpr, IEEE: tl.constexpr, PERMUTE: tl.constexpr):
    """Packed codes of len(slot) tokens -> [len(slot), D]: code * scale[group] + bias[group], in fp16
    registers on the GPU (fp32 when IEEE); PERMUTE as `_codes`."""
    N: tl.constexpr = slot.shape[0]
    DP: tl.constexpr = D if BITS == 8 else D // 2
    offs_p = tl.arange(0, DP)
    packed = tl.load(P + slot[:, None] * stride_ps + h * stride_ph + offs_p[None, :], mask=valid[:, None], other=0)
    if BITS == 8:
        codes = _codes(packed, PERMUTE)
    else:
        low, high = _nibble_codes(packed, False, PERMUTE), _nibble_codes(packed, True, PERMUTE)
        codes = tl.reshape(tl.join(low, high), [N, D])
    if IEEE:
        codes = codes.to(tl.float32)
    NG: tl.constexpr = D // GS
    offs_g = tl.arange(0, NG)
    sp = slot[:, None] * stride_ss + h * stride_sh + offs_g[None, :]
    sc = tl.load(S + sp, mask=valid[:, None], other=0.0).to(codes.dtype)
    bi = tl.load(B + sp, mask=valid[:, None], other=0.0).to(codes.dtype)
    x = tl.reshape(codes, [N, NG, GS]) * sc[:, :, None] + bi[:, :, None]
    return tl.reshape(x, [N, D])


@triton.jit
def _packed_qk(Q, K, KS, KB, slot, h, valid, q_row, stride_ks, stride_kh, stride_ss, stride_sh, scale,
               G_PAD: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
               IEEE: tl.constexpr, PAIRED: tl.constexpr, PERMUTE: tl.constexpr, EARLY: tl.constexpr):
    """q.k of packed keys without dequantizing them: per group, scale * (q . codes) + bias * sum(q), with
    2-D dots of q against the raw codes. PAIRED: two groups' scales in one load each (`_paired_scales`).
    EARLY (two groups): both groups' codes and scales load before either dot, so the reads overlap."""
    W: tl.constexpr = GS if BITS == 8 else GS // 2
    NG: tl.constexpr = D // GS
    sp = slot * stride_ss + h * stride_sh
    codes_ptr = K + slot[:, None] * stride_ks + h * stride_kh + tl.arange(0, W)[None, :]
    if PAIRED and NG == 2:
        ks0, kb0, ks1, kb1 = _paired_scales(KS, KB, sp, valid)
    if EARLY and NG == 2:
        if not PAIRED:
            ks0, kb0 = _scale_bias(KS, KB, sp, valid)
            ks1, kb1 = _scale_bias(KS, KB, sp + 1, valid)
        codes0 = tl.load(codes_ptr, mask=valid[:, None], other=0)
        codes1 = tl.load(codes_ptr + W, mask=valid[:, None], other=0)
        raw0, qsum0 = _group_dot(Q, q_row, codes0, 0, scale, GS, BITS, IEEE, PERMUTE)
        raw1, qsum1 = _group_dot(Q, q_row, codes1, 1, scale, GS, BITS, IEEE, PERMUTE)
        return (raw0 * ks0[None, :] + qsum0[:, None] * kb0[None, :]
                + raw1 * ks1[None, :] + qsum1[:, None] * kb1[None, :])
    qk = tl.zeros([G_PAD, N], tl.float32)
    for gi in tl.static_range(NG):
        codes = tl.load(codes_ptr + gi * W, mask=valid[:, None], other=0)
        raw, qsum = _group_dot(Q, q_row, codes, gi, scale, GS, BITS, IEEE, PERMUTE)
        if not (PAIRED and NG == 2):
            ks, kb = _scale_bias(KS, KB, sp + gi, valid)
        elif gi == 0:
            ks, kb = ks0, kb0
        else:
            ks, kb = ks1, kb1
        qk += raw * ks[None, :] + qsum[:, None] * kb[None, :]
    return qk


@triton.jit
def _group_dot(Q, q_row, codes, gi, scale, GS: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr,
               PERMUTE: tl.constexpr):
    """Group gi's q . codes and sum(q), q's columns read at the codes' own (4-bit: even and odd)."""
    W: tl.constexpr = GS if BITS == 8 else GS // 2
    STEP: tl.constexpr = 1 if BITS == 8 else 2
    qp = Q + q_row + gi * GS + tl.arange(0, W)[None, :] * STEP
    qg = tl.load(qp).to(tl.float32) * scale
    if BITS == 8:
        return _dot(qg, tl.trans(_codes(codes, PERMUTE)), IEEE), tl.sum(qg, 1)
    qo = tl.load(qp + 1).to(tl.float32) * scale
    raw = (_dot(qg, tl.trans(_nibble_codes(codes, False, PERMUTE)), IEEE)
           + _dot(qo, tl.trans(_nibble_codes(codes, True, PERMUTE)), IEEE))
    return raw, tl.sum(qg, 1) + tl.sum(qo, 1)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 products when IEEE, else half-precision tensor-core inputs,
    fp16 when b is fp16 (dequantized values, codes: integers below 256 are exact in either), else bf16."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if b.dtype == tl.float16:
        return tl.dot(a.to(tl.float16), b)
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _seq_split(n, min_split, num_splits, BLOCK_N: tl.constexpr):
    """Keys per program for a sequence of n keys: its own length shared by the grid's splits, at least min_split.
    The grid is sized for the table's width, which a CUDA graph's width bucket makes far longer than most of the
    contexts it serves: split by the width, most programs would find no keys and a few would take them all."""
    return tl.maximum(min_split, tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N)


@triton.jit
def _merge_kernel(PartO, PartM, PartL, Out, CtxLen, stride_ob, stride_oh, stride_os, stride_mb, stride_mh,
                  stride_outb, stride_outh, split, num_splits, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  MODE: tl.constexpr, CHUNK: tl.constexpr):
    """Program (b, query head): its splits' partial outputs combined, CHUNK splits a load (one load where the
    sequence has at most CHUNK splits: a loop over them one by one took about 0.35 us a split)."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    n = tl.load(CtxLen + b)
    used = tl.cdiv(n, _seq_split(n, split, num_splits, BLOCK_N))
    offs_d = tl.arange(0, D)
    m_row = PartM + b * stride_mb + qh * stride_mh
    l_row = PartL + b * stride_mb + qh * stride_mh
    big_m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    big_l = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, used, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        live = s < used
        ms = tl.load(m_row + s, mask=live, other=float("-inf"))
        o = tl.load(PartO + b * stride_ob + qh * stride_oh + s[:, None] * stride_os + offs_d[None, :],
                    mask=live[:, None], other=0.0)
        m_new = tl.maximum(big_m, tl.max(ms, 0))
        alpha = tl.exp(big_m - m_new)
        w = tl.exp(ms - m_new)
        big_l = big_l * alpha + tl.sum(tl.load(l_row + s, mask=live, other=0.0) * w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        big_m = m_new
    tl.store(Out + b * stride_outb + qh * stride_outh + offs_d, (acc / big_l).to(Out.dtype.element_ty))
    if MODE != 0:  # the normaliser of each query head, for the score fold
        tl.store(m_row, big_m)
        tl.store(l_row, big_l)


@triton.jit
def _lowest(key, pos, idx, valid, AXIS: tl.constexpr):
    """Along AXIS, among valid entries: the lowest key, the oldest position among ties, and its index, as
    `policies.lowest` chooses."""
    k_min = tl.min(tl.where(valid, key, float("inf")), AXIS)
    tied = valid & (key == tl.expand_dims(k_min, AXIS))
    p_min = tl.min(tl.where(tied, pos, 2147483647), AXIS)
    i_min = tl.min(tl.where(tied & (pos == tl.expand_dims(p_min, AXIS)), idx, 2147483647), AXIS)
    return k_min, p_min, i_min


@triton.jit
def _over_age(x, pos, newest):
    """x over the number of queries that could see the key at `pos` (ObservedAttention's normalization)."""
    return x / tl.maximum(newest - pos + 1, 1).to(tl.float32)


@triton.jit
def _victim_rank(key, pos, newest, prefix, recent, AGE: tl.constexpr):
    """What a victim is chosen by, lowest first (`Policy.rank`), from `key` (the scores, or the positions of a policy
    without them): itself, or over the key's age (AGE: ObservedAttention, the summed attention over the queries that
    could see the key); inf for the protected, positions below `prefix` and the `recent` newest (and free slots)."""
    if AGE:
        key = _over_age(key, pos, newest)
    return tl.where((pos < prefix) | (pos > newest - recent), float("inf"), key)


@triton.jit
def _fold_kernel(E, MBlk, PartM, PartL, Score, Rows, Pos, Positions, CtxLen, CandKey, CandPos, CandJ,
                 stride_eb, stride_eh, stride_xb, stride_xh, stride_mb, stride_mh, stride_sr, stride_sj,
                 stride_pr, stride_pj, ema_decay, prefix, recent,
                 K, KS, KB, SlotTable, Out, UnitSum, stride_ks, stride_kh, stride_ss, stride_sh, stride_tb, nblocks,
                 G: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, VICTIM: tl.constexpr,
                 BY_SCORE: tl.constexpr, LAYER: tl.constexpr, RANK: tl.constexpr, D: tl.constexpr,
                 BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr):
    """Key block pid1 (BLOCK keys) of sequence b, every KV head at once ([HKV_PAD, BLOCK] tiles, so the
    score row of a key is read and written whole): fold this step's probabilities into the scores
    (MODE != 0), or score keys themselves (RANK 2: KNorm, the new token's; 3: KeyDiff, every key against the
    anchor `UnitSum` holds in parts);
    with VICTIM, also each head's victim candidate in the block, the unprotected key of lowest rank (score,
    the score over the key's age for RANK 1, or position), the oldest among ties. Protected: positions below
    `prefix`, and the `recent` newest (the newest is this step's token). LAYER: every head takes the layer's sum
    (its heads hold the same token in the same slot), so all pick the same victim."""
    b = tl.program_id(0)
    n = tl.load(CtxLen + b)
    row = b
    if ROWS:
        row = tl.load(Rows + b)
    offs_h = tl.arange(0, HKV_PAD)
    hmask = offs_h < HKV
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = hmask[:, None] & (offs_n < n)[None, :]
    sp = Score + row * stride_sr + offs_n[None, :] * stride_sj + offs_h[:, None]
    if VICTIM or RANK == 2:  # the block's positions, read once for KNorm's new token and the victim
        pos = tl.load(Pos + row * stride_pr + offs_n[None, :] * stride_pj + offs_h[:, None], mask=mask, other=-1)
        newest = tl.load(Positions + b).to(tl.int32)
    if RANK >= 2:  # KeyDiff rescores every key; KNorm scores the new token, the others keep theirs
        scored = mask
        if RANK == 2:
            scored = mask & (pos == newest)
        new = _key_scores(K, KS, KB, SlotTable, Out, UnitSum, b, offs_n, offs_h, scored, n, nblocks, stride_ks,
                          stride_kh, stride_ss, stride_sh, stride_tb, HKV, HKV_PAD, D, BITS, GS, FP8, RANK == 3)
        if LAYER:
            new = tl.zeros([HKV_PAD, BLOCK], tl.float32) + tl.sum(tl.where(scored, new, 0.0), 0)[None, :]
            scored = mask & (tl.sum(scored.to(tl.int32), 0) > 0)[None, :]
        new = tl.where(scored, new, tl.load(sp, mask=mask, other=0.0))
        tl.store(sp, new, mask=mask)
    if MODE != 0:
        p = tl.zeros([HKV_PAD, BLOCK], tl.float32)
        for g in tl.static_range(G):
            hq = offs_h * G + g
            big_m = tl.load(PartM + b * stride_mb + hq * stride_mh, mask=hmask, other=0.0)
            big_l = tl.load(PartL + b * stride_mb + hq * stride_mh, mask=hmask, other=1.0)
            m_blk = tl.load(MBlk + b * stride_xb + hq[:, None] * stride_xh + offs_n[None, :] // BLOCK_N, mask=mask,
                            other=0.0)
            e = tl.load(E + b * stride_eb + hq[:, None] * stride_eh + offs_n[None, :], mask=mask, other=0.0)
            p += e.to(tl.float32) * (tl.exp(m_blk - big_m[:, None]) / big_l[:, None])
        if LAYER:
            p = tl.zeros([HKV_PAD, BLOCK], tl.float32) + tl.sum(tl.where(mask, p, 0.0), 0)[None, :]
        old = tl.load(sp, mask=mask, other=0.0)
        if MODE == 1:
            new = old + p
        elif MODE == 2:
            new = old + p * n.to(tl.float32)
        else:
            new = old * ema_decay + p * (1.0 - ema_decay)
        tl.store(sp, new, mask=mask)
    if VICTIM:  # this block's candidate per head; `_victim_kernel` picks among the blocks
        key = pos.to(tl.float32)
        if BY_SCORE:
            key = new
        key = _victim_rank(key, pos, newest, prefix, recent, BY_SCORE and RANK == 1)
        k_min, p_min, j_min = _lowest(key, pos, offs_n[None, :], mask, 1)
        c = (b * tl.num_programs(1) + tl.program_id(1)) * HKV_PAD + offs_h
        tl.store(CandKey + c, k_min)
        tl.store(CandPos + c, p_min)
        tl.store(CandJ + c, j_min)


@triton.jit
def _read_keys(K, KS, KB, Out, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D: tl.constexpr,
               BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr):
    """Head h's keys at `slot` [N] in fp32, as the store's `gather` reads them back: packed codes dequantized
    in fp32 and rounded to the model's dtype (Out's)."""
    offs_d = tl.arange(0, D)
    if FP8:
        k = tl.load(K + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        sc = tl.load(KS + slot * stride_ss + h * stride_sh, mask=valid, other=0.0)
        k = (k.to(tl.float32) * sc.to(tl.float32)[:, None]).to(Out.dtype.element_ty)
    elif BITS == 16:
        k = tl.load(K + slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        k = _dequant(K, KS, KB, slot, h, valid, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, True, False)
        k = k.to(Out.dtype.element_ty)
    return k.to(tl.float32)


@triton.jit
def _unit_rows(k):
    """Each row of k [N, D] over its L2 norm (at least 1e-12), as `F.normalize`."""
    return k / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), 1e-12)[:, None]


@triton.jit
def _unit_sum_kernel(K, KS, KB, SlotTable, Out, Pos, Rows, CtxLen, UnitSum, stride_ks, stride_kh, stride_ss,
                     stride_sh, stride_tb, stride_pr, stride_pj, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
                     BLOCK: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr):
    """Key block pid1 of sequence b: each head's sum of its held keys' unit vectors, KeyDiff's anchor in part
    (UnitSum [B, blocks, HKV_PAD, D]; the fold kernel adds the blocks up)."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(CtxLen + b)
    row = tl.load(Rows + b)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    inb = offs_n < n
    slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=inb, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    for h in tl.static_range(HKV):
        held = inb & (tl.load(Pos + row * stride_pr + offs_n * stride_pj + h, mask=inb, other=-1) >= 0)
        unit = _unit_rows(_read_keys(K, KS, KB, Out, slot, h, held, stride_ks, stride_kh, stride_ss, stride_sh, D,
                                     BITS, GS, FP8))
        part = tl.sum(tl.where(held[:, None], unit, 0.0), 0)
        tl.store(UnitSum + ((b * tl.num_programs(1) + blk) * HKV_PAD + h) * D + offs_d, part)


@triton.jit
def _key_scores(K, KS, KB, SlotTable, Out, UnitSum, b, offs_n, offs_h, scored, n, nblocks, stride_ks, stride_kh,
                stride_ss, stride_sh, stride_tb, HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr,
                BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr, DIFF: tl.constexpr):
    """[HKV_PAD, BLOCK] scores of the keys at offs_n that `scored` [HKV_PAD, BLOCK] marks (0 elsewhere): minus
    their L2 norm (KNorm), or with DIFF minus their cosine similarity to the anchor, the normalized sum of the
    head's unit keys (KeyDiff, `Policy.rescore`). Only the marked keys are read."""
    slot = tl.load(SlotTable + b * stride_tb + offs_n, mask=offs_n < n, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    out = tl.zeros([HKV_PAD, offs_n.shape[0]], tl.float32)
    for h in tl.static_range(HKV):
        read = tl.sum(tl.where(offs_h[:, None] == h, scored.to(tl.int32), 0), 0) > 0
        k = _read_keys(K, KS, KB, Out, slot, h, read, stride_ks, stride_kh, stride_ss, stride_sh, D, BITS, GS, FP8)
        if DIFF:
            a = tl.zeros([D], tl.float32)
            for blk in range(0, nblocks):
                a += tl.load(UnitSum + ((b * nblocks + blk) * HKV_PAD + h) * D + offs_d)
            a = a / tl.maximum(tl.sqrt(tl.sum(a * a, 0)), 1e-12)
            s = -tl.sum(_unit_rows(k) * a[None, :], 1)
        else:
            s = -tl.sqrt(tl.sum(k * k, 1))
        out = tl.where(offs_h[:, None] == h, s[None, :], out)
    return out


@triton.jit
def _victim_kernel(CandKey, CandPos, CandJ, Rows, Pos, Spare, CtxLen, width, blocks, stride_pr, stride_pj,
                   stride_spr, HKV: tl.constexpr, HKV_PAD: tl.constexpr, NC_PAD: tl.constexpr,
                   KEEP_POS: tl.constexpr = False):
    """Sequence b: each head's victim among its blocks' candidates (lowest key, then oldest position): its
    position is marked free (unless KEEP_POS: a merge reads it first, then frees it) and its slot becomes the head's
    spare slot. A sequence whose `CtxLen` slots do not fill its table's `width` yet evicts nothing: its next free
    slot becomes the spare."""
    b = tl.program_id(0)
    row = tl.load(Rows + b)
    n = tl.load(CtxLen + b)
    offs_c = tl.arange(0, NC_PAD)
    offs_h = tl.arange(0, HKV_PAD)
    cm = (offs_c[:, None] < blocks) & (offs_h[None, :] < HKV)
    c = (b * blocks + offs_c[:, None]) * HKV_PAD + offs_h[None, :]
    key = tl.load(CandKey + c, mask=cm, other=float("inf"))
    pos = tl.load(CandPos + c, mask=cm, other=2147483647)
    j = tl.load(CandJ + c, mask=cm, other=0)
    _, _, j_min = _lowest(key, pos, j, cm, 0)
    j_min = tl.where(n < width, n, j_min)  # a free slot's position is -1 already
    hmask = offs_h < HKV
    if not KEEP_POS:
        tl.store(Pos + row * stride_pr + j_min * stride_pj + offs_h, tl.full([HKV_PAD], -1, tl.int32), mask=hmask)
    tl.store(Spare + row * stride_spr + offs_h, j_min.to(tl.int64), mask=hmask)


def _quant_args(quant, k_pool, d):
    """(bits, group, fp8, [k_scale, k_bias, v_scale, v_bias]) of a `quant` dict for the kernels. fp8 stores one
    code a value, as 16-bit K/V do, with a scale per key and no bias; unused pointers are the pool itself."""
    if quant is None:
        return 16, d, False, [k_pool] * 4
    if quant["bits"] == "fp8":
        return 16, d, True, [quant["k_scale"], quant["k_scale"], quant["v_scale"], quant["v_scale"]]
    return quant["bits"], quant["group"], False, [quant[f"{s}_{x}"] for s in "kv" for x in ("scale", "bias")]


def _resid_args(resid, dummy):
    """The kernels' residual arguments (`RecentResiduals.kernel_args`), or placeholders: "reads" (positions, rows,
    first positions and the positions' strides; the split kernel's), "ring" (the ring's six tensors and their
    strides; both kernels'), sink and recent."""
    if resid is None:
        return dict(reads=[dummy] * 3 + [0] * 2, ring=[dummy] * 6 + [0] * 5, sink=0, recent=0)
    pos, (kc, ks, kb), (vc, vs, vb) = resid["pos"], resid["k"], resid["v"]
    if pos.stride(-1) != 1 or kc.stride() != vc.stride() or ks.stride() != vs.stride() or kb.stride() != ks.stride():
        raise ValueError("residuals: positions need their heads contiguous, and K's and V's tensors one layout")
    row_entries = kc.stride(0) // kc.stride(1)  # a row is this many entries on: the kernel adds row * that
    if kc.stride(0) % kc.stride(1) or ks.stride(0) != row_entries * ks.stride(1):
        raise ValueError(f"residuals: a row must span whole entries in codes and scales alike, got strides "
                         f"{kc.stride()} and {ks.stride()}")
    return dict(reads=[pos, resid["rows"], resid["first"], pos.stride(0), pos.stride(1)],
                ring=[kc, ks, kb, vc, vs, vb, kc.stride(1), kc.stride(2), ks.stride(1), ks.stride(2), row_entries],
                sink=resid["sink"], recent=resid["recent"])


def kernel_tile(fmt, d: int, bsz: int, max_len: int, contiguous: bool = False, cuda: bool = True,
                scores: bool = False) -> Tile:
    """The split kernel's Tile for a call of `bsz` tables `max_len` wide in format `fmt` (16 for bf16, 8 / 4 / "fp8"),
    exporting `scores` or not: on the GPU the tables' entry by head size and table width, else bf16's default
    (packed formats' middle one)."""
    if contiguous and fmt in (16, "fp8") and d >= 128:
        # direct loads pipeline deeper, and three stages of 128-wide K/V tiles cost occupancy: 1.08x paged at
        # batch 64, 0.97x with one stage (results/contig_decode_h100.log)
        return Tile(64, 4, 1)
    tile = Tile(64, 4, None)
    if not cuda:
        return tile
    tile = TILES.get((fmt, d), tile if fmt in (16, "fp8") else Tile(64, 2, 2))
    middle, long = (TILES_SCORES, TILES_LONG_SCORES) if scores else ({}, {})
    if max_len < NARROW_KEYS and (fmt, d) in TILES_NARROW:
        return TILES_NARROW[fmt, d]
    if bsz * max_len < SHORT_KEYS:
        return TILES_SHORT.get((fmt, d), tile)
    if max_len >= LONG_KEYS:
        many = TILES_LONG_MANY.get((fmt, d)) if bsz >= MANY_SEQS else None
        few = TILES_LONG_FEW.get((fmt, d)) if bsz < FEW_SEQS else None
        return long.get((fmt, d), many or few or TILES_LONG.get((fmt, d), tile))
    return middle.get((fmt, d), tile)


def decode_attention(q, k_pool, v_pool, slot_table, ctx_lens, scale=None, score=None, score_mode=None,
                     ema_decay=0.95, quant=None, split=None, block_n=None, out=None, programs_per_sm=None,
                     num_warps=None, rows=None, victim=None, num_stages=None, value_dot=None, contiguous=False,
                     resid=None, layer=False, paired=None, permute=None, staged=None, pairs=None, early=None,
                     key_dequant=None, count=None, max_regs=None):
    """q: [B, Hq, D]; k_pool/v_pool: [slots, Hkv, D] (or packed codes [slots, Hkv, D*bits/8] with
    quant=dict(bits=, group=, k_scale=, k_bias=, v_scale=, v_bias=) of [slots, Hkv, D/group]; or float8 e4m3
    codes [slots, Hkv, D] with quant=dict(bits="fp8", k_scale=, v_scale=) of [slots, Hkv, 1]);
    slot_table: [B, max_len] int32; ctx_lens: [B] int32; score: [B, max_len, Hkv] float32 (or, with
    rows [B], [R, >= max_len, Hkv] read at row rows[b]), updated in place with this step's probabilities
    when score_mode is "cumulative" | "normalized" | "ema".
    victim: dict(pos=[R, max_len, Hkv] int32, spare=[R, Hkv] int64, positions=[B], prefix=, recent=,
    by_score=, rank=) also picks each head's eviction victim after the fold (see `_fold_kernel`); needs rows. A
    sequence with ctx_lens[b] < max_len evicts nothing: slot ctx_lens[b] becomes its heads' spare.
    rank (`Policy.rank_source`): "attention" (default), "age", or "key-norm" / "key-diff", which score the keys
    themselves into `score`.
    value_dot: packed values as (p * scale) @ codes per group (one or two groups per head) instead of
    dequantized; None picks what measured faster on the H100: the tile's (`Tile.value_dot`), else on at d=128 with
    two groups, off at d=64.
    contiguous: each sequence's keys lie in slots slot_table[b, 0] + j (a per-sequence buffer, as virtual
    storage gives): only column 0 is read, so the table may be a [B, 1] column expanded to [B, max_len].
    resid: mixed widths over a 4-bit pool, `cache.quant.RecentResiduals.kernel_args`: each key that is a sink or
    among the window before the step's first position adds its 4-bit residual to its codes (values dequantized).
    layer: granularity "layer", every head folding in the sum over the layer's heads (the reference's `layer`).
    paired: `Tile.paired` (None: the table's tile's).
    permute: `Tile.permute` (None: the table's tile's; only where the kernel is compiled).
    staged: `Tile.staged` (None: the table's tile's, off where the call exports scores).
    pairs: `Tile.pairs` (None: the table's tile's; 8-bit values read as codes only).
    early: `Tile.early` (None: the table's tile's).
    key_dequant: `Tile.key_dequant` (None: the table's tile's; packed 8 / 4-bit keys only).
    max_regs: `Tile.max_regs` (None: the table's tile's; only where the kernel is compiled).
    count: [B, max_len, Hkv] float32 (or, with rows, [R, >= max_len, Hkv] read at row rows[b]), the tokens each key
    stands for: its logit gains log(count) (merged keys, `cache.merge`).
    Returns out [B, Hq, D] in q's dtype."""
    bsz, hq, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head_dim {d}: the decode kernel's tiles need a power of two")
    hkv = k_pool.shape[1]
    g = hq // hkv
    max_len = slot_table.shape[1]
    scale = d ** -0.5 if scale is None else scale
    # defaults from `benchmarks/decode_attention.py --tune` on an H200 (results/tune_dense_h200.log): 64-key
    # blocks, 4 warps and 4 programs per SM; packed tiles from `--tune-quant` on an H100
    # (results/tune_quant_d64_h100.log at d=64; tune_quant_q8_d128_h100.log, _q4_d128_h100.log and _short_h100.log at
    # d=128), where other tiles spill registers (up to 9x slower)
    bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
    if score_mode not in MODE_IDS:
        raise ValueError(f"unknown score_mode {score_mode!r} (choose from {', '.join(map(str, SCORE_MODES[1:]))})")
    mode = MODE_IDS[score_mode]
    export = mode != 0
    tile = kernel_tile("fp8" if fp8 else bits, d, bsz, max_len, contiguous, q.is_cuda, export)
    explicit = block_n is not None  # a caller's block size takes no table's split
    block_n = block_n or tile.keys
    num_warps = num_warps or tile.warps
    num_stages = num_stages or tile.stages
    programs_per_sm = programs_per_sm or tile.programs_per_sm
    paired = tile.paired if paired is None else paired
    pairs = tile.pairs if pairs is None else pairs
    early = tile.early if early is None else early
    key_dequant = (tile.key_dequant if key_dequant is None else key_dequant) and bits in (8, 4)
    max_regs = tile.max_regs if max_regs is None else max_regs
    staged = tile.staged and not export if staged is None else staged  # staged lost where it also exported
    if split is None and tile.split_blocks and not explicit:
        split = tile.split_blocks * block_n
    if bits == 4 and q.is_cuda and block_n < 32:
        raise ValueError(f"block_n {block_n}: the 4-bit kernel needs blocks of at least 32 keys on the GPU "
                         "(16 gave wrong results with Triton 3.6)")
    if split is None:  # enough programs to fill the GPU, at least a few blocks each
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        want = max(1, (programs_per_sm * sms) // max(1, bsz * hkv))
        split = max(block_n * 4, triton.cdiv(triton.cdiv(max_len, want), block_n) * block_n)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    if (victim or {}).get("rank", "attention") != "attention" and (rows is None or score is None):
        raise ValueError(f"rank {victim['rank']!r} ranks by stored scores: it needs rows and a score buffer")
    for name, t in (("score", score), ("victim pos", (victim or {}).get("pos")), ("count", count)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have its KV heads contiguous (last stride 1), got strides {t.stride()}")
    num_splits = max(1, triton.cdiv(max_len, split))
    min_split = min(split, 4 * block_n)  # each sequence spreads its own length over the splits (`_seq_split`)
    g_pad = max(MIN_QUERY_ROWS, triton.next_power_of_2(g))
    part_o = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    part_m = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    if export:  # probabilities relative to their block's running max: half precision for half inputs
        e_dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
        e = torch.empty(bsz, hq, max_len, device=q.device, dtype=e_dtype)
        m_blk = torch.empty(bsz, hq, triton.cdiv(max_len, block_n), device=q.device, dtype=torch.float32)
    else:
        e = m_blk = part_m
    if out is None:
        out = torch.empty_like(q)
    if resid is not None and bits != 4:
        raise ValueError(f"residuals add to a 4-bit pool, got {bits} bits")
    codes_fit = bits in (8, 4) and d // gs <= 2 and gs * bits // 8 >= 16  # groups the codes-dot can read
    if value_dot is None:  # the tile's, else on at d=128 (results/tune_quant_q8_d128_h100.log, _q4_d128_h100.log)
        wanted = d == 128 and d // gs == 2 if tile.value_dot is None else tile.value_dot
        value_dot = codes_fit and resid is None and wanted
    if value_dot and not codes_fit:
        raise ValueError(f"value_dot needs packed values of one or two groups per head of at least 16 code "
                         f"bytes, got {bits} bits, head_dim {d}, group {gs}")
    ss = (0, 0) if quant is None else (scales[0].stride(0), scales[0].stride(1))
    if value_dot and resid is not None:
        raise ValueError("residuals read values dequantized (value_dot=False)")
    pairs = pairs and value_dot and bits == 8
    if pairs and (v_pool.stride(0) % 2 or v_pool.stride(1) % 2):
        raise ValueError(f"pairs: 8-bit values are read two bytes a load, which needs even strides, got "
                         f"{v_pool.stride()}")
    ieee = q.dtype == torch.float32 or not q.is_cuda
    compiled = q.is_cuda and not INTERPRETING
    if permute is None:
        permute = tile.permute and compiled
    if permute and not compiled:
        raise ValueError("permute: inline PTX runs only in kernels compiled for the GPU (not TRITON_INTERPRET=1)")
    rt = _resid_args(resid, part_m)
    _split_kernel[(bsz, hkv, num_splits)](
        q, k_pool, v_pool, *scales, slot_table, ctx_lens, part_o, part_m, part_l, e, m_blk,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), ss[0], ss[1], slot_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        e.stride(0), e.stride(1), m_blk.stride(0), m_blk.stride(1), scale, min_split, *rt["reads"], *rt["ring"],
        part_m if count is None else count, ctx_lens if rows is None else rows,
        *((0, 0) if count is None else (count.stride(0), count.stride(1))),
        G=g, G_PAD=g_pad, D=d, BLOCK_N=block_n, BITS=bits, GS=gs, EXPORT=export, IEEE=ieee, VDOT=value_dot,
        FP8=fp8, CONTIG=bool(contiguous), RESID=resid is not None, SINK=rt["sink"], RECENT=rt["recent"],
        PAIR_K="k" in paired, PAIR_V="v" in paired, PERMUTE=permute, STAGED=staged, PAIRS=pairs, EARLY=early,
        KDEQ=key_dequant, COUNT=count is not None, COUNT_ROWS=rows is not None, num_warps=num_warps,
        **({} if num_stages is None else dict(num_stages=num_stages)),
        **({} if max_regs is None else dict(maxnreg=max_regs)))
    _merge_kernel[(bsz, hq)](
        part_o, part_m, part_l, out, ctx_lens,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        out.stride(0), out.stride(1), min_split, num_splits, BLOCK_N=block_n, D=d, MODE=mode,
        CHUNK=max(2, min(MERGE_CHUNK, triton.next_power_of_2(num_splits))))
    if export or victim is not None:
        # one block of keys per program (a chain of dependent loads is slow); with a victim, each block
        # proposes a candidate per head and `_victim_kernel` chooses among them
        block = 64
        blocks = triton.cdiv(max_len, block)
        vt = victim or {}
        pos, positions = vt.get("pos", part_m), vt.get("positions", ctx_lens)
        sc = score if score is not None else part_m
        hkv_pad = triton.next_power_of_2(hkv)
        cand = [part_m] * 3
        if victim is not None:
            cand = [torch.empty(bsz, blocks, hkv_pad, device=q.device, dtype=dt)
                    for dt in (torch.float32, torch.int32, torch.int32)]
        rank = RANK_IDS[vt.get("rank", "attention")]
        keys = (k_pool, *scales[:2], slot_table, out)
        key_strides = (k_pool.stride(0), k_pool.stride(1), *ss, slot_table.stride(0))
        key_tiles = dict(D=d, BITS=bits, GS=gs, FP8=fp8)
        unit_sum = part_m
        if rank == RANK_IDS["key-diff"]:  # the anchor's parts first: every block's keys score against it
            unit_sum = torch.empty(bsz, blocks, hkv_pad, d, device=q.device, dtype=torch.float32)
            _unit_sum_kernel[(bsz, blocks)](*keys, pos, rows, ctx_lens, unit_sum, *key_strides, pos.stride(0),
                                            pos.stride(1), HKV=hkv, HKV_PAD=hkv_pad, BLOCK=block, **key_tiles)
        _fold_kernel[(bsz, blocks)](
            e, m_blk, part_m, part_l, sc, rows if rows is not None else ctx_lens, pos, positions, ctx_lens, *cand,
            e.stride(0), e.stride(1), m_blk.stride(0), m_blk.stride(1), part_m.stride(0), part_m.stride(1),
            sc.stride(0) if score is not None else 0, sc.stride(1) if score is not None else 0,
            pos.stride(0) if victim else 0, pos.stride(1) if victim else 0,
            float(ema_decay), int(vt.get("prefix", 0)), int(vt.get("recent", 0)), *keys, unit_sum, *key_strides,
            blocks, G=g, HKV=hkv, HKV_PAD=hkv_pad, BLOCK=block, BLOCK_N=block_n, MODE=mode,
            ROWS=rows is not None, VICTIM=victim is not None, BY_SCORE=bool(vt.get("by_score", False)),
            LAYER=bool(layer), RANK=rank, **key_tiles)
        if victim is not None:
            spare = vt["spare"]
            _victim_kernel[(bsz,)](*cand, rows, pos, spare, ctx_lens, max_len, blocks, pos.stride(0), pos.stride(1),
                                   spare.stride(0), HKV=hkv, HKV_PAD=hkv_pad,
                                   NC_PAD=max(2, triton.next_power_of_2(blocks)), KEEP_POS=bool(vt.get("keep_pos")))
    return out


@triton.jit
def _evict_store_kernel(KN, VN, KP, VP, KS, KB, VS, VB, Table, Rows, Spare, Pos, Score, Count, Positions, stride_nt,
                        stride_nh, stride_ps, stride_ph, stride_ss, stride_sh, stride_tb, stride_spr, stride_pr,
                        stride_pj, stride_sr, stride_sj,
                        RK, RKS, RKB, RV, RVS, RVB, stride_rks, stride_rkh, stride_rss, stride_rsh, ring_row_entries,
                        D: tl.constexpr, DP: tl.constexpr, HAS_SCORE: tl.constexpr,
                        BITS: tl.constexpr, GS: tl.constexpr, FP8: tl.constexpr,
                        RESID: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, HAS_COUNT: tl.constexpr):
    """Sequence b, KV head h: the new token goes into the head's spare slot (K, V, position, score 0, count 1); packed
    pools (BITS 8/4, or FP8) take it quantized, as `store_kv` writes it; with RESID (mixed widths) its residuals
    go into its ring entry."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b)
    j = tl.load(Spare + row * stride_spr + h)
    slot = tl.load(Table + b * stride_tb + j).to(tl.int64)
    _store_token(KN, VN, KP, VP, KS, KB, VS, VB, b, h, slot, h, stride_nt, stride_nh, stride_ps, stride_ph, stride_ss,
                 stride_sh, D, DP, BITS, GS, FP8)
    p = tl.load(Positions + b)
    if RESID:
        rslot = row.to(tl.int64) * ring_row_entries + _ring_entry(p, SINK, RECENT)
        offs = tl.arange(0, D)
        _put_residual(tl.load(KN + b * stride_nt + h * stride_nh + offs), RK, RKS, RKB, rslot, h, stride_rks,
                      stride_rkh, stride_rss, stride_rsh, D, GS)
        _put_residual(tl.load(VN + b * stride_nt + h * stride_nh + offs), RV, RVS, RVB, rslot, h, stride_rks,
                      stride_rkh, stride_rss, stride_rsh, D, GS)
    tl.store(Pos + row * stride_pr + j * stride_pj + h, p.to(tl.int32))
    if HAS_SCORE:
        tl.store(Score + row * stride_sr + j * stride_sj + h, 0.0)
    if HAS_COUNT:  # laid out as the positions
        tl.store(Count + row * stride_pr + j * stride_pj + h, 1.0)


def evict_decode(q, k, v, k_pool, v_pool, table, lens, rows, positions, pos, spare, score, score_mode, ema_decay,
                 prefix: int, recent: int, quant=None, resid=None, layer=False, rank="attention", count=None):
    """One layer of the engine's steady-state bounded decode, fused: each head's new token into its spare
    slot, attention with score export over the `table` slots, and each head's next victim, which becomes
    its spare slot. pos/score/spare are the layer's stacked metadata [R, cap, H] / [R, H], read at
    rows[b]. Same result as the PyTorch route of `cache.steps.evict_decode` for policies whose protected
    tokens are a prefix of positions plus the `recent` newest. With `quant` (a packed pool, as for
    `decode_attention`) the new K/V are quantized into the spare slots; `resid` as for `decode_attention`, the new
    token's residuals written into its ring entry first; `layer` and `rank` as for `decode_attention` (the key
    ranks read no residuals). count [R, cap, H] (laid out as pos), a merging policy's: the new token counts 1,
    attention adds each key's log count, and each victim keeps its position for the merge that follows
    (`triton_merge.merge_victims(..., free=True)`, which then frees it)."""
    if count is not None and count.stride() != pos.stride():
        raise ValueError("merging: count laid out as pos")
    if rank.startswith("key") and resid is not None:
        raise ValueError(f"rank {rank!r} reads the keys without the window's residuals")
    bsz, hkv, d = k.shape
    sc = score if score is not None else pos
    bits, gs, fp8, scales = _quant_args(quant, k_pool, d)
    rt = _resid_args(resid, pos)
    _evict_store_kernel[(bsz, hkv)](
        k, v, k_pool, v_pool, *scales, table, rows, spare, pos, sc, pos if count is None else count, positions,
        k.stride(0), k.stride(1),
        k_pool.stride(0), k_pool.stride(1), scales[0].stride(0), scales[0].stride(1), table.stride(0),
        spare.stride(0), pos.stride(0), pos.stride(1), sc.stride(0), sc.stride(1), *rt["ring"],
        D=d, DP=triton.next_power_of_2(d), HAS_SCORE=score is not None, BITS=bits, GS=gs, FP8=fp8,
        RESID=resid is not None, SINK=rt["sink"], RECENT=rt["recent"], HAS_COUNT=count is not None)
    victim = dict(pos=pos, spare=spare, positions=positions, prefix=prefix, recent=recent,
                  by_score=score is not None, rank=rank, keep_pos=count is not None)
    return decode_attention(q, k_pool, v_pool, table, lens, score=score, score_mode=score_mode, ema_decay=ema_decay,
                            quant=quant, rows=rows, victim=victim, resid=resid, layer=layer, count=count)


@triton.jit
def _store_kernel(X, Y, Slots, P, PS, PB, YP, YPS, YPB, stride_xt, stride_xh, stride_yt, stride_yh, stride_st,
                  stride_sth, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
                  GS: tl.constexpr, FP8: tl.constexpr, DP: tl.constexpr):
    """Program (t, h, side): token t's head h of X into P / PS / PB (side 0), or of Y into YP / YPS / YPB (side 1).
    Unquantized heads may be of any size (DP: the next power of 2, masked)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Slots + t * stride_st + h * stride_sth).to(tl.int64)
    if slot < 0:
        return
    if BITS == 16 and not FP8:
        if tl.program_id(2) == 0:
            _copy_row(X, P, t * stride_xt + h * stride_xh, slot * stride_ps + h * stride_ph, D, DP)
        else:
            _copy_row(Y, YP, t * stride_yt + h * stride_yh, slot * stride_ps + h * stride_ph, D, DP)
    elif tl.program_id(2) == 0:
        x = tl.load(X + t * stride_xt + h * stride_xh + tl.arange(0, D))
        _put(x, P, PS, PB, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)
    else:
        y = tl.load(Y + t * stride_yt + h * stride_yh + tl.arange(0, D))
        _put(y, YP, YPS, YPB, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)


@triton.jit
def _store_token(KN, VN, KP, VP, KS, KB, VS, VB, b, h, slot, col, stride_nt, stride_nh, stride_ps, stride_ph,
                 stride_ss, stride_sh, D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                 FP8: tl.constexpr):
    """New token b's K and V of head h into pool slot `slot`, column `col`: as they are (any head size, a masked
    row), or quantized by `_put`."""
    if BITS == 16 and not FP8:
        _copy_row(KN, KP, b * stride_nt + h * stride_nh, slot * stride_ps + col * stride_ph, D, DP)
        _copy_row(VN, VP, b * stride_nt + h * stride_nh, slot * stride_ps + col * stride_ph, D, DP)
    else:
        offs = tl.arange(0, D)
        k = tl.load(KN + b * stride_nt + h * stride_nh + offs)
        v = tl.load(VN + b * stride_nt + h * stride_nh + offs)
        _put(k, KP, KS, KB, slot, col, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)
        _put(v, VP, VS, VB, slot, col, stride_ps, stride_ph, stride_ss, stride_sh, D, BITS, GS, FP8)


@triton.jit
def _copy_row(X, P, x_off, p_off, D: tl.constexpr, DP: tl.constexpr):
    """One unquantized head of any size (DP: the next power of 2, masked) from X + x_off into P + p_off."""
    offs = tl.arange(0, DP)
    dm = offs < D
    tl.store(P + p_off + offs, tl.load(X + x_off + offs, mask=dm).to(P.dtype.element_ty), mask=dm)


@triton.jit
def _put(x, P, PS, PB, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr, BITS: tl.constexpr,
         GS: tl.constexpr, FP8: tl.constexpr):
    """One token's K or V of head h ([D]) into `slot`: as fp8 codes and a scale, or as packed 8/4-bit codes with a
    scale and bias per group, bit for bit as the PyTorch packers (unquantized heads: `_copy_row`)."""
    offs_d = tl.arange(0, D)
    if FP8:  # e4m3 codes and an fp16 scale per token and head (its largest magnitude maps to 448), as `Fp8KV`
        xf = x.to(tl.float32)
        sc = tl.maximum(tl.max(tl.abs(xf), 0) / 448.0, 1e-7).to(tl.float16)
        codes = tl.minimum(tl.maximum(xf / sc.to(tl.float32), -448.0), 448.0)
        tl.store(P + slot * stride_ps + h * stride_ph + offs_d, codes.to(P.dtype.element_ty))
        tl.store(PS + slot * stride_ss + h * stride_sh, sc)
    else:
        NG: tl.constexpr = D // GS
        codes, sc, bi = _group_codes(x, D, BITS, GS)
        codes = tl.reshape(codes.to(tl.uint8), [D])
        offs_g = tl.arange(0, NG)
        tl.store(PS + slot * stride_ss + h * stride_sh + offs_g, sc)
        tl.store(PB + slot * stride_ss + h * stride_sh + offs_g, bi)
        if BITS == 8:
            tl.store(P + slot * stride_ps + h * stride_ph + offs_d, codes)
        else:
            pairs = tl.reshape(codes, [D // 2, 2])
            even, odd = tl.split(pairs)
            tl.store(P + slot * stride_ps + h * stride_ph + tl.arange(0, D // 2), even | (odd << 4))


@triton.jit
def _group_codes(x, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr):
    """x [D] -> (codes [D / GS, GS] as rounded floats, fp16 scales, fp16 biases), as `packing.quantize`."""
    NG: tl.constexpr = D // GS
    xg = tl.reshape(x.to(tl.float32), [NG, GS])
    lo = tl.min(xg, 1)
    hi = tl.max(xg, 1)
    levels: tl.constexpr = (1 << BITS) - 1
    sc = ((hi - lo) / levels).to(tl.float16)
    bi = lo.to(tl.float16)
    scf = tl.maximum(sc.to(tl.float32), 1e-8)
    codes = (xg - bi.to(tl.float32)[:, None]) / scf[:, None]
    codes = tl.minimum(tl.maximum(codes, 0.0), levels)
    r = tl.floor(codes + 0.5)  # round half to even, as torch.round does
    return tl.where(((r - codes) == 0.5) & ((r % 2) == 1), r - 1.0, r), sc, bi


@triton.jit
def _put_residual(x, P, PS, PB, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D: tl.constexpr,
                  GS: tl.constexpr):
    """Mixed widths: x [D] minus its 4-bit read-back (in x's dtype), quantized to 4 bits into ring entry `slot`,
    as `cache.quant.RecentResiduals` writes it."""
    NG: tl.constexpr = D // GS
    codes, sc, bi = _group_codes(x, D, 4, GS)
    main = codes * sc.to(tl.float32)[:, None]
    main = main + bi.to(tl.float32)[:, None]
    if x.dtype == tl.bfloat16:  # rounded to bf16 as PyTorch rounds (to nearest, ties to even), in integer ops
        bits = main.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        main = bits.to(tl.float32, bitcast=True)
    elif x.dtype != tl.float32:
        main = main.to(x.dtype).to(tl.float32)
    res = x.to(tl.float32) - tl.reshape(main, [D])
    _put(res, P, PS, PB, slot, h, stride_ps, stride_ph, stride_ss, stride_sh, D, 4, GS, False)


@triton.jit
def _residual_store_kernel(X, Entry, P, PS, PB, stride_xt, stride_xh, stride_ps, stride_ph, stride_ss, stride_sh,
                           D: tl.constexpr, GS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    entry = tl.load(Entry + t).to(tl.int64)
    if entry < 0:
        return
    x = tl.load(X + t * stride_xt + h * stride_xh + tl.arange(0, D))
    _put_residual(x, P, PS, PB, entry, h, stride_ps, stride_ph, stride_ss, stride_sh, D, GS)


def store_residuals(x, entries, codes, scale, bias, group):
    """Mixed widths: each token of x [T, H, D] minus its 4-bit read-back, quantized to 4 bits into ring entry
    entries[t] of codes / scale / bias [entries, H, ...] (-1 skips), as `cache.quant.RecentResiduals.write`."""
    t, h, d = x.shape
    _residual_store_kernel[(t, h)](x, entries, codes, scale, bias, x.stride(0), x.stride(1), codes.stride(0),
                                   codes.stride(1), scale.stride(0), scale.stride(1), D=d, GS=group)


def store_kv(x, slots, pool, scale=None, bias=None, bits=16, group=64, also=None):
    """Write x [T, Hkv, D] (any strides but the last) into pool at slots [T, Hkv] (one slot per token and KV head;
    -1 skips), quantizing on the way in: to `bits` 8/4 with scale/bias pools, or to "fp8" codes (pool of
    float8_e4m3fn) with a scale pool [slots, Hkv, 1].
    also: (x, pool, scale, bias) of a second tensor (V beside K) written at the same slots in the same launch, into
    pools of the same strides: a decode step's write is then one launch a layer, and no copy of strided K/V."""
    t, h, d = x.shape
    fp8 = bits == "fp8"
    sides = [(x, pool, scale, bias)] + ([also] if also is not None else [])
    sides = [(y if y.stride(-1) == 1 else y.contiguous(), p, s if s is not None else p, b if b is not None else p)
             for y, p, s, b in sides]
    (x, pool, scale, bias), (y, y_pool, y_scale, y_bias) = sides[0], sides[-1]
    ps = (0, 0) if scale is pool else (scale.stride(0), scale.stride(1))
    if y_pool.stride() != pool.stride() or (y_scale is not y_pool and y_scale.stride() != scale.stride()):
        raise ValueError(f"store_kv: both pools need one layout, got strides {pool.stride()} and {y_pool.stride()}")
    _store_kernel[(t, h, len(sides))](
        x, y, slots, pool, scale, bias, y_pool, y_scale, y_bias, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        slots.stride(0), slots.stride(1), pool.stride(0), pool.stride(1), ps[0], ps[1],
        D=d, BITS=16 if fp8 else bits, GS=group, FP8=fp8, DP=triton.next_power_of_2(d))


@triton.jit
def _rope_kernel(X, Cos, Sin, Wq, Wk, stride_xt, stride_xh, stride_ct, heads, q_heads, eps,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)  # one token, all its q and k heads: [HEADS_P, HALF_P] tiles
    hs = tl.arange(0, HEADS_P)[:, None]
    offs = tl.arange(0, HALF_P)[None, :]
    m = (hs < heads) & (offs < HALF)
    p = X + t * stride_xt + hs * stride_xh + offs
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    if NORM:  # RMS norm of each head with the q or k weight, rounded to x's dtype as the separate op would
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        is_q = hs < q_heads
        w1 = tl.where(is_q, tl.load(Wq + offs, mask=offs < HALF, other=0.0),
                      tl.load(Wk + offs, mask=offs < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(Wq + HALF + offs, mask=offs < HALF, other=0.0),
                      tl.load(Wk + HALF + offs, mask=offs < HALF, other=0.0)).to(tl.float32)
        x1 = (x1 * r * w1).to(X.dtype.element_ty).to(tl.float32)
        x2 = (x2 * r * w2).to(X.dtype.element_ty).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + offs, mask=offs < HALF, other=0.0)
    s = tl.load(Sin + t * stride_ct + offs, mask=offs < HALF, other=0.0)
    tl.store(p, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=m)
    tl.store(p + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(X, Out, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=m, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)  # silu rounded, as torch's op
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=m)


def silu_mul(x):
    """silu(gate) * up of a fused gate_up projection's output x [T, 2I] -> [T, I]: one pass instead of two."""
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(two_i // 2, block))](x, out, two_i // 2, x.stride(0), out.stride(0),
                                                          BLOCK=block)
    return out


def rope_inplace(x, cos, sin, heads: int, norm=None):
    """Rotate the first `heads` heads of x [T, H, D] in place (rotate-half RoPE, fp32 math, as
    model.apply_rope): one launch for the q and k heads of a fused qkv projection, no copies.
    norm=(q_weight, k_weight, q_heads, eps) first RMS-normalizes each head (Qwen3's q_norm / k_norm), in the
    same launch."""
    t, _, d = x.shape
    wq, wk, q_heads, eps = norm if norm is not None else (cos, cos, 0, 0.0)
    _rope_kernel[(t,)](x, cos, sin, wq, wk, x.stride(0), x.stride(1), cos.stride(0), heads, q_heads, eps,
                       HALF=d // 2, HALF_P=triton.next_power_of_2(d // 2), HEADS_P=triton.next_power_of_2(heads),
                       NORM=norm is not None)
