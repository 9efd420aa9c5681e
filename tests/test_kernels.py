"""Triton kernels against the PyTorch reference, on CPU through the Triton interpreter.

Fresh random inputs, odd lengths, slot tables out of order, GQA, all score modes, dense and packed KV.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kvbound.kernels import causal_attention as attend  # noqa: E402
from kvbound.kernels.triton_decode import decode_attention, store_kv  # noqa: E402
from kvbound.kernels.packing import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(seed, bsz, hq, hkv, d, lens, slots=None):
    slots = slots or max(300, sum(lens))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hq, d, generator=gen)
    k = torch.randn(slots, hkv, d, generator=gen)
    v = torch.randn(slots, hkv, d, generator=gen)
    max_len = max(lens)
    table = torch.zeros(bsz, max_len, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)
    at = 0
    for b, n in enumerate(lens):  # disjoint, shuffled slots per sequence
        table[b, :n] = perm[at:at + n]
        at += n
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k, v, table, lens, mode, score0, decay):
    outs, scores = [], score0.clone().double()
    for b, n in enumerate(lens.tolist()):
        idx = table[b, :n].long()
        out, ks = attend(q[b:b + 1].double(), k[idx].double(), v[idx].double(), mode)
        outs.append(out[0])
        if mode == "ema":
            scores[b, :n] = decay * scores[b, :n] + (1 - decay) * ks
        elif mode is not None:
            scores[b, :n] += ks  # "normalized" already weighted by n inside attend
    return torch.stack(outs), scores


@pytest.mark.parametrize("shape", [(3, 9, 3, 64, [37, 1, 130]), (2, 8, 2, 32, [65, 200]), (1, 4, 4, 16, [77]),
                                   (2, 8, 2, 32, [1100, 45])])
@pytest.mark.parametrize("mode", [None, "cumulative", "normalized", "ema"])
def test_decode_attention_dense_matches_reference(shape, mode):
    """Every score mode; the last shape takes 18 splits of 64 keys, which the merge reads in two chunks
    (`MERGE_CHUNK`)."""
    bsz, hq, hkv, d, lens = shape
    q, k, v, table, n = _case(shape[0] * 10 + len(str(mode)), bsz, hq, hkv, d, lens)
    score0 = torch.rand(bsz, max(lens), hkv)
    score = score0.clone().to(DEV)
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), n.to(DEV), score=score,
                           score_mode=mode, ema_decay=0.9, split=64, block_n=16)
    want, want_score = _reference(q, k, v, table, n, mode, score0, 0.9)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)
    if mode is not None:
        got = score.cpu()
        for b, ln in enumerate(lens):
            torch.testing.assert_close(got[b, :ln].double(), want_score[b, :ln], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", [None, "cumulative", "ema"])
def test_decode_attention_logit_bias_matches_reference(mode):
    """Merged keys' log counts (`count`) added to the logits, with and without score export: the reference's output
    and scores, over split sequences."""
    from kvbound.kernels.reference import paged_decode_attention
    bsz, hq, hkv, d, lens = 3, 8, 2, 32, [37, 1, 150]
    q, k, v, table, n = _case(71 + len(str(mode)), bsz, hq, hkv, d, lens)
    count = torch.rand(bsz, max(lens), hkv, generator=torch.Generator().manual_seed(3)).mul(4).add(1)
    score0 = torch.rand(bsz, max(lens), hkv)
    got_score, want_score = score0.clone().to(DEV), score0.clone()
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), n.to(DEV), score=got_score, score_mode=mode,
                           ema_decay=0.9, split=64, block_n=16, count=count.to(DEV))
    want = paged_decode_attention(q, k, v, table, n, score=want_score, score_mode=mode, ema_decay=0.9, count=count)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    plain = paged_decode_attention(q, k, v, table, n)
    assert (plain - want).abs().max() > 1e-2  # the bias changed the output
    for b, ln in enumerate(lens):
        torch.testing.assert_close(got_score.cpu()[b, :ln], want_score[b, :ln], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bits, d, group, value_dot, paired", [
    (8, 64, 32, None, ""), (8, 64, 32, True, ""), (4, 64, 32, None, ""), (8, 128, 64, None, ""),
    (8, 128, 64, False, ""), (4, 128, 128, None, ""), (8, 64, 64, None, ""), (8, 64, 64, True, ""),
    (8, 128, 128, True, ""), (4, 128, 64, None, ""), (4, 128, 64, False, ""), (4, 64, 64, True, ""),
    (4, 128, 128, True, ""), (8, 128, 64, None, "k"), (8, 128, 64, None, "v"), (4, 128, 64, None, "kv"),
    (4, 128, 64, False, "kv"), (8, 64, 32, True, "kv"), (4, 128, 128, True, "kv"), (8, 128, 64, True, "pairs"),
    (8, 128, 128, True, "pairs"), (8, 64, 32, True, "v pairs"), (8, 64, 64, True, "pairs"),
    (8, 128, 64, True, "pairs early"), (8, 128, 64, None, "k early"), (4, 128, 64, True, "kv early"),
    (4, 128, 64, False, "early"), (8, 64, 64, True, "early"), (8, 128, 64, None, "dequant"),
    (4, 64, 64, True, "dequant early"), (8, 64, 32, True, "pairs dequant"), (4, 128, 128, False, "dequant")])
def test_decode_attention_quantized_matches_dequantize_then_attend(bits, d, group, value_dot, paired):
    """Both routes of packed values (codes-dot and dequantize), one and two groups per head, each group's scales
    read alone or a key's two groups' in one load (`paired`), 8-bit values' codes read as byte pairs or not, a
    block's loads all before its dots (`early`) or not, keys through a dot per group or dequantized (`dequant`)."""
    pairs, early, key_dequant = "pairs" in paired, "early" in paired, "dequant" in paired
    paired = paired.replace("pairs", "").replace("early", "").replace("dequant", "").strip()
    q, k, v, table, n = _case(7 + d + group, 2, 6, 2, d, [45, 129])
    kc, kscale, kbias = quantize(k, bits, group)
    vc, vscale, vbias = quantize(v, bits, group)
    kd, vd = dequantize(kc, kscale, kbias, bits, group), dequantize(vc, vscale, vbias, bits, group)
    score = torch.zeros(2, 129, 2, device=DEV)
    dev = [t.to(DEV) for t in (q, kc, vc, table, n, kscale, kbias, vscale, vbias)]
    quant = dict(bits=bits, group=group, k_scale=dev[5], k_bias=dev[6], v_scale=dev[7], v_bias=dev[8])
    out = decode_attention(*dev[:5], score=score, score_mode="cumulative", split=64, block_n=32, value_dot=value_dot,
                           paired=paired, pairs=pairs, early=early, key_dequant=key_dequant, quant=quant).cpu()
    score = score.cpu()
    want, want_score = _reference(q, kd, vd, table, n, "cumulative", torch.zeros(2, 129, 2), 0)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score.double(), want_score, atol=1e-5, rtol=1e-4)


def test_value_dot_on_groups_it_cannot_read_is_one_clear_error():
    """Asking for values through the dot where a head holds more than two groups, or a group under 16 code bytes,
    names the shape; left to its rule the kernel reads such values dequantized."""
    q, k, v, table, n = _case(3, 2, 4, 2, 64, [40, 33])
    for bits, group in ((8, 16), (4, 16)):
        (kc, ks, kb), (vc, vs, vb) = quantize(k, bits, group), quantize(v, bits, group)
        quant = dict(bits=bits, group=group, k_scale=ks.to(DEV), k_bias=kb.to(DEV), v_scale=vs.to(DEV),
                     v_bias=vb.to(DEV))
        args = [t.to(DEV) for t in (q, kc, vc, table, n)]
        with pytest.raises(ValueError, match=f"value_dot needs .* got {bits} bits, head_dim 64, group {group}"):
            decode_attention(*args, quant=quant, value_dot=True)
        kd, vd = dequantize(kc, ks, kb, bits, group), dequantize(vc, vs, vb, bits, group)
        want, _ = _reference(q, kd, vd, table, n, None, torch.zeros(2, 40, 2), 0)
        torch.testing.assert_close(decode_attention(*args, quant=quant).double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt, d, scores, many, group", [
    (8, 64, False, False, 32), (4, 64, False, False, 32), (4, 64, False, True, 32), ("fp8", 64, False, False, 32),
    (8, 128, False, False, 32), (8, 128, True, False, 32), (8, 128, False, False, 64), (8, 128, True, False, 64)])
def test_packed_decode_on_the_gpus_long_table_tiles_matches_dequantize_then_attend(fmt, d, scores, many, group):
    """The tile a call over 4k-wide tables takes on the GPU when it reads enough keys to leave the short tiles (at
    d=64 256 keys, 4-bit's with 8 warps, or, for `many` sequences, 128 keys with byte permutes; 8-bit's at d=128
    values as byte pairs in 64-key blocks with early loads, 128-key ones when it exports scores), with the kernel's
    own splits. Group 64 at d=128 gives two groups a head, as the engine's pools do: values through the dot, and the
    early loads of both key groups."""
    from kvbound.cache.quant import Fp8KV
    from kvbound.kernels.triton_decode import FEW_SEQS, LONG_KEYS, MANY_SEQS, SHORT_KEYS, kernel_tile
    q, k, v, table, n = _case(5, 2, 6, 2, d, [LONG_KEYS, 1500], slots=LONG_KEYS + 1600)
    if fmt == "fp8":
        (kc, ks), (vc, vs) = Fp8KV._pack(k), Fp8KV._pack(v)
        kd, vd = Fp8KV._unpack(kc, ks, torch.float32), Fp8KV._unpack(vc, vs, torch.float32)
        kc, vc, quant = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn), dict(bits="fp8", k_scale=ks, v_scale=vs)
    else:
        (kc, kscale, kbias), (vc, vscale, vbias) = quantize(k, fmt, group), quantize(v, fmt, group)
        kd, vd = dequantize(kc, kscale, kbias, fmt, group), dequantize(vc, vscale, vbias, fmt, group)
        quant = dict(bits=fmt, group=group, k_scale=kscale, k_bias=kbias, v_scale=vscale, v_bias=vbias)
    seqs = MANY_SEQS if many else SHORT_KEYS // LONG_KEYS  # the fewest sequences whose keys leave the short tiles
    assert FEW_SEQS <= seqs <= MANY_SEQS
    tile = kernel_tile(fmt, d, seqs, LONG_KEYS, cuda=True, scores=scores)
    score = torch.zeros(2, LONG_KEYS, 2, device=DEV) if scores else None
    out = decode_attention(*(t.to(DEV) for t in (q, kc, vc, table, n)), block_n=tile.keys, num_warps=tile.warps,
                           num_stages=tile.stages, programs_per_sm=tile.programs_per_sm, paired=tile.paired,
                           permute=tile.permute and DEV == "cuda", pairs=tile.pairs, early=tile.early,
                           score=score, score_mode="cumulative" if scores else None,
                           quant={key: t if isinstance(t, (str, int)) else t.to(DEV) for key, t in quant.items()}).cpu()
    mode = "cumulative" if scores else None
    want, want_score = _reference(q, kd, vd, table, n, mode, torch.zeros(2, LONG_KEYS, 2), 0)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    if scores:
        torch.testing.assert_close(score.cpu().double(), want_score, atol=1e-5, rtol=1e-4)


def test_kernel_registers_compiles_a_narrow_tile_for_sm90_without_a_gpu():
    """benchmarks/kernel_registers.py: the split kernel for sm_90 on the CPU, one line of counts a config; a cap on
    registers holds; a bad config gets one line and exit 2."""
    import pathlib
    import subprocess
    import sys
    import triton
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton has no cuobjdump")
    root = pathlib.Path(__file__).parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root / "src")}
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_registers.py"),
                          '{"shape": "smollm2", "bits": 8, "max_regs": 96}'], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    regs, spills, sass, shared = run.stdout.splitlines()[-1].split("}")[1].split()[:4]
    assert int(regs) <= 96 and int(sass) > 100 and int(shared) > 0 and int(spills) >= 0
    bad = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_registers.py"), '{"bits": 3}'],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()[-1]) > 0 and "bits one of" in bad.stderr


@pytest.mark.parametrize("fmt, d, max_regs", [(8, 64, None), (4, 64, None), (8, 128, None), (4, 128, None),
                                              (8, 64, 96), (8, 128, 96)])
