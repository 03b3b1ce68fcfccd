#!/usr/bin/env bash
# Install torch into the environment of the Python given as $1, the build that fits this machine.
# Used by scripts/new_venv.sh (for scripts/venv.sh, scripts/oldest.sh and scripts/wheel_check.sh)
# before the package itself (which only asks for torch>=2.4, so pip keeps what this installed).
#
# Which version: TORCH_REQUIREMENT, default "torch==2.13.0" (the version CI tests); any
#   requirement the package allows works, e.g. TORCH_REQUIREMENT="torch>=2.4".
# Which build: TORCH_INDEX_URL if set (e.g. PyTorch's https://download.pytorch.org/whl/cu128);
#   otherwise, on Linux without an NVIDIA driver (no nvidia-smi), the CPU build: pip is first asked,
#   without installing anything, what the configured index would bring, and if that is the CUDA
#   build (it pulls nvidia-* wheels, several GB) the CPU index is used instead. An index that
#   already serves a CPU build (a mirror, a wheel cache) is used as it is; with a GPU, and on macOS
#   and Windows (whose default wheels are CPU builds), the configured index is used as it is.
set -euo pipefail
python="$1"
requirement="${TORCH_REQUIREMENT:-torch==2.13.0}"
cpu_index="https://download.pytorch.org/whl/cpu"
index_args=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  index_args=(--index-url "$TORCH_INDEX_URL")
elif [[ "$(uname -s)" == "Linux" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  # `pip install --dry-run --report -` resolves without installing and prints what it would install.
  if "$python" -m pip install --quiet --dry-run --ignore-installed --report - "$requirement" 2>/dev/null \
    | "$python" -c '
import json, sys
report = json.load(sys.stdin)
names = [item["metadata"]["name"].lower() for item in report.get("install", [])]
sys.exit(0 if any(name.startswith("nvidia-") for name in names) else 1)
'; then
    echo "install_torch: no NVIDIA GPU here, and the package index would bring torch's CUDA build: installing the CPU build from $cpu_index (set TORCH_INDEX_URL to choose another)" >&2
    index_args=(--index-url "$cpu_index")
  fi
fi
"$python" -m pip install --quiet "$requirement" ${index_args[@]+"${index_args[@]}"}
