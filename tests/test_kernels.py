"""Triton kernels against the PyTorch reference, on CPU through the Triton interpreter.

Fresh random inputs, odd lengths, slot tables out of order, GQA, all score modes, dense and packed KV.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kvbound.attention import attend  # noqa: E402
from kvbound.kernels import decode_attention, store_kv  # noqa: E402
from kvbound.quant import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(seed, bsz, hq, hkv, d, lens, slots=300):
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
        out, ks = attend(q[b:b + 1].double(), k[idx].double(), v[idx].double(), None if mode is None else
                         ("normalized" if mode == "normalized" else "sum"))
        outs.append(out[0])
        if mode == "ema":
            scores[b, :n] = decay * scores[b, :n] + (1 - decay) * ks
        elif mode is not None:
            scores[b, :n] += ks  # "normalized" already weighted by n inside attend
    return torch.stack(outs), scores


@pytest.mark.parametrize("shape", [(3, 9, 3, 64, [37, 1, 130]), (2, 8, 2, 32, [65, 200]), (1, 4, 4, 16, [77])])
@pytest.mark.parametrize("mode", [None, "sum", "normalized", "ema"])
def test_decode_attention_dense_matches_reference(shape, mode):
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


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_attention_quantized_matches_dequantize_then_attend(bits):
    q, k, v, table, n = _case(7, 2, 6, 2, 64, [45, 129])
    group = 32
    kc, kscale, kbias = quantize(k, bits, group)
    vc, vscale, vbias = quantize(v, bits, group)
    kd, vd = dequantize(kc, kscale, kbias, bits, group), dequantize(vc, vscale, vbias, bits, group)
    score = torch.zeros(2, 129, 2, device=DEV)
    dev = [t.to(DEV) for t in (q, kc, vc, table, n, kscale, kbias, vscale, vbias)]
    out = decode_attention(*dev[:5], score=score, score_mode="sum", split=64, block_n=16,
                           quant=dict(bits=bits, group=group, k_scale=dev[5], k_bias=dev[6], v_scale=dev[7],
                                      v_bias=dev[8])).cpu()
    score = score.cpu()
    want, want_score = _reference(q, kd, vd, table, n, "sum", torch.zeros(2, 129, 2), 0)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score.double(), want_score, atol=1e-5, rtol=1e-4)


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


@pytest.mark.parametrize("dtype, d", [(torch.float32, 64), (torch.bfloat16, 128), (torch.float32, 48)])
def test_rope_inplace_matches_apply_rope(dtype, d):
    from kvbound.kernels import rope_inplace
    from kvbound.model import apply_rope
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