def test_packed_decode_on_the_gpus_narrow_table_tiles_matches_dequantize_then_attend(fmt, d, max_regs):
    """The tile a bounded cache's narrow table takes on the GPU (h2o 256: 272 wide), exporting scores: at d=64 values
    through the dot as codes (`Tile.value_dot`), 8-bit's read as byte pairs, loads early; 4-bit's keys dequantized
    (`Tile.key_dequant`) at either head size. Also with registers capped (`Tile.max_regs`), which spills on the GPU."""
    from kvbound.kernels.triton_decode import kernel_tile
    q, k, v, table, n = _case(9, 3, 6, 2, d, [257, 200, 31])
    (kc, kscale, kbias), (vc, vscale, vbias) = quantize(k, fmt, 64), quantize(v, fmt, 64)
    kd, vd = dequantize(kc, kscale, kbias, fmt, 64), dequantize(vc, vscale, vbias, fmt, 64)
    quant = dict(bits=fmt, group=64, k_scale=kscale, k_bias=kbias, v_scale=vscale, v_bias=vbias)
    tile = kernel_tile(fmt, d, 3, 272, cuda=True, scores=True)
    assert tile.split_blocks and tile.key_dequant == (fmt == 4) and (tile.early and tile.value_dot) == (d == 64)
    score = torch.zeros(3, 257, 2, device=DEV)
    out = decode_attention(*(t.to(DEV) for t in (q, kc, vc, table, n)), block_n=tile.keys, num_warps=tile.warps,
                           num_stages=tile.stages, split=tile.split_blocks * tile.keys, value_dot=tile.value_dot,
                           permute=tile.permute and DEV == "cuda", pairs=tile.pairs, early=tile.early,
                           key_dequant=tile.key_dequant, score=score, max_regs=max_regs,
                           score_mode="cumulative", quant={key: t if isinstance(t, int) else t.to(DEV)
                                                           for key, t in quant.items()}).cpu()
    want, want_score = _reference(q, kd, vd, table, n, "cumulative", torch.zeros(3, 257, 2), 0)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score.cpu().double(), want_score, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d, group", [(64, 32), (128, 64)])
def test_decode_attention_adds_mixed_widths_residuals_as_the_reference(d, group):
    """heavy=4,recent=8 over a 4-bit pool: keys that are sinks or in the window before each sequence's `first` add
    their ring residuals (positions out of order, a free place, rows of a larger ring, layer 1 of 2); output and
    scores equal the reference's, and differ without the residuals."""
    from kvbound.cache.quant import RecentResiduals
    from kvbound.kernels import paged_decode_attention
    lens, hkv = [45, 129], 2
    q, k, v, table, n = _case(40 + d, 2, 6, hkv, d, lens)
    (kc, *ks), (vc, *vs) = quantize(k, 4, group), quantize(v, 4, group)
    ring = RecentResiduals(4, 2, hkv, d, sink=3, recent=20, group_size=group, device="cpu")
    gen = torch.Generator().manual_seed(d)
    for side in (ring.k, ring.v):
        side.codes.copy_(torch.randint(0, 256, side.codes.shape, generator=gen))
        side.scale.copy_(torch.rand(side.scale.shape, generator=gen) * 0.02)
        side.bias.copy_(-torch.rand(side.bias.shape, generator=gen) * 0.1)
    rows, first = torch.tensor([3, 1]), torch.tensor([200, 140])
    pos = torch.full((4, 129, hkv), -1, dtype=torch.int32)
    for b, (row, ln) in enumerate(zip(rows.tolist(), lens)):
        for h in range(hkv):
            pos[row, :ln, h] = (torch.randperm(ln, generator=gen) + int(first[b]) - ln).int()
            pos[row, h:3 + h, h] = torch.arange(3, dtype=torch.int32)  # the sinks
        pos[row, 7] = -1
    def on(args, device):  # a kernel-arguments dict on `device`
        return {x: t.to(device) if torch.is_tensor(t) else [u.to(device) for u in t] if isinstance(t, list) else t
                for x, t in args.items()}
    outs = []
    for kernel in (decode_attention, paged_decode_attention, decode_attention):
        device = "cpu" if kernel is paged_decode_attention else DEV
        resid = None if len(outs) == 2 else on(ring.kernel_args(1, rows, first, pos), device)
        dev = [t.to(device) for t in (q, kc, vc, table, n)]
        quant = on(dict(bits=4, group=group, k_scale=ks[0], k_bias=ks[1], v_scale=vs[0], v_bias=vs[1]), device)
        score = torch.zeros(2, 129, hkv, device=device)
        extra = dict(split=64, block_n=32) if kernel is decode_attention else {}
        outs.append((kernel(*dev, score=score, score_mode="cumulative", quant=quant, resid=resid, **extra).cpu(),
                     score.cpu()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-4)
    for b, ln in enumerate(lens):
        torch.testing.assert_close(outs[0][1][b, :ln], outs[1][1][b, :ln], atol=1e-5, rtol=1e-4)
    assert (outs[2][0] - outs[0][0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_store_kernel_writes_what_pytorch_writes(dtype):
    """Mixed widths' prefill write: the Triton store puts each kept token's residual (the window's last recent + 1
    and the sinks; a piece longer than that skips the rest) in its ring entry bit for bit as the PyTorch route,
    and touches nothing else."""
    from kvbound.cache.quant import RecentResiduals
    gen = torch.Generator().manual_seed(3)
    rows, positions = torch.tensor([2, 0]), torch.tensor([list(range(12)), list(range(20, 32))])
    k, v = (torch.randn(2, 12, 2, 64, generator=gen).to(dtype) for _ in range(2))
    rings = [RecentResiduals(3, 2, 2, 64, sink=2, recent=5, group_size=32, device=dev) for dev in ("cpu", DEV)]
    for ring in rings:
        for t in ring.tensors():
            t.fill_(7)
    rings[0].write(1, rows, positions, k, v, kernel=False)
    rings[1].write(1, rows.to(DEV), positions.to(DEV), k.to(DEV), v.to(DEV), kernel=True)
    for want, got in zip(rings[0].tensors(), rings[1].tensors()):
        assert torch.equal(got.cpu(), want)
    assert (rings[0].k.codes[2, 8:16] != 7).any() and (rings[0].k.codes[1] == 7).all()


def test_a_table_far_wider_than_the_contexts_gives_the_trimmed_tables_result():
    """A CUDA graph's table is as wide as its bucket: each sequence shares its own length among the grid's splits."""
    q, k, v, table, n = _case(21, 2, 4, 2, 32, [200, 3], slots=300)
    wide = torch.cat([table, torch.zeros(2, 1024 - table.shape[1], dtype=torch.int32)], 1)
    outs, scores = [], []
    for t in (table, wide):
        score = torch.zeros(2, t.shape[1], 2, device=DEV)
        outs.append(decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), t.to(DEV), n.to(DEV), score=score,
                                     score_mode="cumulative", split=64, block_n=32).cpu())
        scores.append(score[:, :200].cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[1], scores[0], atol=1e-6, rtol=1e-5)
    want, _ = _reference(q, k, v, table, n, None, torch.zeros(2, 200, 2), 0)
    torch.testing.assert_close(outs[1].double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [16, 8])
def test_contiguous_buffers_read_from_their_first_slot_equal_the_table(bits):
    """Per-sequence buffers (virtual storage): with `contiguous`, a [B, 1] column of first slots expanded to
    the table's width gives what the full table base + j gives, scores included."""
    lens, d = [70, 5, 129], 64
    q, k, v, _, n = _case(31 + bits, 3, 8, 2, d, lens, slots=3 * 160)
    base = torch.tensor([320, 0, 160], dtype=torch.int32)  # buffers of 160 slots, out of order
    table = base[:, None] + torch.arange(max(lens), dtype=torch.int32)
    quant = None
    if bits != 16:
        (k, *ks), (v, *vs) = quantize(k, bits, 32), quantize(v, bits, 32)
        quant = dict(bits=bits, group=32, k_scale=ks[0].to(DEV), k_bias=ks[1].to(DEV), v_scale=vs[0].to(DEV),
                     v_bias=vs[1].to(DEV))
    outs, scores = [], []
    for t, contiguous in ((table, False), (base[:, None].expand(-1, max(lens)), True)):
        score = torch.zeros(3, max(lens), 2, device=DEV)
        outs.append(decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), t.to(DEV), n.to(DEV), score=score, quant=quant,
                                     score_mode="cumulative", split=64, block_n=32, contiguous=contiguous).cpu())
        scores.append(score.cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    torch.testing.assert_close(scores[1], scores[0], atol=0, rtol=0)
    if bits == 16:
        want, _ = _reference(q, k, v, table, n, None, torch.zeros(3, max(lens), 2), 0)
        torch.testing.assert_close(outs[1].double(), want, atol=1e-4, rtol=1e-4)
        from kvbound.kernels import paged_decode_attention
        ref = paged_decode_attention(q, k, v, base[:, None].expand(-1, max(lens)), n, contiguous=True)
        torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-4)


def test_kernel_tile_follows_the_table_width_on_the_gpu():
    """Tiles on the GPU: long tables (4k keys or more) take 256-key blocks at d=64 (4-bit with 8 warps and no byte
    permutes, or with MANY_SEQS sequences 128-key blocks) and 128-key ones at two programs an SM at d=128; bounded
    caches' narrow tables two-block splits (8-bit and 4-bit at d=128: four, in 3 stages; fp8 at d=128: its middle
    tile); fp8 elsewhere takes bf16's tile, except its middle tables at d=128 (64-key blocks, 3 stages, values
    staged); 4-bit's middle and long tables at d=128 read paired scales, 8-bit's middle ones take its long ones' tile (short calls 64-key blocks at 8
    programs an SM; exporting scores 16 on middle tables, 4 warps on long ones); 8-bit's middle tables at d=64 convert
    codes without permutes, and its and 4-bit's narrow ones take values through the dot (8-bit's as byte pairs) with
    early loads; 4-bit's narrow ones dequantize keys; on the CPU every call takes bf16's."""
    from kvbound.kernels.triton_decode import FEW_SEQS, MANY_SEQS, Tile, kernel_tile
    bf16 = kernel_tile(16, 64, 43, 8192)
    assert kernel_tile(8, 64, 43, 8192) == kernel_tile("fp8", 64, 43, 8192) == Tile(256, 4, 2)
    assert kernel_tile(4, 64, 43, 8192) == Tile(256, 8, 2, permute=False)
    assert kernel_tile(4, 64, MANY_SEQS, 8192) == Tile(128, 4, 2) and kernel_tile(8, 64, MANY_SEQS, 8192) == Tile(256, 4, 2)
    # 8-bit at d=128 reads its values as byte pairs: long tables in 64-key blocks, 128-key ones for few sequences
    assert kernel_tile(8, 128, 7, 8192) == Tile(64, 4, 2, programs_per_sm=4, pairs=True, early=True)
    assert kernel_tile(8, 128, FEW_SEQS - 1, 32768) == Tile(128, 8, 3, programs_per_sm=2, pairs=True)
    assert kernel_tile(16, 128, 1, 32768) == kernel_tile("fp8", 128, 7, 8192) == Tile(128, 4, 2, programs_per_sm=2)
    assert kernel_tile(4, 128, 7, 8192) == kernel_tile(4, 128, 64, 2048) == Tile(128, 2, 2, paired="kv")
    # middle tables: 128-key blocks, as long tables of fewer than FEW_SEQS sequences
    assert kernel_tile(8, 128, 64, 2048) == Tile(128, 8, 3, programs_per_sm=2, pairs=True)
    assert kernel_tile(8, 128, 4, 2048) == Tile(64, 4, 2, programs_per_sm=8)  # short calls: 64-key blocks
    # fp8 at d=128: values staged on middle and narrow tables (decode_attention drops it where it exports scores),
    # bf16's tile for short calls
    assert kernel_tile("fp8", 128, 27, 2048) == kernel_tile("fp8", 128, 64, 272) == Tile(64, 4, 3, staged=True)
    assert kernel_tile("fp8", 128, 8, 2048) == Tile(64, 4, None)
    # exporting scores (h2o's step), 8-bit at d=128: 16 programs an SM on middle tables, 4 warps on long ones
    assert kernel_tile(8, 128, 29, 2048, scores=True) == Tile(64, 4, 2, programs_per_sm=16)
    assert kernel_tile(8, 128, 7, 8192, scores=True) == Tile(128, 4, 2, programs_per_sm=2, pairs=True, early=True)
    assert kernel_tile(8, 128, 64, 272, scores=True) == kernel_tile(8, 128, 64, 272)  # narrow tables: the same
    assert kernel_tile(4, 128, 7, 8192, scores=True) == kernel_tile(4, 128, 7, 8192)  # other formats: the same
    narrow = {16: Tile(64, 4, 2, split_blocks=2), "fp8": Tile(64, 4, 2, split_blocks=2),
              8: Tile(64, 4, 2, split_blocks=2, pairs=True, value_dot=True, early=True),
              4: Tile(64, 4, 2, split_blocks=2, value_dot=True, early=True, key_dequant=True)}
    for fmt, tile in narrow.items():  # h2o 256's 272-wide tables, at any batch
        assert kernel_tile(fmt, 64, 256, 272) == kernel_tile(fmt, 64, 64, 272) == tile
    assert kernel_tile(8, 128, 64, 272) == Tile(64, 4, 3, split_blocks=4)
    assert kernel_tile(4, 128, 64, 272) == Tile(64, 4, 3, split_blocks=4, key_dequant=True)
    assert kernel_tile(16, 128, 64, 272) == bf16
    assert kernel_tile(8, 64, 64, 2048) == Tile(128, 4, 2, permute=False) and kernel_tile("fp8", 64, 64, 2048) == bf16
    assert kernel_tile(4, 128, 4, 2048) == Tile(32, 4, 3)  # under SHORT_KEYS keys in all
    assert kernel_tile(8, 64, 43, 8192, cuda=False) == bf16 == Tile(64, 4, None)
    assert kernel_tile(16, 128, 4, 8192, contiguous=True) == kernel_tile("fp8", 128, 4, 8192, contiguous=True) \
        == Tile(64, 4, 1)


