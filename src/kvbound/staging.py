"""Host values to the GPU without waiting for it.

A copy from pageable host memory makes the host wait until the GPU has run everything queued before it, so
a step built while the previous one runs (the engine's run-ahead) would stall at its first small transfer.
From pinned memory (PyTorch's caching host allocator, which keeps a block until its copy is done) the copy
is queued like a kernel."""
from __future__ import annotations

import torch


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype) on `device`, queued behind the GPU's work rather than waiting for it."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
