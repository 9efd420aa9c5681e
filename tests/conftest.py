import os
from pathlib import Path

# Triton reads this when first imported, and collecting some test modules imports it (transformers'
# masking utilities do): tests/test_kernels.py's default must hold from the start (GPU runs set 0)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def smollm():
    """The real default checkpoint (SmolLM2-135M-Instruct), loaded once per test session."""
    from kvbound.models import load
    try:
        return load()
    except Exception as e:  # the default model package is part of the install; fail loudly if missing
        pytest.fail(f"default model not loadable: {e}")


@pytest.fixture(scope="session")
def shared_data():
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data not present")
    return SHARED_DATA
