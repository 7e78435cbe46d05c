#!/usr/bin/env bash
# Kernel checks for the GPU machine.
#   cluster/bench/gpu_check.sh            kernel tests compiled on CUDA (tests/kernels: the gpu-marked bf16
#                                         cases plus the fp32/fp16 cases, now compiled), then the kernel
#                                         bench; JSON to ${OUT:-.}/kernels.json, logs next to it.
#   cluster/bench/gpu_check.sh --dry-run  CPU only: the bench's interpreter smoke run (tiny sizes, no
#                                         timing); JSON to ${OUT:-.}/kernels_dry.json.
# Extra arguments go to `python -m cluster.bench.kernels`. Exit status: non-zero if any step failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR"

if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  TRITON_INTERPRET=1 "$PY" -m cluster.bench.kernels --dry-run --json-out "$OUT_DIR/kernels_dry.json" "$@"
  exit
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check.sh: no CUDA device here; use --dry-run on CPU" >&2
  exit 2
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"device", torch.cuda.get_device_name())' | tee "$OUT_DIR/kernels_env.txt"

status=0
"$PY" -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT_DIR/kernels_tests.txt" || status=1
"$PY" -m cluster.bench.kernels --json-out "$OUT_DIR/kernels.json" "$@" 2>&1 \
  | tee "$OUT_DIR/kernels_bench.txt" || status=1
exit "$status"