def test_narrow_tables_two_block_splits_match_the_reference():
    """A narrow table's tile (two blocks a program, `split_blocks`) spreads a 257-key context over three programs:
    out and scores as the reference's, bf16 and 8-bit at the tile the GPU takes."""
    from kvbound.kernels.triton_decode import kernel_tile
    q, k, v, table, n = _case(7, 2, 6, 2, 64, [257, 130], slots=400)
    tile = kernel_tile(8, 64, 2, 272, cuda=True)
    (kc, kscale, kbias), (vc, vscale, vbias) = quantize(k, 8, 32), quantize(v, 8, 32)
    kd, vd = dequantize(kc, kscale, kbias, 8, 32), dequantize(vc, vscale, vbias, 8, 32)
    quant = dict(bits=8, group=32, k_scale=kscale, k_bias=kbias, v_scale=vscale, v_bias=vbias)
    for kk, vv, qt, kref, vref in ((k, v, None, k, v), (kc, vc, quant, kd, vd)):
        score = torch.zeros(2, table.shape[1], 2, device=DEV)
        qt = qt and {key: t if isinstance(t, int) else t.to(DEV) for key, t in qt.items()}
        out = decode_attention(*(t.to(DEV) for t in (q, kk, vv, table, n)), quant=qt, score=score,
                               score_mode="cumulative", block_n=tile.keys, split=tile.split_blocks * tile.keys)
        want, want_score = _reference(q, kref, vref, table, n, "cumulative", torch.zeros(2, table.shape[1], 2), 0)
        torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(score.cpu().double(), want_score, atol=1e-5, rtol=1e-4)


def test_benchmark_tile_specs_read_every_tile_flag(monkeypatch):
    """The kernel benchmark's --tile-variants and the engine benchmark's --packed-tiles read one flag form
    (`decode_attention.tile_flags`), every `Tile` flag among them, with a line naming a bad one."""
    import importlib
    import pathlib
    from kvbound.kernels.triton_decode import Tile
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    bench, engine_bench = importlib.import_module("decode_attention"), importlib.import_module("engine_throughput")
    default = dict(paired="", permute=True, staged=False, pairs=False, early=False, value_dot=None, key_dequant=False,
                   max_regs=None)
    assert bench.tile_variants("64:4:2:4") == [(64, 4, 2, 4, default)]
    assert bench.tile_variants("64:4:2:s2")[0][3] == "s2" and bench.split_or_programs(64, "s2") == dict(split=128)
    flags = bench.tile_variants("64:4:2:4:kv:-:s:b:e:n:q:r128")[0][4]
    assert flags == dict(paired="kv", permute=False, staged=True, pairs=True, early=True, value_dot=False,
                         key_dequant=True, max_regs=128)
    assert bench.flags_label(flags) == "kv:-:s:b:e:n:q:r128"
    assert engine_bench.tile_entries("narrow:8:128:64:4:3:4:4:-:p:-:-:-:-:-:r128")[0][2] == \
        Tile(64, 4, 3, split_blocks=4, max_regs=128)
    with pytest.raises(ValueError, match="max_regs 'r8'"):
        bench.tile_variants("64:4:2:4:-:p:-:b:e:d:-:r8")
    (table, key, tile), = engine_bench.tile_entries("long:8:128:64:4:2:0:4:-:p:-:b:e")
    assert (table, key, tile) == ("long", (8, 128), Tile(64, 4, 2, None, 4, pairs=True, early=True))
    assert engine_bench.tile_entries("narrow:fp8:64:64:4:2:2")[0][2] == Tile(64, 4, 2, split_blocks=2)
    assert engine_bench.tile_entries("mid:4:128:128:2:2:0:4:kv:-:-:-:-:d")[0][2] == \
        Tile(128, 2, 2, None, 4, paired="kv", permute=False, value_dot=True)
    with pytest.raises(ValueError, match="early 'x'"):
        bench.tile_variants("64:4:2:4:-:p:-:b:x")
    with pytest.raises(ValueError, match="is not"):
        engine_bench.tile_entries("long:8:128:64")
    from kvbound.kernels import triton_decode  # rows:N pads query heads to N rows for one sweep entry, then back
    engine_bench.use_tiles(engine_bench.tile_entries("rows:16,narrow:8:64:64:4:2:2"))
    assert triton_decode.MIN_QUERY_ROWS == 16 and triton_decode.TILES_NARROW[8, 64] == Tile(64, 4, 2, split_blocks=2)
    engine_bench.use_tiles([])
    assert triton_decode.MIN_QUERY_ROWS == 1 and triton_decode.TILES_NARROW == engine_bench.KERNEL_TILES["narrow"]
    with pytest.raises(ValueError, match="rows:N"):
        engine_bench.tile_entries("rows:0")
    with pytest.raises(ValueError, match="is not"):
        bench.tile_variants("64:4:2:sx")


def test_a_tables_tile_sets_the_split_and_the_paired_scales_of_a_default_call(monkeypatch):
    """A call that names no tile takes its table's: `split_blocks` blocks a program and `paired` scale loads (on the
    CPU every table's tile is bf16's, so the GPU's is put in its place here); out and scores as the reference's."""
    from kvbound.kernels import triton_decode
    from kvbound.kernels.triton_decode import Tile
    launches, split_kernel = [], triton_decode._split_kernel

    class Recorder:  # the split kernel's launch grid (batch, KV heads, programs a sequence), then the kernel
        def __getitem__(self, grid):
            launches.append(grid)
            return split_kernel[grid]
    monkeypatch.setattr(triton_decode, "_split_kernel", Recorder())
    monkeypatch.setattr(triton_decode, "kernel_tile", lambda *a, **kw: Tile(32, 4, 2, split_blocks=2, paired="kv"))
    q, k, v, table, n = _case(17, 2, 6, 2, 128, [257, 130], slots=400)
    (kc, kscale, kbias), (vc, vscale, vbias) = quantize(k, 4, 64), quantize(v, 4, 64)
    kd, vd = dequantize(kc, kscale, kbias, 4, 64), dequantize(vc, vscale, vbias, 4, 64)
    quant = {key: t if isinstance(t, int) else t.to(DEV) for key, t in dict(
        bits=4, group=64, k_scale=kscale, k_bias=kbias, v_scale=vscale, v_bias=vbias).items()}
    score = torch.zeros(2, table.shape[1], 2, device=DEV)
    out = decode_attention(*(t.to(DEV) for t in (q, kc, vc, table, n)), quant=quant, score=score,
                           score_mode="cumulative", value_dot=True)
    assert launches == [(2, 2, -(-table.shape[1] // 64))]  # 64 keys a program
    want, want_score = _reference(q, kd, vd, table, n, "cumulative", torch.zeros(2, table.shape[1], 2), 0)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score.cpu().double(), want_score, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d, mode", [(64, "cumulative"), (128, "ema"), (32, None)])
def test_decode_attention_fp8_matches_dequantize_then_attend(d, mode):
    """float8 e4m3 codes with a scale per token and head (`Fp8KV`): the kernel applies the scales per key."""
    from kvbound.cache.quant import Fp8KV
    q, k, v, table, n = _case(11 + d, 3, 8, 2, d, [45, 129, 3])
    (kc, ks), (vc, vs) = Fp8KV._pack(k), Fp8KV._pack(v)
    kd, vd = Fp8KV._unpack(kc, ks, torch.float32), Fp8KV._unpack(vc, vs, torch.float32)
    score = torch.rand(3, 129, 2, generator=torch.Generator().manual_seed(2))
    got_score = score.clone().to(DEV)
    dev = [t.to(DEV) for t in (q, kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn), table, n, ks, vs)]
    out = decode_attention(*dev[:5], score=got_score if mode else None, score_mode=mode, split=64, block_n=32,
                           quant=dict(bits="fp8", k_scale=dev[5], v_scale=dev[6])).cpu()
    want, want_score = _reference(q, kd, vd, table, n, mode, score, 0.95)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_score.cpu().double(), want_score, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(DEV == "cpu", reason="Triton 3.9's interpreter rounds 125.6 to float8 64, not 128 (a carry into "
                    "the exponent is lost); the GPU converts in hardware")
def test_store_kv_fp8_writes_the_codes_and_scales_of_the_pool_packer():
    from kvbound.cache.quant import Fp8KV
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, 4)[:, None, None]
    slots = torch.tensor([[4, 0, 9], [1, 2, 3], [-1, 5, 6], [7, 8, 10]], dtype=torch.int32)
    codes = torch.full((11, 3, 64), 99, dtype=torch.uint8)
    scale = torch.zeros(11, 3, 1, dtype=torch.float16)
    codes, scale = codes.to(DEV), scale.to(DEV)
    store_kv(x.to(DEV), slots.to(DEV), codes.view(torch.float8_e4m3fn), scale, bits="fp8")
    want_codes, want_scale = Fp8KV._pack(x)
    codes, scale = codes.cpu(), scale.cpu()
    for t in range(4):
        for h in range(3):
            s = int(slots[t, h])
            if s < 0:
                assert (codes[:, h][~torch.isin(torch.arange(11), slots[:, h])] == 99).all()  # nothing else touched
                continue
            assert torch.equal(codes[s, h], want_codes[t, h]) and torch.equal(scale[s, h], want_scale[t, h]), (t, h)


@pytest.mark.parametrize("bits, d, group", [(4, 64, 16), (8, 128, 32)])
def test_value_dot_refuses_what_it_cannot_do(bits, d, group):
    q, k, v, table, n = _case(5, 1, 4, 2, d, [40])
    kc, ks, kb = quantize(k, bits, group)
    vc, vs, vb = quantize(v, bits, group)
    quant = dict(bits=bits, group=group, k_scale=ks.to(DEV), k_bias=kb.to(DEV), v_scale=vs.to(DEV),
                 v_bias=vb.to(DEV))
    with pytest.raises(ValueError, match="value_dot"):
        decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), table.to(DEV), n.to(DEV), quant=quant, value_dot=True)


def test_decode_attention_refuses_head_dims_that_are_not_powers_of_two():
    q, k, v, table, n = _case(6, 1, 4, 2, 96, [20])
    with pytest.raises(ValueError, match="head_dim 96"):
        decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), n.to(DEV))


