#!/usr/bin/env bash
# Checks every Triton kernel against its reference on this machine's GPU, then times them against
# the torch reference and the measured speed of light (bench/kernels.py); results land in
# bench/results/. Installs nothing. Run from anywhere:  bash bench/gpu_check.sh
# Python: $PYTHON if set, else the checkout's .venv, else python3 on PATH.
# Needs torch and triton (kernels) and, for decode_sol.py, the engine's own light dependencies:
# msgspec, tokenizers, safetensors, tqdm, jinja2 (no fastapi/uvicorn). Where the GPU machine lacks
# them, put their wheels on PYTHONPATH first (pip install --target DIR ...).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA GPU is visible to $PY (torch.cuda.is_available() is False or torch is" >&2
    echo "missing). These checks compile and time Triton kernels on a GPU; on a CPU-only machine run" >&2
    echo "'pytest tests/kernels' (Triton interpreter) or 'python bench/kernels.py --smoke' instead." >&2
    exit 2
fi

# Compiled kernels, not the CPU interpreter, whatever the calling shell had set.
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv

rc=0
# bench/kernels.py takes about 2-4 minutes on an H200; the timeout keeps the whole check under 8.
timeout 450 "$PY" bench/kernels.py "$@" || rc=$?
[ $rc -eq 124 ] && echo "gpu_check.sh: bench/kernels.py timed out after 450 s" >&2

# Decode speed of light: single-stream and batch-64 decode of a dummy Qwen3-30B-A3B-sized model.
"$PY" bench/decode_sol.py || rc=$?

exit $rc
