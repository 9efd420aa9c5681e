"""Quantized KV: round-trip bounds, attention over packed KV, eviction on packed data, mixed precision."""
import pytest
import torch

from kvbound.kernels import causal_attention as attend
from kvbound.cache import KVCache
from kvbound.errors import KvboundError
from kvbound.models import ModelConfig
from kvbound.cache.policies import H2OPolicy, KeyDiffPolicy, KeyNormPolicy, SnapKVPolicy, TOVAPolicy, WindowPolicy
from kvbound.cache.quant import parse_kv_bits
from kvbound.kernels.packing import dequantize, quantize

D = 64


def cfg(hkv=2, d=D):
    return ModelConfig(arch="LlamaForCausalLM", vocab_size=10, hidden_size=4 * d, num_layers=2, num_heads=4,
                       num_kv_heads=hkv, head_dim=d, intermediate_size=8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_roundtrip_error_bound(bits, group):
    x = torch.randn(50, 3, D, dtype=torch.float64) * 3
    codes, scale, bias = quantize(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == D * bits // 8
    y = dequantize(codes, scale, bias, bits, group, torch.float64)
    g = x.reshape(50, 3, D // group, group)
    step = (g.amax(-1) - g.amin(-1)) / (2 ** bits - 1)
    # half a step of rounding, plus the float16 rounding of scale and bias
    bound = (step / 2 + step * (2 ** bits) * 1e-3 + g.abs().amax(-1) * 1e-3)[..., None]
    assert ((y - x).reshape_as(g).abs() <= bound).all()
    rel = (y - x).norm() / x.norm()
    assert rel < (0.01 if bits == 8 else 0.12)


def test_mixed_residual_reads_back_at_about_8_bit_precision():
    from kvbound.cache.quant import RecentResiduals
    x = torch.randn(20, 2, D)
    ring = RecentResiduals(1, 1, 2, D, sink=2, recent=4, group_size=32, device="cpu")
    err = (ring.roundtrip(0, x) - x).norm() / x.norm()
    err8 = (dequantize(*quantize(x, 8, 32), 8, 32) - x).norm() / x.norm()
    err4 = (dequantize(*quantize(x, 4, 32), 4, 32) - x).norm() / x.norm()
    assert err < 1.5 * err8 and err < err4 / 8


def test_merged_keys_in_the_window_get_their_new_values_residuals():
    """`RecentResiduals.rewrite` after a merge: a target the ring holds after the step (the window from newest -
    recent, no sinks) reads back its new value at mixed precision from its new 4-bit codes; every other entry of
    every row and layer, and targets the ring no longer holds, keep what they held."""
    from kvbound.cache.quant import RecentResiduals
    from kvbound.kernels.reference import ring_entry
    gen = torch.Generator().manual_seed(3)
    ring = RecentResiduals(2, 2, 2, D, sink=2, recent=4, group_size=32, device="cpu")
    positions = torch.arange(12)[None].expand(2, -1)
    for layer in range(2):
        ring.write(layer, torch.tensor([0, 1]), positions, torch.randn(2, 12, 2, D, generator=gen),
                   torch.randn(2, 12, 2, D, generator=gen))
    before = [t.clone() for t in ring.tensors()]
    pos = torch.tensor([[0, 3, 6, 7, 8, 9, 10, 11]] * 2)[..., None].expand(-1, -1, 2).contiguous()  # [B, M, H]
    which = torch.rand(2, 8, 2, generator=gen) < 0.6
    which[:, [0, 1, 4]] = True  # a sink, a position past the window, one inside it
    k, v = torch.randn(2, 8, 2, D, generator=gen), torch.randn(2, 8, 2, D, generator=gen)
    rows, newest = torch.tensor([1, 0]), torch.tensor([11, 11])
    ring.rewrite(1, rows, pos, k, v, which, newest)
    main = lambda x: dequantize(*quantize(x, 4, 32), 4, 32)  # noqa: E731  the target's new 4-bit codes, read back
    held = which & (pos >= 2) & (pos >= 7)
    read = ring.add(1, rows, main(k), main(v), pos, newest)  # the window as the step ending at 11 read it
    for x, got in zip((k, v), read):
        assert torch.allclose(got[held], ring.roundtrip(1, x)[held], atol=1e-6)
    changed = torch.zeros(2, 2 * ring.size, 2, dtype=torch.bool)
    b, m, h = held.nonzero(as_tuple=True)
    changed[rows[b], ring.size + ring_entry(pos[b, m, h], 2, 4), h] = True
    for old, new in zip(before, ring.tensors()):
        assert torch.equal(old[~changed], new[~changed])
        assert not torch.equal(old[changed], new[changed])


def test_attention_over_quantized_matches_dequantize_then_attend():
    c = KVCache(cfg(), None, kv_bits=8, kv_group_size=32)
    q, k, v = torch.randn(9, 4, D), torch.randn(9, 2, D), torch.randn(9, 2, D)
    out = c.attend(0, q, k, v, c.next_positions(9))
    kq = dequantize(*quantize(k, 8, 32), 8, 32)
    vq = dequantize(*quantize(v, 8, 32), 8, 32)
    ref, _ = attend(q, kq, vq)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact, _ = attend(q, k, v)
    assert (out - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("policy", [WindowPolicy(budget=10, sink=2), H2OPolicy(sink=2, heavy=4, recent=4),
                                    H2OPolicy(sink=1, heavy=5, recent=4, evict_every=3),
                                    H2OPolicy(sink=2, heavy=4, recent=4, score="observed"),
                                    TOVAPolicy(sink=1, heavy=9), KeyNormPolicy(sink=2, heavy=4, recent=4),
                                    SnapKVPolicy(sink=1, heavy=5, recent=4, window=3, kernel=3),
                                    KeyDiffPolicy(sink=2, heavy=4, recent=4)])
@pytest.mark.parametrize("bits", [8, 4])
def test_eviction_on_packed_data_equals_evict_then_quantize(policy, bits):
    """Same kept tokens and bit-identical packed bytes as quantizing the kept tokens of a float cache."""
    torch.manual_seed(0)
    qc = KVCache(cfg(), policy, kv_bits=bits, kv_group_size=32)
    fc = KVCache(cfg(), policy, dtype=torch.float32)
    allk, allv = [], []
    for t in (6, 1, 1, 5, 1, 1, 1, 1, 1, 7, 1, 1):
        q, k, v = torch.randn(t, 4, D), torch.randn(t, 2, D), torch.randn(t, 2, D)
        # feed the float cache the values the quantized cache sees, so both make the same choices
        kq = dequantize(*quantize(k, bits, 32), bits, 32)
        vq = dequantize(*quantize(v, bits, 32), bits, 32)
        allk.append(k)
        allv.append(v)
        for layer in (0, 1):
            qc.attend(layer, q, k, v, qc.next_positions(t))
            fc.attend(layer, q, kq, vq, fc.next_positions(t))
        qc.advance(t)
        fc.advance(t)
    k_all = torch.cat(allk)
    for layer in (0, 1):
        for h in range(2):
            assert qc.kept_positions(layer, h) == fc.kept_positions(layer, h)
            used = qc._slots_used(layer)  # live slots, plus the free one once the cache is full
            pos = qc.pos[layer, :used, h]
            live = pos >= 0
            assert int(live.sum()) == len(qc)
            codes, scale, bias = quantize(k_all[pos[live].long(), h], bits, 32)
            packed = qc.store.packed.k
            assert torch.equal(packed.codes[layer, :used, h][live], codes)
            assert torch.equal(packed.scale[layer, :used, h][live], scale)
            assert torch.equal(packed.bias[layer, :used, h][live], bias)


def _mixed_expected(c, ks, first):
    """What each live place of layer 0 should read in a step from `first`: [M, H, D] K and V and the live mask."""
    mixed, pol = c.ring, c.policy
    pos = c.positions_held(0)
    live = pos >= 0
    p = pos.clamp(min=0).long()
    wide = live & ((p < pol.sink) | (p >= first - pol.recent))
    heads = torch.arange(pos.shape[1])
    out = []
    for x_all in ks:
        x = x_all[p, heads]
        out.append(torch.where(wide[..., None], mixed.roundtrip(0, x), dequantize(*quantize(x, 4, 32), 4, 32)))
    return out[0], out[1], live


@pytest.mark.parametrize("steps", [(5, 1, 1, 1, 1, 1, 1, 1, 1, 1), (3, 9, 1, 1, 6, 1, 1)])
def test_mixed_widths_read_the_window_and_sinks_at_8_bit_precision_and_the_rest_at_4(steps):
    """heavy=4,recent=8: after every step each held token reads back as its mixed round trip while it is a sink
    or among the `recent` newest tokens, and as its 4-bit quantization once it left; a decode step attends over
    exactly the values held before it plus its own token's round trip."""
    from kvbound.cache.steps import WindowRead, read_kv
    pol = H2OPolicy(sink=2, heavy=6, recent=4)
    c = KVCache(cfg(), pol, kv_bits=parse_kv_bits("heavy=4,recent=8"), kv_group_size=32)
    ks, vs = torch.empty(0, 2, D), torch.empty(0, 2, D)
    for t in steps:
        q, k, v = torch.randn(t, 4, D), torch.randn(t, 2, D), torch.randn(t, 2, D)
        if t == 1:  # the expected output from the places held before the step and the new token
            kw, vw, live = _mixed_expected(c, (ks, vs), c.seen)
            kn, vn = c.ring.roundtrip(0, k), c.ring.roundtrip(0, v)
            want = []
            for h in range(2):
                kh, vh = torch.cat([kw[live[:, h], h], kn[:, h]]), torch.cat([vw[live[:, h], h], vn[:, h]])
                want.append(attend(q[:, 2 * h:2 * h + 2], kh[:, None], vh[:, None])[0])
            want = torch.cat(want, 1)
        ks, vs = torch.cat([ks, k]), torch.cat([vs, v])
        out = c.attend(0, q, k, v, c.next_positions(t))
        c.advance(t)
        if t == 1:
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        kw, vw, live = _mixed_expected(c, (ks, vs), c.seen)
        read = WindowRead(c.ring, c.one_row, torch.tensor([c.seen]), c.positions_held(0)[None])
        got_k, got_v = read_kv(c.store, 0, torch.arange(live.shape[0])[None], read)  # as the next step reads them
        torch.testing.assert_close(got_k[0][live], kw[live], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_v[0][live], vw[live], atol=1e-5, rtol=0)
    held = c.nbytes()["held_bytes"]
    assert 0 < held < c.nbytes()["full_bf16_bytes"]


def test_quantized_kv_start_keeps_full_precision_until_threshold():
    c = KVCache(cfg(), None, kv_bits=8, kv_group_size=32, quantized_kv_start=8)
    k = torch.randn(6, 2, D)
    c.attend(0, torch.randn(6, 4, D), k, torch.randn(6, 2, D), c.next_positions(6))
    assert torch.equal(c.store.gather(0, slice(0, 6))[0], k)  # still exact
    c.attend(0, torch.randn(3, 4, D), torch.randn(3, 2, D), torch.randn(3, 2, D), torch.arange(6, 9))
    torch.testing.assert_close(c.store.gather(0, slice(0, 6))[0], dequantize(*quantize(k, 8, 32), 8, 32))


def test_bad_quant_config_is_rejected():
    with pytest.raises(KvboundError, match="unsupported bit width 3"):
        parse_kv_bits("3")
    with pytest.raises(KvboundError, match="heavy=B,recent=B"):
        parse_kv_bits("heavy=8,old=4")
    with pytest.raises(KvboundError, match="keep recent tokens wider, heavy=4,recent=8"):
        parse_kv_bits("heavy=8,recent=4")
    with pytest.raises(KvboundError, match="divide head_dim"):
        KVCache(cfg(d=48), None, kv_bits=8, kv_group_size=32)
    with pytest.raises(KvboundError, match="needs an h2o policy"):
        KVCache(cfg(), WindowPolicy(budget=8, sink=1), kv_bits={"heavy": 4, "recent": 8})


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_store_gives_the_decode_kernel_its_codes(bits):
    """What the fused kernel is handed (kernel_args, slot_table) read through the dispatch point's CPU
    reference equals attention over the store's dequantized contents: the wiring of the CUDA path."""
    from kvbound.kernels import decode_attention
    c = KVCache(cfg(), H2OPolicy(sink=2, heavy=4, recent=4), kv_bits=bits, kv_group_size=32)
    c.attend(0, torch.randn(9, 4, D), torch.randn(9, 2, D), torch.randn(9, 2, D), c.next_positions(9))
    c.advance(9)
    for _ in range(5):  # evicting decode steps: the live slots are no longer in stream order
        c.attend(0, torch.randn(1, 4, D), torch.randn(1, 2, D), torch.randn(1, 2, D), c.next_positions(1))
        c.advance(1)
    n = c._slots_used(0)
    k_pool, v_pool, quant = c.store.kernel_args(0)
    assert quant["bits"] == bits and k_pool.dtype == torch.uint8
    q = torch.randn(1, 4, D)
    got = decode_attention(q, k_pool, v_pool, c.store.slot_table(n)[None], torch.tensor([n], dtype=torch.int32),
                           quant=quant)
    want, _ = attend(q, *c.store.gather(0, slice(0, n)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