@pytest.mark.skipif(DEV != "cuda", reason="a GPU-only limit")
def test_packed_4bit_refuses_16_key_blocks_on_the_gpu():
    q, k, v, table, n = _case(3, 2, 6, 2, 128, [45, 129])
    kc, ks, kb = quantize(k, 4, 64)
    vc, vs, vb = quantize(v, 4, 64)
    quant = dict(bits=4, group=64, k_scale=ks.cuda(), k_bias=kb.cuda(), v_scale=vs.cuda(), v_bias=vb.cuda())
    with pytest.raises(ValueError, match="block_n 16"):
        decode_attention(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), n.cuda(), quant=quant, block_n=16, split=64)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_store_kv_matches_reference_quantizer(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(5, 3, 64, generator=gen) * 2
    slots = torch.tensor([[4, 0, 9], [1, 2, 3], [-1, 5, 6], [7, 8, -1], [10, 11, 12]], dtype=torch.int32)
    width = 64 if bits == 16 else 64 * bits // 8
    pool = torch.full((13, 3, width), 99, dtype=torch.float32 if bits == 16 else torch.uint8)
    scale = torch.zeros(13, 3, 2, dtype=torch.float16)
    bias = torch.zeros_like(scale)
    pool, scale, bias = pool.to(DEV), scale.to(DEV), bias.to(DEV)
    store_kv(x.to(DEV), slots.to(DEV), pool, None if bits == 16 else scale, None if bits == 16 else bias, bits=bits,
             group=32)
    pool, scale, bias = pool.cpu(), scale.cpu(), bias.cpu()
    for t in range(5):
        for h in range(3):
            s = int(slots[t, h])
            if s < 0:
                continue
            if bits == 16:
                assert torch.equal(pool[s, h], x[t, h])
            else:
                c, sc, bi = quantize(x[t, h], bits, 32)
                assert torch.equal(pool[s, h], c) and torch.equal(scale[s, h], sc) and torch.equal(bias[s, h], bi)
    written = {int(s) * 3 + h for h in range(3) for s in slots[:, h] if s >= 0}
    for s in range(13):
        for h in range(3):
            if s * 3 + h not in written:
                assert (pool[s, h] == 99).all()  # nothing else touched


def test_store_kv_reads_slot_tables_of_any_strides():
    """A run of slots expanded over the heads (stride 0 across heads), as a packed store's prefill writes them."""
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(5))
    slots = torch.arange(2, 7, dtype=torch.int32)[:, None].expand(-1, 3)
    pool = torch.zeros(10, 3, 64, dtype=torch.uint8, device=DEV)
    scale = torch.zeros(10, 3, 2, dtype=torch.float16, device=DEV)
    bias = torch.zeros_like(scale)
    store_kv(x.to(DEV), slots.to(DEV), pool, scale, bias, bits=8, group=32)
    codes, sc, bi = quantize(x, 8, 32)
    assert torch.equal(pool[2:7].cpu(), codes) and torch.equal(scale[2:7].cpu(), sc) and torch.equal(bias[2:7].cpu(), bi)
    assert (pool[:2] == 0).all() and (pool[7:] == 0).all()


@pytest.mark.parametrize("bits, d", [(8, 64), (4, 64), ("fp8", 64), (16, 64), (16, 48)])
def test_store_kv_writes_v_beside_k_from_views_of_one_projection(bits, d):
    """K and V as views of one fused projection (strided tokens, no copy), written by one launch (`also`): each pool
    gets what a call of its own writes; unquantized (bf16 pools' decode write), of any head size."""
    qkv = torch.randn(5, 5 * d, generator=torch.Generator().manual_seed(11)).to(DEV)
    k, v = qkv[:, d:d * 3].view(5, 2, d), qkv[:, d * 3:].view(5, 2, d)
    assert not k.is_contiguous()
    slots = torch.tensor([[3, 0], [1, 2], [-1, 5], [6, 7], [8, -1]], dtype=torch.int32, device=DEV)
    width, group = (d, 64) if bits in ("fp8", 16) else (d * bits // 8, 32)

    def pools():
        if bits == 16:
            return torch.zeros(9, 2, d, device=DEV), None, None
        codes = torch.zeros(9, 2, width, dtype=torch.uint8, device=DEV)
        codes = codes.view(torch.float8_e4m3fn) if bits == "fp8" else codes
        scale = torch.zeros(9, 2, 1 if bits == "fp8" else 2, dtype=torch.float16, device=DEV)
        return codes, scale, None if bits == "fp8" else torch.zeros_like(scale)
    (kc, ks, kb), (vc, vs, vb) = pools(), pools()
    store_kv(k, slots, kc, ks, kb, bits=bits, group=group, also=(v, vc, vs, vb))
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for x, written in ((k, (kc, ks, kb)), (v, (vc, vs, vb))):
        alone = pools()
        store_kv(x.contiguous(), slots, *alone, bits=bits, group=group)
        assert all(torch.equal(raw(got), raw(want)) for got, want in zip(written, alone) if got is not None)
        assert (raw(written[0]) != 0).any()
    if bits == 16:  # exactly the rows named, as an indexed copy puts them
        for x, pool in ((k, kc), (v, vc)):
            want = torch.zeros_like(pool)
            keep = slots >= 0
            want[slots[keep].long(), torch.arange(2, device=DEV).expand(5, 2)[keep]] = x[keep]
            assert torch.equal(pool, want)


@pytest.mark.parametrize("dtype, d", [(torch.float32, 64), (torch.bfloat16, 128), (torch.float32, 48)])
def test_rope_inplace_matches_apply_rope(dtype, d):
    from kvbound.kernels.triton_decode import rope_inplace
    from kvbound.models.llama import apply_rope
    gen = torch.Generator().manual_seed(d)
    t, hq, hkv = 7, 6, 2
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype)
    pos = torch.randint(0, 5000, (t,), generator=gen).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    want = apply_rope(qkv[:, :hq + hkv], cos, sin)
    got = qkv.clone().to(DEV)
    rope_inplace(got, cos.to(DEV), sin.to(DEV), hq + hkv)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[:, :hq + hkv].cpu(), want, **tol)
    assert torch.equal(got[:, hq + hkv:].cpu(), qkv[:, hq + hkv:])  # v heads untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_inplace_with_qk_norm_matches_the_norms_then_apply_rope(dtype):
    """Qwen3's q_norm / k_norm (their own weights) fused into the rotation: the model's separate ops."""
    from kvbound.kernels.triton_decode import rope_inplace
    from kvbound.models.llama import RMSNorm, apply_rope
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 9, 4, 2, 64
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 3).to(dtype)
    norms = [RMSNorm(d, 1e-6) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    pos = torch.arange(100, 100 + t).float()
    freqs = pos[:, None] * (1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)))[None]
    cos, sin = freqs.cos(), freqs.sin()
    want = apply_rope(torch.cat([norms[0](qkv[:, :hq]), norms[1](qkv[:, hq:hq + hkv])], 1), cos, sin)
    got = qkv.clone().to(DEV)
    rope_inplace(got, cos.to(DEV), sin.to(DEV), hq + hkv, (norms[0].weight.to(DEV), norms[1].weight.to(DEV), hq, 1e-6))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[:, :hq + hkv].cpu(), want, **tol)
    assert torch.equal(got[:, hq + hkv:].cpu(), qkv[:, hq + hkv:])


def test_half_precision_export_matches_reference():
    """bf16 inputs export probabilities through a float16 buffer: scores within half precision."""
    q, k, v, table, n = _case(11, 3, 8, 2, 64, [200, 33, 129], slots=400)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    score = torch.zeros(3, 200, 2, device=DEV)
    out = decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), n.to(DEV), score=score, score_mode="cumulative",
                           split=64, block_n=16)
    want, want_score = _reference(q.float(), k.float(), v.float(), table, n, "cumulative", torch.zeros(3, 200, 2), 0)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(score.cpu().double(), want_score, atol=2e-4, rtol=2e-3)


def _evict_state(policy, seed, rows=4, batch=(2, 0, 3), layers=2, heads=2, d=32, held=None):
    """A StackedMeta in steady state (every head holds budget tokens and one spare slot) and a pool. held: per
    batch entry, None, or the tokens of a cache still below its budget (positions 0.. in slots 0.., then its
    spare)."""
    from kvbound.cache.stacked import StackedMeta
    from kvbound.cache.store import DenseStore
    gen = torch.Generator().manual_seed(seed)
    meta = StackedMeta(policy, layers, heads, rows, "cpu")
    cap = meta.pos.shape[2]
    slots = len(batch) * cap + 50
    held = held or [None] * len(batch)
    now = [cap + 150 + 7 * i if m is None else m for i, m in enumerate(held)]
    for i, r in enumerate(batch):
        for layer in range(layers):
            for h in range(heads):
                if held[i] is not None:
                    meta.pos[r, layer, :, h] = torch.where(torch.arange(cap) < held[i], torch.arange(cap), -1)
                    meta.spare[r, layer, h] = held[i]
                    continue
                older = torch.randperm(now[i] - 1, generator=gen)[:cap - 1] + 0  # distinct past positions
                if i == 0:  # keep the sinks and the newest ones in, so protection matters
                    older[:3] = torch.tensor([0, 1, now[i] - 1])
                spare = int(torch.randint(cap, (1,), generator=gen))
                col = torch.full((cap,), -1, dtype=torch.int32)
                col[[j for j in range(cap) if j != spare]] = older.to(torch.int32)
                meta.pos[r, layer, :, h] = col
                meta.spare[r, layer, h] = spare
    if meta.score is not None:
        meta.score.copy_(torch.rand(meta.score.shape, generator=gen).round(decimals=1))  # ties happen
    if meta.count is not None:  # merged keys, several tokens each
        meta.count.copy_(torch.randint(1, 6, meta.count.shape, generator=gen).float())
    if policy.granularity == "layer":  # the layer's heads hold the same token in the same slot, with one score
        for t in (meta.pos, meta.score) if meta.score is not None else (meta.pos,):
            t.copy_(t[..., :1].expand_as(t))
        meta.spare.copy_(meta.spare[..., :1].expand_as(meta.spare))
    hq = 2 * heads
    pool = DenseStore(layers, slots, heads, d, "cpu", torch.float32)
    pool.k, pool.v = torch.randn(layers, slots, heads, d, generator=gen), torch.randn(layers, slots, heads, d, generator=gen)
    table = torch.randperm(slots, generator=gen)[:len(batch) * cap].view(len(batch), cap).to(torch.int32)
    step = dict(q=torch.randn(len(batch), hq, d, generator=gen), k=torch.randn(len(batch), heads, d, generator=gen),
                v=torch.randn(len(batch), heads, d, generator=gen), positions=torch.tensor(now))
    step["q"][1] = 0  # uniform attention: scores stay tied, so the oldest-among-ties rule decides
    return meta, pool, table, torch.tensor(batch), step


def _torch_evict(pool, meta, rows, table, step, layer, held=None):
    """cache.steps.evict_decode's PyTorch steps on copies of the state: (output, metadata, pool, lengths)."""
    import copy
    from kvbound.engine.runner import EvictGroup
    ref_meta, ref_pool = copy.deepcopy(meta), copy.deepcopy(pool)
    lens = torch.tensor([table.shape[1] if m is None else m + 1 for m in held or [None] * len(rows)],
                        dtype=torch.int32)
    want = EvictGroup(ref_pool, ref_meta, rows, table, lens).attend(layer, step["q"], step["k"], step["v"],
                                                                    step["positions"])
    return want, ref_meta, ref_pool, lens


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=5,recent=3", "h2o:sink=2,heavy=5,recent=3,score=ema",
                                  "h2o:sink=1,heavy=6,recent=2,score=normalized", "window:budget=9,sink=2",
                                  "h2o:sink=0,heavy=10,recent=0", "h2o:sink=2,heavy=500,recent=100",
                                  "tova:sink=2,heavy=8", "h2o:sink=2,heavy=300,recent=20,granularity=layer",
                                  "h2o:sink=2,heavy=5,recent=3,score=observed", "knorm:sink=2,heavy=5,recent=3",
                                  "knorm:sink=1,heavy=300,recent=20,granularity=layer",
                                  "keydiff:sink=2,heavy=300,recent=20", "keydiff:sink=2,heavy=5,recent=3,granularity=layer",
                                  "h2o:sink=2,heavy=5,recent=3,score=observed,merge=rank",
                                  "h2o:sink=2,heavy=300,recent=20,merge=rank", "knorm:sink=2,heavy=5,recent=3,merge=count",
                                  "tova:sink=2,heavy=8,merge=rank"])
