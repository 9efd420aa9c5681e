"""Where the score export's time goes: GPU time per kernel (split, merge, fold) of decode_attention with
export off and on, from the PyTorch profiler, cycling through input sets larger than L2 as
decode_attention.py does.

    PYTHONPATH=src:benchmarks python benchmarks/export_profile.py
"""
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from decode_attention import SHAPES, tune_inputs
from kvbound.kernels import decode_attention


def kernel_times(fn, sets, calls=40):
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i % sets)
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total / calls
    return total


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'shape':<8}{'B':>3}{'ctx':>6} {'kernel':<28}{'off us':>8}{'on us':>8}")
    for name, bsz, ctx in [("8b", 64, 2048), ("8b", 64, 8192), ("8b", 16, 32768), ("smollm2", 64, 8192)]:
        sets, k, v, tables, lens, qs = tune_inputs(name, bsz, ctx, block=16)
        score = torch.zeros(bsz, ctx, SHAPES[name][1], device="cuda")
        off = kernel_times(lambda i: decode_attention(qs[i], k, v, tables[i], lens), sets)
        on = kernel_times(lambda i: decode_attention(qs[i], k, v, tables[i], lens, score=score, score_mode="sum"),
                          sets)
        for kname in sorted(set(off) | set(on)):
            print(f"{name:<8}{bsz:>3}{ctx:>6} {kname[:28]:<28}{off.get(kname, 0):>8.1f}{on.get(kname, 0):>8.1f}")
        print(f"{name:<8}{bsz:>3}{ctx:>6} {'total':<28}{sum(off.values()):>8.1f}{sum(on.values()):>8.1f}",
              flush=True)
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
