#!/usr/bin/env bash
# One short run that proves the CUDA path (<= 8 minutes on an H200), or its CPU dry run.
#
#   kvserve/cluster/bench/gpu_check.sh            on a CUDA machine, from the checkout, no install:
#     env             torch/triton/device versions, which optional packages exist   -> env.txt
#     kernel_tests    tests/kernels compiled on the device (needs pytest: see below)  -> kernel_tests.txt
#     parity          engine vs HF greedy fp32 tokens (random checkpoints, SmolLM2 if
#                     $KVSERVE_SMOLLM2_DIR), pool sized by gpu_memory_utilization    -> parity.json
#     kv_smoke        bf16, fp8-KV, int8-KV runs                                      -> kv_smoke.json
#     swap_migration  swap preemption (pinned host blocks) + export/import on device  -> swap_migration.json
#     kernels         the kernel bench (checks + timings)                             -> kernels.json
#     offline         bench offline rows, tiny and small                              -> offline.json
#     engine_1b       Llama-3.2-1B shape bf16: decode-heavy + mixed, graphs on/off    -> engine_1b.json
#     decode_profile  profiler: wall/step, GPU busy, launches/step at batch 1/32/256  -> decode_profile.json
#     tier            evict, reload from host and disk tiers (side-stream pinned copies),
#                     tokens identical, load/recompute cost ratio per tier            -> tier.json
#   kvserve/cluster/bench/gpu_check.sh --dry-run  the same Python entry points on CPU with tiny sizes (Triton under
#                                         its interpreter; no pytest step, no timing claims): make test runs it.
#
# Every file goes to $OUT (default .), with STEP.log beside it and summary.txt (one line per step). Each
# step runs in its own process under `timeout` with the budget below (seconds; the sum is 700: engine_1b and decode_profile added 210), so a hang
# costs one step. Steps needing Ray (worker actors, router) are not run: the GPU machine has no Ray.
# Interpreter: $PYTHON, else .venv/bin/python, else python3. PYTHONPATH gets the checkout (and
# $GPU_CHECK_SITE, default .gpu-site, if it exists: e.g. `pip install --target .gpu-site pytest` here and
# carry it, where the GPU machine has no pytest). Extra arguments go to `python -m kvserve.cluster.bench.kernels`.
# Exit status: non-zero if any step failed or timed out.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."  # the checkout root (this file is kvserve/cluster/bench/)

if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
site=${GPU_CHECK_SITE:-.gpu-site}
extra_path=$PWD
[[ -d $site ]] && extra_path=$extra_path:$(cd "$site" && pwd)
export PYTHONPATH="$extra_path${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR"
summary=$OUT_DIR/summary.txt
: >"$summary"
status=0

# run_step NAME BUDGET_S COMMAND...: COMMAND's output to NAME.log; one line to summary.txt.
run_step() {
  local name=$1 budget=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0))
  if [[ $rc -eq 0 ]]; then
    echo "ok       $name (${took}s of ${budget}s)" | tee -a "$summary"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "TIMEOUT  $name after ${budget}s" | tee -a "$summary"; status=1
  else
    echo "FAILED   $name (exit $rc, ${took}s; see $name.log)" | tee -a "$summary"; status=1
    tail -n 20 "$OUT_DIR/$name.log" >&2
  fi
}

skip() { echo "skipped  $1: $2" | tee -a "$summary"; }

ENV_REPORT=$(cat <<'EOF'
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "capability", f"{p.major}.{p.minor}", "memory GiB", round(p.total_memory / 2**30, 1))
for m in ("transformers", "safetensors", "tokenizers", "grpc", "google.protobuf", "pytest", "ray", "rich"):
    try:
        found = importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        found = False
    print(f"{m}: {'present' if found else 'absent'}")
EOF
)

if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  # NOTE: generous budgets: the dry run is about code paths, on a possibly loaded CPU.
  run_step env 60 "$PY" -c "$ENV_REPORT"
  for step in parity kv_smoke swap_migration tier; do
    run_step "$step" 300 "$PY" -m kvserve.cluster.bench.gpu_check "$step" --device cpu --dry-run --out "$OUT_DIR"
  done
  run_step kernels 300 env TRITON_INTERPRET=1 "$PY" -m kvserve.cluster.bench.kernels --dry-run \
    --json-out "$OUT_DIR/kernels_dry.json" "$@"
  run_step offline 300 "$PY" -m kvserve.cluster.bench.gpu_check offline --device cpu --dry-run --out "$OUT_DIR"
  for step in engine_1b decode_profile; do
    run_step "$step" 300 "$PY" -m kvserve.cluster.bench.gpu_check "$step" --device cpu --dry-run --out "$OUT_DIR"
  done
  skip kernel_tests "not in a dry run (make test runs tests/kernels itself)"
  skip ray "worker actors and the router need Ray; the dry run mirrors the GPU machine, which has none"
  exit "$status"
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check.sh: no CUDA device here; use --dry-run on CPU" >&2
  exit 2
fi
run_step env 15 "$PY" -c "$ENV_REPORT"
cat "$OUT_DIR/env.log"
if "$PY" -c 'import pytest' 2>/dev/null; then
  # NOTE: test_bench_dry.py is this script's own CPU dry run: not what a GPU minute is for.
  run_step kernel_tests 90 "$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=15 \
    --ignore tests/kernels/test_bench_dry.py
  cp "$OUT_DIR/kernel_tests.log" "$OUT_DIR/kernel_tests.txt"
else
  skip kernel_tests "pytest is not installed for $PY (pip install --target .gpu-site pytest, and carry .gpu-site)"
fi
run_step parity 50 "$PY" -m kvserve.cluster.bench.gpu_check parity --device cuda --out "$OUT_DIR"
run_step kv_smoke 30 "$PY" -m kvserve.cluster.bench.gpu_check kv_smoke --device cuda --out "$OUT_DIR"
run_step swap_migration 30 "$PY" -m kvserve.cluster.bench.gpu_check swap_migration --device cuda --out "$OUT_DIR"
run_step kernels 70 "$PY" -m kvserve.cluster.bench.kernels --json-out "$OUT_DIR/kernels.json" "$@"
run_step offline 30 "$PY" -m kvserve.cluster.bench.gpu_check offline --device cuda --out "$OUT_DIR"
run_step tier 30 "$PY" -m kvserve.cluster.bench.gpu_check tier --device cuda --out "$OUT_DIR"
run_step engine_1b 90 "$PY" -m kvserve.cluster.bench.gpu_check engine_1b --device cuda --out "$OUT_DIR"
run_step decode_profile 45 "$PY" -m kvserve.cluster.bench.gpu_check decode_profile --device cuda --out "$OUT_DIR"
skip ray "worker actors, router and migration over Ray need Ray, which the GPU machine lacks (CPU tests cover them)"
exit "$status"