def test_evict_decode_matches_torch_path(spec):
    """The fused evict step (store, attention with export, victim) against cache.steps.evict_decode's PyTorch
    steps on the same state: output, pool, positions, scores and each head's next spare slot. The
    500-token case spans several key chunks, so the victim is chosen across chunks; tova and the last fold
    the layer's summed attention into every head, which then evict the same token. Observed ranks by the
    summed attention over each key's age; knorm scores the new token from its key, keydiff rescores every key
    against an anchor summed over several blocks (the 300-token case). Merging policies add each key's log count to
    its logits and merge each victim into its most similar kept key (`triton_merge`), over several key chunks too."""
    _check_evict_decode(spec)


@pytest.mark.parametrize("spec", ["h2o:sink=2,heavy=5,recent=3", "window:budget=9,sink=2",
                                  "keydiff:sink=2,heavy=300,recent=20",
                                  "knorm:sink=1,heavy=300,recent=20,granularity=layer",
                                  "h2o:sink=2,heavy=5,recent=3,score=observed",
                                  "h2o:sink=2,heavy=5,recent=3,score=observed,merge=rank"])
def test_evict_decode_below_budget_evicts_nothing(spec):
    """Caches still below their budget decode in the same batch as full ones: each attends over the slots it
    holds, evicts nothing, and takes its next free slot as its spare (one of them at 1 token, one a token short
    of full)."""
    _check_evict_decode(spec, held=(None, 1, "short"))


def _fused_evict(q, k, v, k_pool, v_pool, table, lens, rows, positions, pos, spare, score, mode, decay, prefix, recent,
                 merge=None, **kw):
    """The fused evict step as `cache.steps.evict_decode` runs it: the kernels, then a merging policy's merge."""
    from kvbound.kernels.triton_decode import evict_decode
    from kvbound.kernels.triton_merge import merge_victims
    out = evict_decode(q, k, v, k_pool, v_pool, table, lens, rows, positions, pos, spare, score, mode, decay, prefix,
                       recent, **kw)
    if kw.get("count") is not None:
        merge_victims(k_pool, v_pool, table, rows, pos, score, kw["count"], spare, lens, prefix, merge,
                      newest=positions, free=True, quant=kw.get("quant"))
    return out


def _check_evict_decode(spec, held=None):
    from kvbound.cache.merge import merge_mode
    from kvbound.cache.policies import parse_policy
    pol = parse_policy(spec, pinned=((1, 2),) if "window" in spec else ())
    held = held and [pol.budget - 1 if m == "short" else m for m in held]
    meta, pool, table, rows, step = _evict_state(pol, len(spec), held=held)
    layer = 1
    want, ref_meta, ref_pool, lens = _torch_evict(pool, meta, rows, table, step, layer, held)
    if held:
        for i, m in enumerate(held):
            if m is not None:
                assert (ref_meta.spare[rows[i], layer] == m + 1).all() and (ref_meta.pos[rows[i], layer, m] == m).all()
    dev = lambda t: t.to(DEV)  # noqa: E731
    kp, vp, pos, spare = dev(pool.k[layer]), dev(pool.v[layer]), dev(meta.pos[:, layer]), dev(meta.spare[:, layer])
    score = None if meta.score is None else dev(meta.score[:, layer])
    count = None if meta.count is None else dev(meta.count.clone()[:, layer])  # laid out as pos
    got = _fused_evict(dev(step["q"]), dev(step["k"]), dev(step["v"]), kp, vp, dev(table), dev(lens), dev(rows),
                       dev(step["positions"]), pos, spare, score, pol.fold, pol.fold_decay,
                       *pol.fused_protection(), layer=pol.granularity == "layer", rank=pol.rank_source, count=count,
                       merge=merge_mode(pol))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    # a merged key is an average, which the kernel and PyTorch may round apart
    same = torch.equal if count is None else lambda a, b: torch.allclose(a, b, atol=1e-6, rtol=1e-6)  # noqa: E731
    assert same(kp.cpu(), ref_pool.k[layer]) and same(vp.cpu(), ref_pool.v[layer])
    assert torch.equal(pos.cpu(), ref_meta.pos[:, layer])
    assert torch.equal(spare.cpu(), ref_meta.spare[:, layer])
    if score is not None:
        torch.testing.assert_close(score.cpu(), ref_meta.score[:, layer], atol=1e-6, rtol=1e-5)
    if count is not None:
        assert torch.equal(count.cpu(), ref_meta.count[:, layer]) and not torch.equal(count.cpu(), meta.count[:, layer])
    if pol.granularity == "layer":
        assert (spare == spare[:, :1]).all() and (pos == pos[..., :1]).all()


@pytest.mark.parametrize("bits,spec", [(8, "h2o"), (4, "h2o"), ("mixed", "h2o"), (8, "keydiff"), (4, "knorm"),
                                       (8, "h2o:score=observed,merge=rank"), (4, "knorm:merge=count")])
def test_fused_evict_decode_on_packed_pools_matches_torch_path(bits, spec):
    """Packed pools (8/4-bit codes, group 32): the fused store quantizes the new token into each head's spare
    slot bit for bit as the pool's PyTorch packer, and attention and victims follow. Mixed widths (a 4-bit pool
    and the window's residuals in the stacked rows): the store writes the new token's residuals, and attention
    adds every held residual, as the PyTorch steps do. keydiff and knorm score the keys as the pool reads them
    back (dequantized). Merging policies read keys and values dequantized and pack the merged ones, as the PyTorch
    steps do (the same codes up to a rounding of the average)."""
    from kvbound.cache.block_pool import BlockPool
    from kvbound.cache.merge import merge_mode
    from kvbound.cache.policies import parse_policy
    from kvbound.cache.quant import RecentResiduals
    pol = parse_policy(f"{spec},sink=2,heavy=5,recent=3" if ":" in spec else f"{spec}:sink=2,heavy=5,recent=3")
    meta, dense, table, rows, step = _evict_state(pol, 11 + (0 if bits == "mixed" else bits))
    layers, slots, heads, d = dense.k.shape
    if bits == "mixed":
        meta.ring = RecentResiduals(meta.pos.shape[0], layers, heads, d, pol.sink, pol.recent, 32, "cpu")
        gen = torch.Generator().manual_seed(5)
        for t in meta.ring.tensors():
            t.copy_(torch.randint(0, 256, t.shape, generator=gen) if t.dtype == torch.uint8 else
                    torch.rand(t.shape, generator=gen) * 0.05)
        bits = 4
    pool = BlockPool(layers, heads, d, slots, 1, kv_bits=bits, group_size=32)
    for layer in range(layers):
        pool.write(layer, torch.arange(slots), dense.k[layer], dense.v[layer])
    layer = 1
    want, ref_meta, ref_pool, lens = _torch_evict(pool, meta, rows, table, step, layer)
    dev = lambda t: t.to(DEV)  # noqa: E731
    kc, vc, quant = pool.kernel_args(layer)
    raw = [dev(t[layer]) for t in pool.raw]  # K codes, scales, biases, then V's
    quant = dict(quant, k_scale=raw[1], k_bias=raw[2], v_scale=raw[4], v_bias=raw[5])
    pos, spare = dev(meta.pos[:, layer]), dev(meta.spare[:, layer])
    score = dev(meta.score[:, layer])
    ring = None
    if meta.ring is not None:
        ring = RecentResiduals(*meta.pos.shape[:2], heads, d, pol.sink, pol.recent, 32, DEV)
        for dst, src in zip(ring.tensors(), meta.ring.tensors()):
            dst.copy_(src)
    count = None if meta.count is None else dev(meta.count.clone()[:, layer])  # laid out as pos
    got = _fused_evict(dev(step["q"]), dev(step["k"]), dev(step["v"]), raw[0], raw[3], dev(table), dev(lens),
                       dev(rows), dev(step["positions"]), pos, spare, score, pol.fold, pol.fold_decay,
                       *pol.fused_protection(), quant=quant, rank=pol.rank_source,
                       resid=None if ring is None else ring.kernel_args(layer, dev(rows), dev(step["positions"]), pos),
                       count=count, merge=merge_mode(pol))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    if pol.merge:
        pool.write_raw(layer, torch.arange(raw[0].shape[0]), [t.cpu().clone() for t in raw])  # the kernel's bytes
        for got_kv, want_kv in zip(pool.gather(layer, torch.arange(raw[0].shape[0])),
                                   ref_pool.gather(layer, torch.arange(raw[0].shape[0]))):
            torch.testing.assert_close(got_kv, want_kv, atol=0.05, rtol=0)
        assert (ref_pool.raw[0][layer] != pool.raw[0][layer]).sum() <= 2 * 3 * 2 * 32  # at most the targets' codes
        # every victim went into a kept key: the counts moved, as the PyTorch steps moved them
        assert torch.equal(count.cpu(), ref_meta.count[:, layer]) and not torch.equal(count.cpu(), meta.count[:, layer])
    for got_t, want_t in zip(raw if not pol.merge else (), ref_pool.raw):
        assert torch.equal(got_t.cpu(), want_t[layer])
    if ring is not None:
        for got_t, want_t in zip(ring.tensors(), ref_meta.ring.tensors()):
            assert torch.equal(got_t.cpu(), want_t)
    assert torch.equal(pos.cpu(), ref_meta.pos[:, layer]) and torch.equal(spare.cpu(), ref_meta.spare[:, layer])
    torch.testing.assert_close(score.cpu(), ref_meta.score[:, layer], atol=1e-6, rtol=1e-5)


