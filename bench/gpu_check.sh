#!/usr/bin/env bash
# Checks every Triton kernel against its reference on this machine's GPU, then times them against
# the torch reference and the measured speed of light (bench/kernels.py), then measures decode
# speed of light on a Qwen3-30B-A3B-sized model (bench/decode_sol.py). Installs nothing.
#
#   bash bench/gpu_check.sh [OUT_DIR]      # default bench/results/gpu-<UTC date-time>
#
# Everything it produces lands in OUT_DIR: each stage's JSON/text results and its full log
# (<stage>.log), plus env.txt (nvidia-smi). Each stage runs under `timeout`; the whole check fits
# in 8 minutes (kernels 300 s, decode 150 s, nvidia-smi 20 s), 12 with the elastic stage (240 s, on 2+
# GPUs only). Exit status: 0 all passed, 1 a check failed or a stage failed or timed out, 2 no CUDA GPU here.
# Python: $PYTHON if set, else the checkout's .venv, else python3 on PATH. Needs only torch and
# triton: decode_sol.py measures the model modules alone when the engine's own dependencies
# (msgspec, tokenizers, tqdm) are missing, and uses the whole engine when they are there.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA GPU is visible to $PY (torch.cuda.is_available() is False or torch is" >&2
    echo "missing). These checks compile and time Triton kernels on a GPU; on a CPU-only machine run" >&2
    echo "'pytest tests/kernels' (Triton interpreter), 'python bench/kernels.py --smoke' or" >&2
    echo "'python -m moe_serve.kernels.aot_check' (ahead-of-time compile for sm_90/sm_100) instead." >&2
    exit 2
fi

OUT="${1:-bench/results/gpu-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" || { echo "gpu_check.sh: cannot create $OUT" >&2; exit 1; }
echo "gpu_check.sh: writing to $OUT"

# Compiled kernels, not the CPU interpreter, whatever the calling shell had set.
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
fi
"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__)' 2>&1 | tee -a "$OUT/env.txt"

rc=0
# stage NAME SECONDS CMD...: runs CMD under a time limit, its output to the terminal and NAME.log.
stage() {
    local name=$1 limit=$2 s
    shift 2
    echo "== $name (time limit ${limit} s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    s=${PIPESTATUS[0]}
    if [ "$s" -eq 124 ] || [ "$s" -eq 137 ]; then
        echo "gpu_check.sh: $name timed out after $limit s" | tee -a "$OUT/$name.log" >&2
    elif [ "$s" -ne 0 ]; then
        echo "gpu_check.sh: $name exited with status $s" | tee -a "$OUT/$name.log" >&2
    fi
    [ "$s" -eq 0 ] || rc=1
}

# Correctness of every kernel configuration, then kernel timing (about 2-4 minutes on an H200).
stage kernels 300 "$PY" bench/kernels.py --out-dir "$OUT"
# Decode speed of light: single-stream and batch-64 decode of a dummy Qwen3-30B-A3B-sized model.
stage decode_sol 150 "$PY" bench/decode_sol.py --out "$OUT/decode_sol.json"

# Elastic EP over NCCL (tests/distributed/test_elastic_ep.py's GPU case): the cores run with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2, a rank stalled in a step is waited for, and a survivor outlives a
# killed rank's core and regroups. An NCCL job needs one GPU per rank (NCCL refuses two ranks on one
# device), so this stage needs 2 GPUs, and pytest with the engine's dependencies; elsewhere it says why
# it did not run (the regroup itself is tested over gloo on the CPU, in the same file).
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$ngpu" -ge 2 ] && "$PY" -c 'import pytest, msgspec, tokenizers, httpx' 2>/dev/null; then
    stage elastic_nccl 240 "$PY" -m pytest -q -x -rs tests/distributed/test_elastic_ep.py -k nccl
else
    echo "== elastic_nccl not run: it needs 2 CUDA GPUs (found $ngpu) and pytest with the engine's dependencies" \
        | tee "$OUT/elastic_nccl.log"
fi

echo "gpu_check.sh: done (status $rc); results in $OUT"
exit $rc
