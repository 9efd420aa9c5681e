"""Bad input gives a clear error and a non-zero exit, never a traceback."""
import json
import subprocess
import sys

import pytest
import torch


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvbound.cli", *args], capture_output=True, text=True, timeout=120)


def bad_dir(tmp_path, cfg):
    d = tmp_path
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist: /no/such/model.gguf"),
    (["generate", "hi", "--max-tokens", "0"], "must be >= 1, got 0"),
    (["generate", "hi", "--max-tokens", "-3"], "must be >= 1, got -3"),
    (["generate", "hi", "--policy", "lru", "--budget", "8"], "unknown policy 'lru'"),
    (["generate", "hi", "--policy", "h2o:sink=4,heavy=4,recent=8,budget=10"], "!= budget (10)"),
    (["generate", "hi", "--policy", "h2o:sink=4,heavy=4,recent=4", "--ema-decay", "1.5", "--score", "ema"],
     "ema-decay must be in (0, 1)"),
    (["generate", "hi", "--policy", "window", "--budget", "4"], "must be < budget (4)"),
    (["generate", "hi", "--kv-bits", "3"], "unsupported bit width 3"),
    (["info", "--model", "/tmp"], "missing config.json"),
    pytest.param(["info", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_input(args, needle):
    r = run(*args)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_architecture_and_malformed_config(tmp_path):
    r = run("info", "--model", bad_dir(tmp_path / "a", {"architectures": ["GPT2LMHeadModel"]}))
    assert r.returncode != 0 and "unsupported architecture 'GPT2LMHeadModel'" in r.stderr
    r = run("info", "--model", bad_dir(tmp_path / "b", {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    assert r.returncode != 0 and "malformed config, missing key" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["bench", "serve", "--rate", "0"], "--rate and --duration must be > 0"),
    (["bench", "throughput", "--num-blocks", "1", "--input-len", "64"], "but the pool has only 1"),
    (["bench", "throughput", "--kv-bits", "8"], "stores K/V unquantized"),
    (["bench", "serve", "--policy", "window", "--budget", "4"], "must be < budget (4)"),
    (["bench", "throughput", "--prefill-chunk", "4096"], "must be >= prefill_chunk"),
])
def test_bench_bad_input(args, needle):
    r = run(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