def _shared_state(policy, seed, storage, rows=4, batch=(2, 0, 3), layers=2, heads=3, held=None, plans=None):
    """AdaKV's stacked metadata in steady state: each row's places are owned by heads in uneven numbers, at
    distinct positions per head (the sinks and the newest in some), and each head has one spare place. The
    second row is a uniform cache whose heads hold the same positions at equal scores: every order is by ties.
    held: per batch entry, None, or the tokens of a cache below its budget (token j in slot j, column h for head
    h; its spares the next slot's places). plans: per batch entry, its place rows per layer (`StackedMeta.set_plan`;
    default: the policy's)."""
    from kvbound.cache.stacked import StackedMeta
    gen = torch.Generator().manual_seed(seed)
    meta = StackedMeta(policy, layers, heads, rows, "cpu")
    plans = plans or [meta.layer_rows] * len(batch)
    for r, plan in zip(batch, plans):
        if meta.planned:
            meta.set_plan(r, plan)
    cap = meta.pos.shape[2]
    places = cap * heads
    held = held or [None] * len(batch)
    now = [cap * heads + 150 + 7 * i if m is None else m for i, m in enumerate(held)]
    for i, r in enumerate(batch):
        shared = torch.randperm(max(now[i] - 1, cap), generator=gen)[:cap - 1].to(torch.int32)
        for layer in range(layers):
            mine_places = plans[i][layer] * heads  # PyramidKV's layers, or a plan's, use fewer than the widest
            if held[i] is not None:
                slot = torch.arange(places) // heads
                meta.owner[r, layer] = torch.where(slot < held[i], torch.arange(places) % heads, -1).view(cap, heads)
                meta.pos[r, layer] = torch.where(slot < held[i], slot, -1).view(cap, heads)
                meta.spare[r, layer] = held[i] * heads + torch.arange(heads)
                continue
            order = torch.randperm(mine_places, generator=gen)
            spares, live = order[:heads], order[heads:]
            owner = torch.full((places,), -1, dtype=torch.int16)
            owner[live] = torch.randint(heads, (len(live),), generator=gen, dtype=torch.int16)
            owner[live[:heads]] = torch.arange(heads, dtype=torch.int16)  # no head without a place
            if i == 1:
                owner = torch.arange(places) % heads
                owner = torch.where(torch.arange(places) < mine_places, owner, -1).to(torch.int16)
                spares = torch.randint(mine_places // heads, (heads,), generator=gen) * heads + torch.arange(heads)
                owner[spares] = -1
            pos = torch.full((places,), -1, dtype=torch.int32)
            for h in range(heads):
                mine = (owner == h).nonzero()[:, 0]
                past = shared if i == 1 else torch.randperm(now[i] - 1, generator=gen)[:len(mine)].to(torch.int32)
                if h != 1 and len(mine) > 3:
                    past[:3] = torch.tensor([0, 1, now[i] - 1])
                pos[mine] = past
            meta.owner[r, layer] = owner.view(cap, heads)
            meta.pos[r, layer] = pos.view(cap, heads)
            meta.spare[r, layer] = spares
    meta.score.copy_(torch.rand(meta.score.shape, generator=gen).round(decimals=1))  # ties happen
    meta.score[batch[1]] = 0.5
    d = storage.head_dim
    table = torch.randperm(storage.num_blocks, generator=gen)[:len(batch) * cap].view(len(batch), cap).to(torch.int32)
    step = dict(q=torch.randn(len(batch), 2 * heads, d, generator=gen),
                k=torch.randn(len(batch), heads, d, generator=gen), v=torch.randn(len(batch), heads, d, generator=gen),
                positions=torch.tensor(now))
    step["q"][1] = 0  # uniform attention: the sure places and the victims are decided by ties
    return meta, table, torch.tensor(batch), step


@pytest.mark.parametrize("spec, bits", [("adakv:budget=12,window=4", None), ("h2o:sink=2,heavy=5,recent=3,alpha=0.3", None),
                                        ("h2o:sink=2,heavy=5,recent=3,alpha=1", None),
                                        ("h2o:sink=1,heavy=6,recent=2,score=normalized,alpha=0", None),
                                        ("snapkv:budget=10,window=3,score=ema,alpha=0.5", None),
                                        ("h2o:sink=0,heavy=100,recent=0,alpha=0.2", None),
                                        ("adakv:budget=12,window=4", 8), ("adakv:budget=12,window=4", 4),
                                        ("keydiff:budget=12,alpha=0.2", None), ("keydiff:budget=12,alpha=0.2", 8),
                                        ("knorm:budget=12,alpha=0.2", None), ("knorm:budget=12,alpha=0.2", 4),
                                        ("h2o:sink=2,heavy=5,recent=3,score=observed,alpha=0.2", None)])
def test_shared_decode_kernels_match_torch_path(spec, bits):
    """AdaKV's fused decode (the new tokens stored, owner-masked attention over split places with the score fold, or
    KNorm's and KeyDiff's key scores, then the keep rule's victims by one sort per sequence, ObservedAttention's over
    each key's age) against the PyTorch route of cache.steps.shared_decode
    on the same state, dense and packed: output, pool bytes, positions, owners, scores and the next spare places. The last dense case spans several
    key blocks and a sort of 512 places."""
    _check_shared_decode(spec, bits)


@pytest.mark.parametrize("spec, bits", [("adakv:budget=12,window=4", None), ("keydiff:budget=12,alpha=0.2", 8),
                                        ("knorm:budget=12,alpha=0.2", None),
                                        ("h2o:sink=2,heavy=5,recent=3,score=observed,alpha=0.2", None)])
def test_shared_decode_below_budget_drops_nothing(spec, bits):
    """Caches still below their budget decode in the same batch as full ones: no place is dropped, and the next
    slot's places become their spares (one cache at 1 token, one a token short of full)."""
    _check_shared_decode(spec, bits, held=(None, 1, "short"))


@pytest.mark.parametrize("spec, bits", [("pyramidkv:sink=2,heavy=12,recent=4,window=4,beta=4", None),
                                        ("pyramidkv:sink=2,heavy=12,recent=4,window=4,beta=4", 8),
                                        ("keydiff:sink=2,heavy=12,recent=4,beta=4", 4)])
@pytest.mark.parametrize("layer", [0, 1])
def test_shared_decode_over_layers_of_different_budgets(spec, bits, layer):
    """PyramidKV in the shared kernels: the first layer keeps more place rows than the store holds a layer, some of
    them in the second layer's slots past its budget (read through the pool's `all_layers` view), the second fewer;
    each layer's decode equals the PyTorch route, a cache below both budgets among the steady ones."""
    _check_shared_decode(spec, bits, held=(None, 1, None), layer=layer)


@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("layer", [0, 1])
def test_shared_decode_over_rows_of_different_plans(bits, layer):
    """kvzip's layers=global plans in the shared kernels: rows of one metadata, each with layer budgets of its own
    (the first wider than the policy's: the metadata widened; past a row's own place rows, free padding), decode in
    one batch; each layer's decode equals the PyTorch route, a cache below its budget among them."""
    _check_shared_decode("kvzip:sink=2,heavy=12,recent=4,layers=global", bits, held=(None, 1, None), layer=layer,
                         plans=[[25, 13], [19, 19], [14, 24]])


def _check_shared_decode(spec, bits, held=None, layer=1, plans=None):
    import copy
    from kvbound.cache.block_pool import BlockPool
    from kvbound.cache.policies import parse_policy
    from kvbound.engine.runner import SharedGroup, layer_slots
    from kvbound.kernels.triton_shared import shared_decode
    pol = parse_policy(spec)
    layers, heads, d = 2, 3, 32
    widest = max(pol.head_budgets(n, layers)[1] for n in range(layers)) + 1  # the capacity, or PyramidKV's first layer
    widest = max([widest] + [max(plan) for plan in plans or ()])
    pool = BlockPool(layers, heads, d, 3 * widest + 20, 1, kv_bits=bits, group_size=32)
    gen = torch.Generator().manual_seed(len(spec))
    for layer in range(layers):
        pool.write(layer, torch.arange(pool.num_blocks), *(torch.randn(pool.num_blocks, heads, d, generator=gen)
                                                           for _ in range(2)))
    held = held and [pol.budget - 1 if m == "short" else m for m in held]
    meta, table, rows, step = _shared_state(pol, len(spec) + (bits or 0), pool, held=held, plans=plans)
    ref_meta, ref_pool = copy.deepcopy(meta), copy.deepcopy(pool)
    lens = torch.tensor([table.shape[1] if m is None else m + 1 for m in held or [None] * len(rows)],
                        dtype=torch.int32)
    want = SharedGroup(ref_pool, ref_meta, rows, table, lens).attend(layer, step["q"], step["k"], step["v"],
                                                                     step["positions"])
    for i, m in enumerate(held or ()):
        if m is not None:  # nothing dropped: the new tokens in slot m, the spares the next slot's places
            r = rows[i]
            assert (ref_meta.owner[r, layer] >= 0).sum() == (m + 1) * 3
            assert ref_meta.spare[r, layer].tolist() == [(m + 1) * 3 + h for h in range(3)]
    m = meta
    dev = lambda t: t.to(DEV)  # noqa: E731
    # PyramidKV, plans: each row's place rows, some in another layer's slots, read as the engine's groups read them
    pool, at, kernel_table, kernel_lens, widths = layer_slots(pool, m, layer, table, rows, lens)
    ref_pool = ref_pool.all_layers() if m.planned else ref_pool
    raw = [dev(t[at]) for t in pool.raw]  # K and V, or K's codes, scales, biases, then V's
    quant = pool.kernel_args(at)[2]
    if quant is not None:
        quant = dict(quant, k_scale=raw[1], k_bias=raw[2], v_scale=raw[4], v_bias=raw[5])
    k_pool, v_pool = (raw[0], raw[1]) if quant is None else (raw[0], raw[3])
    owner, pos, spare, score = (dev(t[:, layer]) for t in (m.owner, m.pos, m.spare, m.score))
    got = shared_decode(*(dev(step[x]) for x in "qkv"), k_pool, v_pool, dev(kernel_table), dev(rows),
                        dev(step["positions"]), owner, pos, spare, score, pol.fold, pol.fold_decay,
                        *pol.fused_protection(), m.sure[layer], quant=quant, splits=3, rank=pol.rank_source,
                        lens=dev(kernel_lens), widths=None if widths is None else dev(widths))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    for got_t, want_t in zip(raw, ref_pool.raw):  # the new tokens stored as the pool's packer writes them
        assert torch.equal(got_t.cpu(), want_t[at])
    assert torch.equal(owner.cpu(), ref_meta.owner[:, layer]) and torch.equal(pos.cpu(), ref_meta.pos[:, layer])
    assert torch.equal(spare.cpu(), ref_meta.spare[:, layer])
    torch.testing.assert_close(score.cpu(), ref_meta.score[:, layer], atol=1e-6, rtol=1e-5)


def test_fused_victim_refuses_pinned_spans_past_the_prefix():
    from kvbound.cache.policies import parse_policy
    assert parse_policy("h2o:sink=4,heavy=8,recent=4", pinned=((2, 9),)).fused_protection() == (9, 4)
    assert parse_policy("h2o:sink=4,heavy=8,recent=4", pinned=((20, 22),)).fused_protection() is None


@pytest.mark.skipif(DEV != "cuda", reason="a cache takes the kernel path on CUDA only")
@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_cache_decode_on_cuda_takes_the_kernel_and_matches_the_fallback(kv_bits, monkeypatch):
    """A bounded cache on CUDA, dense or packed: its decode steps go through the kernel and give what the
    dequantize-then-attend fallback gives (outputs, then the same kept tokens)."""
    import kvbound.kernels.triton_decode
    from kvbound.cache import KVCache
    from kvbound.models import ModelConfig
    from kvbound.cache.policies import H2OPolicy
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=10, hidden_size=8 * 128, num_layers=1, num_heads=8,
                      num_kv_heads=2, head_dim=128, intermediate_size=8)
    pol = H2OPolicy(sink=2, heavy=20, recent=10)
    fast, slow = (KVCache(cfg, pol, device="cuda", dtype=torch.float32, kv_bits=kv_bits) for _ in range(2))
    slow.store.kernel_args = lambda layer: None
    calls = []
    kernel = kvbound.kernels.triton_decode.decode_attention
    monkeypatch.setattr(kvbound.kernels.triton_decode, "decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in [40] + [1] * 30:
        q, k, v = (torch.randn(t, h, 128, device="cuda", generator=gen) for h in (8, 2, 2))
        pos = fast.next_positions(t)
        outs = [c.attend(0, q, k, v, pos) for c in (fast, slow)]
        for c in (fast, slow):
            c.advance(t)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert len(calls) == 30
    assert [fast.kept_positions(0, h) for h in range(2)] == [slow.kept_positions(0, h) for h in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_causal_attention_matches_each_piece_written_out(dtype):
    """Pieces of different lengths, some after cached keys, GQA, packed: one call against a masked softmax
    per piece (FlashAttention's varlen kernel on CUDA in half precision, bottom-right causal alignment)."""
    from kvbound.kernels import varlen_causal_attention
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 8, 2, 64
    pieces = [(0, 5), (7, 3), (0, 1), (30, 17), (2, 2)]  # (cached, new)
    qs = [torch.randn(t, hq, d, generator=gen) for _, t in pieces]
    ks = [torch.randn(n + t, hkv, d, generator=gen) for n, t in pieces]
    vs = [torch.randn(n + t, hkv, d, generator=gen) for n, t in pieces]
    want = []
    for (n, t), q, k, v in zip(pieces, qs, ks, vs):
        kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        logits = torch.einsum("thd,mhd->htm", q.to(dtype).float(), kk.to(dtype).float()) * d ** -0.5
        mask = torch.arange(n + t)[None, :] <= n + torch.arange(t)[:, None]
        want.append(torch.einsum("htm,mhd->thd", logits.masked_fill(~mask, float("-inf")).softmax(-1),
                                 vv.to(dtype).float()))

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    got = varlen_causal_attention(torch.cat(qs).to(DEV, dtype), torch.cat(ks).to(DEV, dtype),
                                  torch.cat(vs).to(DEV, dtype), cu([t for _, t in pieces]),
                                  cu([n + t for n, t in pieces]), 17, 47)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float().cpu(), torch.cat(want), **tol)


@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * (DEV == "cuda"))  # the CUDA path is flash's
@pytest.mark.parametrize("mode, first, g", [(None, 0, 2), ("cumulative", 0, 2), ("normalized", 4, 1), ("ema", 9, 3)])
def test_owned_attention_matches_the_masked_reference(mode, first, g, dtype):
    """A prefill piece over places KV heads own (AdaKV), as one varlen sequence per (cache, head) with the scores
    from its LSE, against the masked attention over every place: free places, heads owning none, GQA."""
    from types import SimpleNamespace
    from kvbound.cache.steps import owned_attention, owner_attention
    gen = torch.Generator().manual_seed(g * 10 + first)
    b, t, h, d, n = 3, 11, 3, 64, 9
    e = n * h
    q = torch.randn(b, t, h * g, d, generator=gen).to(dtype)
    ks, vs = (torch.randn(b, e + t * h, d, generator=gen).to(dtype) for _ in range(2))
    own_c = torch.randint(-1, h, (b, e), generator=gen)
    own_c[1] = torch.where(own_c[1] == 2, -1, own_c[1])  # a head that owns no place yet
    own = torch.cat([own_c, torch.arange(h).repeat(t).expand(b, -1)], 1)
    pos_c = torch.where(own_c >= 0, torch.randint(0, 40, (b, e), generator=gen), -1)
    positions = 40 + torch.arange(t).expand(b, -1)
    cand_pos = torch.cat([pos_c, positions[:, :, None].expand(-1, -1, h).flatten(1)], 1)
    group = torch.arange(h * g) // g
    mask = (own[:, None, None] == group[None, None, :, None]) & (cand_pos[:, None, None] <= positions[..., None, None])
    want, want_step = owner_attention(q.float(), ks.float(), vs.float(), mask, SimpleNamespace(fold=mode), first)
    got, step = owned_attention(q.to(DEV), ks.to(DEV), vs.to(DEV), own.to(DEV), h, mode, first)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    if mode is None:
        assert step is None
    else:
        torch.testing.assert_close(step.cpu(), want_step, **tol)


