"""The packed kernels on the GPU against dequantize-then-attend for every head size, group, bit width,
block size and dtype; prints BAD for a wrong result and "refused" where decode_attention refuses the block
size (4-bit with 16-key blocks, which gave wrong results with Triton 3.6).

    PYTHONPATH=src python3 benchmarks/packed_block_check.py
"""
import torch
from kvbound.kernels import decode_attention
from kvbound.kernels.packing import dequantize, quantize
torch.manual_seed(0)
for d in (64, 128):
    for group in (32, 64, 128):
        if group > d: continue
        for bits in (8, 4):
            for blk in (16, 32, 64, 128, 256):
                for dt in (torch.bfloat16, torch.float32):
                    q = torch.randn(3, 8, d, device="cuda", dtype=dt)
                    k = torch.randn(600, 2, d, device="cuda", dtype=dt); v = torch.randn_like(k)
                    tab = torch.randperm(600, device="cuda")[:3 * 200].view(3, 200).int()
                    lens = torch.tensor([200, 77, 150], device="cuda", dtype=torch.int32)
                    kc, ks, kb = quantize(k, bits, group); vc, vs, vb = quantize(v, bits, group)
                    quant = dict(bits=bits, group=group, k_scale=ks, k_bias=kb, v_scale=vs, v_bias=vb)
                    want = decode_attention(q, dequantize(kc, ks, kb, bits, group, dt), dequantize(vc, vs, vb, bits, group, dt), tab, lens)
                    try:
                        got = decode_attention(q, kc, vc, tab, lens, quant=quant, block_n=blk, split=blk * 4)
                    except ValueError as e:
                        print("refused", d, group, bits, blk, dt); continue
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    if err > 1e-2: print("BAD", d, group, bits, blk, dt, f"{err:.2e}")
print("q4check done")