@pytest.mark.parametrize("mode, last, n, d", [("cumulative", None, 50, 64), ("normalized", None, 0, 64),
                                              ("ema", 8, 70, 48), ("cumulative", 100, 3, 64), ("max", None, 50, 64)])
def test_prefill_key_scores_from_lse_match_the_reference(mode, last, n, d):
    """The one-pass key scores of a prefill piece (q.k again, p = exp(logit - LSE), summed down the queries, or their
    highest: KVzip's) against the reference's masked softmax, over cached keys and the piece's own (causal), GQA,
    windows."""
    from kvbound.kernels import causal_attention_batch
    from kvbound.kernels.triton_prefill import key_scores
    gen = torch.Generator().manual_seed(n + d)
    b, t, hq, hkv = 2, 37, 8, 2
    q = torch.randn(b, t, hq, d, generator=gen)
    k = torch.randn(b, n + t, hkv, d, generator=gen)
    v = torch.randn(b, n + t, hkv, d, generator=gen)
    _, want = causal_attention_batch(q, k, v, mode, last)
    logits = torch.einsum("bthd,bmhd->bhtm", q, k.repeat_interleave(hq // hkv, 2)) * d ** -0.5
    mask = torch.arange(n + t)[None, :] <= n + torch.arange(t)[:, None]
    lse = logits.masked_fill(~mask, float("-inf")).logsumexp(-1)  # [b, hq, t]
    lse = lse.permute(1, 0, 2).reshape(hq, b * t).contiguous()  # FlashAttention's varlen layout
    got = key_scores(q.to(DEV), k.to(DEV), lse.to(DEV), t - min(t, last or t), mode == "normalized",
                     best=mode == "max")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEV != "cuda", reason="FlashAttention and the compiled score kernel run on CUDA only")
@pytest.mark.parametrize("mode, last", [(None, None), ("cumulative", None), ("normalized", None), ("ema", 16),
                                        ("max", None)])
def test_causal_attention_batch_on_cuda_matches_the_float32_reference(mode, last):
    from kvbound.kernels import causal_attention_batch
    gen = torch.Generator().manual_seed(1)
    b, n, t, hq, hkv, d = 3, 300, 129, 16, 8, 128
    q, k, v = (torch.randn(b, m, h, d, generator=gen) for m, h in [(t, hq), (n + t, hkv), (n + t, hkv)])
    q, k, v = (x.bfloat16() for x in (q, k, v))
    want_out, want = causal_attention_batch(q.float(), k.float(), v.float(), mode, last)
    out, got = causal_attention_batch(q.cuda(), k.cuda(), v.cuda(), mode, last)
    torch.testing.assert_close(out.float().cpu(), want_out, rtol=2e-2, atol=2e-2)
    if mode is not None:
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2 * (n + t if mode == "normalized" else 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_separate_ops(dtype):
    from kvbound.kernels.triton_decode import silu_mul
    x = (torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = x.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(silu_mul(x.to(DEV)).cpu(), want, **tol)


@pytest.mark.parametrize("fmt", [8, 4, "fp8"])
def test_staged_values_give_the_same_output(fmt):
    """Values made fp16 before their layout change (`Tile.staged`, fp8's middle tables at d=128) give the same
    output, bit for bit, as the default, with and without exported scores."""
    from kvbound.cache.quant import Fp8KV
    q, k, v, table, n = _case(90, 3, 8, 2, 128, [300, 77, 1], slots=400)
    if fmt == "fp8":
        (kc, ks), (vc, vs) = Fp8KV._pack(k), Fp8KV._pack(v)
        kc, vc = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
        quant = dict(bits="fp8", k_scale=ks, v_scale=vs)
    else:
        (kc, *ks), (vc, *vs) = quantize(k, fmt, 64), quantize(v, fmt, 64)
        quant = dict(bits=fmt, group=64, k_scale=ks[0], k_bias=ks[1], v_scale=vs[0], v_bias=vs[1])
    args = [t.to(DEV) for t in (q, kc, vc, table, n)]
    quant = {key: t if isinstance(t, (str, int)) else t.to(DEV) for key, t in quant.items()}
    for export in (False, True):
        scores = [torch.zeros(3, table.shape[1], 2, device=DEV) if export else None for _ in range(2)]
        mode = "cumulative" if export else None
        outs = [decode_attention(*args, quant=quant, block_n=64, staged=staged, score=score, score_mode=mode)
                for staged, score in zip((False, True), scores)]
        torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
        if export:
            torch.testing.assert_close(scores[1], scores[0], atol=0, rtol=0)


@pytest.mark.parametrize("bits, d", [(8, 64), (4, 64), (8, 128), (4, 128)])
def test_byte_permutes_give_the_portable_conversions_result(bits, d):
    """Codes made fp16 by inline PTX's byte permutes (`Tile.permute`) give the portable conversion's output (values
    read dequantized at d=64, as codes at d=128); where the kernel is interpreted, asking for them is one clear error."""
    q, k, v, table, n = _case(70 + bits + d, 3, 6, 2, d, [200, 77, 1])
    group = d // 2  # two groups a head: values go to the tensor cores as codes at d=128
    (kc, *ks), (vc, *vs) = quantize(k, bits, group), quantize(v, bits, group)
    quant = dict(bits=bits, group=group, k_scale=ks[0], k_bias=ks[1], v_scale=vs[0], v_bias=vs[1])
    args = [t.to(DEV) for t in (q.half(), kc, vc, table, n)]
    quant = {key: t if isinstance(t, int) else t.to(DEV) for key, t in quant.items()}
    if DEV != "cuda":
        with pytest.raises(ValueError, match="permute"):
            decode_attention(*args, quant=quant, permute=True)
        return
    plain = decode_attention(*args, quant=quant, permute=False, block_n=64)
    torch.testing.assert_close(decode_attention(*args, quant=quant, permute=True, block_n=64), plain, atol=0, rtol=0)



@pytest.mark.parametrize("weight,width,block", [("count", 21, None), ("attention", 21, None), ("age", 21, None),
                                                ("attention", 150, None), ("age", 150, 64)])
def test_merge_kernel_matches_the_pytorch_merge(weight, width, block, monkeypatch):
    """`triton_merge.merge_victims` against `steps.evict_merged`'s PyTorch route on fresh random rows: the same targets,
    averaged K/V and counts; a row below its budget and the sinks (the protected prefix) are left alone. 150 keys a
    row take two 128-key blocks (three of 64 with `block`, unpipelined), whose best the search compares."""
    from kvbound.cache.policies import H2OPolicy
    from kvbound.cache.steps import evict_merged
    from kvbound.cache.store import DenseStore
    from kvbound.kernels import triton_merge
    from kvbound.kernels.triton_merge import merge_victims
    if block:
        monkeypatch.setattr(triton_merge, "search_tile", lambda *a: dict(BLOCK=block, num_warps=4, STAGES=1))
    gen = torch.Generator().manual_seed(len(weight) + width)
    bsz, heads, d, rows_total = 3, 2, 32, 5
    policy = H2OPolicy(sink=2, heavy=width - 11, recent=8, score="observed" if weight == "age" else "cumulative",
                       merge="count" if weight == "count" else "rank")
    ref = DenseStore(1, bsz * width, heads, d, "cpu", torch.float32)
    ref.k.copy_(torch.randn(ref.k.shape, generator=gen))
    ref.v.copy_(torch.randn(ref.v.shape, generator=gen))
    k, v = ref.k[0].clone().to(DEV), ref.v[0].clone().to(DEV)  # copies the kernel merges into
    table = torch.randperm(bsz * width, generator=gen).view(bsz, width).to(torch.int32)
    rows = torch.tensor([3, 0, 2])
    pos = torch.stack([torch.randperm(width + 19, generator=gen)[:width] + 2 for _ in range(rows_total * heads)]).view(
        rows_total, heads, width).transpose(1, 2).contiguous().to(torch.int32)
    pos[:, :2] = torch.arange(2, dtype=torch.int32)[:, None]  # the sinks
    score = torch.rand(rows_total, width, heads, generator=gen)
    count = torch.randint(1, 5, (rows_total, width, heads), generator=gen).float()
    lens = torch.tensor([width, width - 3, width], dtype=torch.int32)
    want = count.clone()
    evict_merged(ref, 0, table, rows, pos.clone(), torch.zeros(rows_total, heads, dtype=torch.long), score, want,
                 policy, lens)
    got = count.clone().to(DEV)
    merge_victims(k, v, table.to(DEV), rows.to(DEV), pos.to(DEV), score.to(DEV), got, policy.victim(pos[rows],
                  score[rows]).to(DEV), lens.to(DEV), 2, weight)
    torch.testing.assert_close(k.cpu(), ref.k[0])
    torch.testing.assert_close(v.cpu(), ref.v[0])
    torch.testing.assert_close(got.cpu(), want)
    assert (want != count).any() and torch.equal(want[0], count[0])  # merged; the row below its budget was not


@pytest.mark.parametrize("weight", ["count", "age"])
def test_merge_kernel_over_mixed_widths_reads_and_writes_the_windows_residuals(weight):
    """`merge_victims(resid=)` against `steps.evict_merged`'s PyTorch route with mixed widths (a 4-bit pool, random
    residuals of the sinks and the window): keys and values read with their residuals where the decode at `newest`
    reads them, the merged target's codes written packed and, when the ring holds it after the step, its residuals;
    every slot reads back the same K/V (to the averages' rounding), and the counts are equal. The window's newest 9
    positions are held, so targets fall inside it and outside."""
    import copy
    from kvbound.cache.block_pool import BlockPool
    from kvbound.cache.policies import H2OPolicy
    from kvbound.cache.quant import RecentResiduals
    from kvbound.cache.steps import WindowRead, evict_merged, read_kv
    from kvbound.kernels.triton_merge import merge_victims
    gen = torch.Generator().manual_seed(len(weight))
    bsz, heads, d, width, rows_total, recent = 3, 2, 32, 21, 5, 8
    policy = H2OPolicy(sink=2, heavy=width - 3 - recent, recent=recent,
                       score="observed" if weight == "age" else "cumulative", merge="count" if weight == "count" else
                       "rank")
    pool = BlockPool(1, heads, d, bsz * width + 4, 1, kv_bits=4, group_size=32)
    pool.write(0, torch.arange(bsz * width + 4), torch.randn(bsz * width + 4, heads, d, generator=gen),
               torch.randn(bsz * width + 4, heads, d, generator=gen))
    ring = RecentResiduals(rows_total, 1, heads, d, 2, recent, 32, "cpu")
    for t in ring.tensors():  # residuals large enough that the search over keys read without them would differ
        t.copy_(torch.randint(0, 256, t.shape, generator=gen) if t.dtype == torch.uint8
                else torch.rand(t.shape, generator=gen) * 0.2 - 0.1)
    table = torch.randperm(bsz * width + 4, generator=gen)[:bsz * width].view(bsz, width).to(torch.int32)
    rows, newest = torch.tensor([3, 0, 2]), torch.tensor([60, 75, 90])
    pos = torch.full((rows_total, width, heads), -1, dtype=torch.int32)
    for b, r in enumerate(rows.tolist()):
        for h in range(heads):
            window = torch.arange(newest[b] - recent, newest[b] + 1)
            older = torch.randperm(int(newest[b]) - recent - 2, generator=gen)[:width - 2 - len(window)] + 2
            pos[r, :, h] = torch.cat([torch.arange(2), torch.cat([window, older])[torch.randperm(width - 2,
                                                                                               generator=gen)]])
    score = torch.rand(rows_total, width, heads, generator=gen)
    count = torch.randint(1, 5, (rows_total, width, heads), generator=gen).float()
    lens = torch.tensor([width, width - 3, width], dtype=torch.int32)
    ref_pool, ref_ring, want = copy.deepcopy(pool), copy.deepcopy(ring), count.clone()
    evict_merged(ref_pool, 0, table, rows, pos.clone(), torch.zeros(rows_total, heads, dtype=torch.long), score, want,
                 policy, lens, ring=WindowRead(ref_ring, rows, newest, pos))
    dev = lambda t: t.to(DEV)  # noqa: E731
    pool.packed, ring = pool.packed.mapped(dev), ring.mapped(dev)
    got = dev(count.clone())
    victim = policy.victim(pos[rows], score[rows])
    merge_victims(*pool.kernel_args(0)[:2], dev(table), dev(rows), dev(pos), dev(score), got, dev(victim), dev(lens),
                  2, weight, newest=dev(newest), quant=pool.kernel_args(0)[2],
                  resid=WindowRead(ring, dev(rows), dev(newest), dev(pos)).kernel_args(0))
    torch.testing.assert_close(got.cpu(), want)
    # every slot as a step from `newest` reads it (the targets' new residuals included, and what the ring held)
    got_kv = read_kv(pool, 0, dev(table).long(), WindowRead(ring, dev(rows), dev(newest), dev(pos)))
    want_kv = read_kv(ref_pool, 0, table.long(), WindowRead(ref_ring, rows, newest, pos))
    for x, y in zip(got_kv, want_kv):
        torch.testing.assert_close(x.cpu(), y, atol=2e-3, rtol=0)
    assert torch.equal(want[0], count[0])  # the row below its budget merged nothing
    took = (want != count)[rows]  # the targets, whose counts grew
    in_window = pos[rows] >= (newest - recent)[:, None, None]
    assert (took & in_window).any() and (took & ~in_window).any()


def _room_filling_state(policy, seed, bits=None, rows=4, batch=(2, 0, 3), layers=2, heads=2, d=32):
    """Stacked rows of caches evicting every e steps, each holding budget + e - 1 tokens in slots [0, cap - 1) (the
    sinks first, as a cache holds them, and the newest among the rest), its last slot free: the state a decode that
    fills the room meets. A pool (packed with `bits`; "mixed": 4-bit, with random residuals of the window and the
    sinks) and the step's inputs."""
    from kvbound.cache.block_pool import BlockPool
    from kvbound.cache.quant import RecentResiduals
    from kvbound.cache.stacked import StackedMeta
    gen = torch.Generator().manual_seed(seed)
    ring = None
    if bits == "mixed":
        bits, ring = 4, lambda n: RecentResiduals(n, layers, heads, d, policy.sink, policy.recent, 32, "cpu")
    meta = StackedMeta(policy, layers, heads, rows, "cpu", ring=ring)
    if meta.ring is not None:
        for t in meta.ring.tensors():
            t.copy_(torch.randint(0, 256, t.shape, generator=gen) if t.dtype == torch.uint8
                    else torch.rand(t.shape, generator=gen) * 0.02 - 0.01)
    cap = meta.width
    now = [cap + 90 + 13 * i for i in range(len(batch))]
    for i, r in enumerate(batch):
        for layer in range(layers):
            for h in range(heads):
                sinks = policy.protected_prefix
                older = torch.randperm(now[i] - 1 - sinks, generator=gen)[:cap - 1 - sinks] + sinks
                older[0] = now[i] - 1  # so protection matters
                older = older[torch.randperm(len(older), generator=gen)]
                meta.pos[r, layer, :cap - 1, h] = torch.cat([torch.arange(sinks), older]).to(torch.int32)
    meta.spare.fill_(cap - 1)
    if meta.score is not None:
        meta.score.copy_(torch.rand(meta.score.shape, generator=gen).round(decimals=1))  # ties happen
    if meta.count is not None:  # merged keys, several tokens each
        meta.count.copy_(torch.randint(1, 6, meta.count.shape, generator=gen).float())
    if policy.granularity == "layer":
        for t in (meta.pos, meta.score) if meta.score is not None else (meta.pos,):
            t.copy_(t[..., :1].expand_as(t))
    slots = len(batch) * cap + 20
    pool = BlockPool(layers, heads, d, slots, 1, kv_bits=bits, group_size=32)
    for layer in range(layers):
        pool.write(layer, torch.arange(slots), torch.randn(slots, heads, d, generator=gen),
                   torch.randn(slots, heads, d, generator=gen))
    table = torch.randperm(slots, generator=gen)[:len(batch) * cap].view(len(batch), cap).to(torch.int32)
    step = dict(q=torch.randn(len(batch), 2 * heads, d, generator=gen), k=torch.randn(len(batch), heads, d, generator=gen),
                v=torch.randn(len(batch), heads, d, generator=gen), positions=torch.tensor(now))
    return meta, pool, table, torch.tensor(batch), step


def _kept(pool, layer, table, pos, score, count, rows, read=None):
    """Per batch row and head: each kept position's K and V as stored (raw bytes, and as read back: with mixed
    widths' residuals given `read`, a `steps.WindowRead`), score and count, by position (slots may differ)."""
    from kvbound.cache.steps import read_kv
    raw = [t[layer] for t in pool.raw]
    dev = raw[0].device
    values = torch.stack(read_kv(pool, layer, table.long().to(dev), read), 2).float().cpu()  # [B, M, 2, H, D]
    kept = []
    for b, r in enumerate(rows.tolist()):
        for h in range(pos.shape[2]):
            slots = (pos[r, :, h] >= 0).nonzero().flatten().tolist()
            kept.append({int(pos[r, j, h]): (
                [x[int(table[b, j]), h].cpu() for x in raw], values[b, j, :, h],
                *(None if m is None else float(m[r, j, h]) for m in (score, count))) for j in slots})
    return kept


@pytest.mark.parametrize("spec,bits", [("h2o:sink=2,heavy=5,recent=3,evict_every=4", None),
                                       ("window:budget=9,sink=2,evict_every=3", None),
                                       ("h2o:sink=2,heavy=5,recent=3,score=observed,evict_every=5", None),
                                       ("keydiff:sink=2,heavy=5,recent=3,evict_every=4", None),
                                       ("knorm:sink=1,heavy=6,recent=2,granularity=layer,evict_every=3", None),
                                       ("tova:sink=2,heavy=8,evict_every=4", None),
                                       ("h2o:sink=2,heavy=150,recent=20,evict_every=8", None),
                                       ("h2o:sink=2,heavy=5,recent=3,score=observed,evict_every=4", 8),
                                       ("h2o:sink=2,heavy=5,recent=3,evict_every=3", 4),
                                       ("keydiff:sink=2,heavy=5,recent=3,evict_every=4", "fp8"),
                                       ("h2o:sink=2,heavy=5,recent=3,score=observed,merge=rank,evict_every=4", None),
                                       ("knorm:sink=2,heavy=6,recent=2,merge=count,evict_every=3", None),
                                       ("h2o:sink=2,heavy=150,recent=20,merge=rank,evict_every=8", None),
                                       ("h2o:sink=2,heavy=5,recent=3,merge=count,evict_every=4", 8),
                                       ("h2o:sink=2,heavy=5,recent=3,evict_every=4", "mixed"),
                                       ("h2o:sink=2,heavy=6,recent=4,score=observed,evict_every=3", "mixed"),
                                       ("h2o:sink=1,heavy=6,recent=3,score=ema,granularity=layer,evict_every=4",
                                        "mixed"),
                                       ("h2o:sink=2,heavy=6,recent=4,score=observed,merge=rank,evict_every=3", "mixed"),
                                       ("h2o:sink=2,heavy=5,recent=3,merge=count,evict_every=4", "mixed")])
def test_bulk_evict_decode_keeps_what_the_chunk_step_keeps(spec, bits):
    """The decode that fills the room of caches evicting every e steps, as `steps.bulk_evict_decode` runs it (the
    evict step, then `triton_compact`'s e - 1 further victims and the moves into their slots) against the chunk
    step's PyTorch route (`chunk_attend`, `keep_and_rewrite`) on the same fresh state: the same output, and in every
    head the same positions kept, each with its stored bytes (packed ones as they were) and score; the kept tokens in
    slots [0, budget), and slot `budget` every head's spare. Ties in the scores decide by age on both routes. Merging
    policies merge the e evicted tokens at once: the same counts, and K/V up to the rounding of the averages (the
    150-token row searches two blocks for each one's most similar key). Mixed widths: the window's residuals, found by
    position, stay where they are; the new token's joins them; a merge reads keys and values with them, and a target
    in the window gets its new ones (compared as a step from the new token's position reads them)."""
    import copy
    from kvbound.cache.policies import parse_policy
    from kvbound.cache.steps import WindowRead, bulk_evict_decode
    from kvbound.engine.runner import ChunkGroup
    pol = parse_policy(spec)
    meta, pool, table, rows, step = _room_filling_state(pol, len(spec) + len(str(bits)), bits)
    layer, cap, b = 1, meta.width, pol.budget
    ref_meta, ref_pool = copy.deepcopy(meta), copy.deepcopy(pool)
    want = ChunkGroup(ref_pool, ref_meta, rows, table, cap - 1).attend(layer, step["q"], step["k"], step["v"],
                                                                       step["positions"])
    dev = lambda t: t.to(DEV)  # noqa: E731
    if pool.packed is None:
        pool.k, pool.v = dev(pool.k), dev(pool.v)
    else:
        pool.packed = pool.packed.mapped(dev)
    pos, spare = dev(meta.pos[:, layer]), dev(meta.spare[:, layer])
    score = None if meta.score is None else dev(meta.score[:, layer])
    count = None if meta.count is None else dev(meta.count.clone()[:, layer])  # laid out as pos
    lens = torch.full((len(rows),), cap, dtype=torch.int32, device=DEV)
    ring = None if meta.ring is None else meta.ring.mapped(dev)
    got = bulk_evict_decode(dev(step["q"]), dev(step["k"]), dev(step["v"]), pool, layer, dev(table), lens, dev(rows),
                            dev(step["positions"]), pos, spare, score, pol, count, ring)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    if ring is not None and not pol.merge:  # the new token's residuals, by the store kernel there and PyTorch here
        for mine, theirs in zip(ring.tensors(), ref_meta.ring.tensors()):
            assert torch.equal(mine.cpu(), theirs)
    assert (pos[rows.to(DEV), b:] == -1).all() and (pos[rows.to(DEV), :b] >= 0).all()
    assert (spare[rows.to(DEV)] == b).all()
    ref = [None if m is None else m[:, layer] for m in (ref_meta.score, ref_meta.count)]
    reads = [None, None] if ring is None else [WindowRead(r, x(rows), x(step["positions"]), p) for r, x, p in
                                               ((ref_meta.ring, lambda t: t, ref_meta.pos[:, layer]),
                                                (ring, dev, pos))]
    wanted = _kept(ref_pool, layer, table, ref_meta.pos[:, layer], *ref, rows, reads[0])
    have = _kept(pool, layer, table, pos.cpu(), *(None if m is None else m.cpu() for m in (score, count)), rows,
                 reads[1])
    held = [meta.count[r, layer, :cap - 1, h].sum() + 1 for r in rows.tolist() for h in range(pos.shape[2])] \
        if pol.merge else [None] * len(have)
    for mine, keep, tokens in zip(have, wanted, held):
        assert mine.keys() == keep.keys() and len(keep) == b
        for p, (data, values, sc, cnt) in keep.items():
            if not pol.merge:
                assert all(torch.equal(x, y) for x, y in zip(mine[p][0], data)), p
            else:  # a merged key is an average, which the kernel and PyTorch may round apart
                torch.testing.assert_close(mine[p][1], values, atol=0.05 if bits else 1e-5, rtol=1e-5)
            assert sc is None or abs(mine[p][2] - sc) < 1e-5, p
            assert cnt is None or mine[p][3] == cnt, p
        assert tokens is None or sum(c for *_, c in mine.values()) == tokens  # every evicted token merged
