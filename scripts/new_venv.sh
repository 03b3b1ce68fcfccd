#!/usr/bin/env bash
# Create a virtual environment at $1 (no system site-packages) with an up-to-date pip and torch,
# the build that fits this machine (scripts/install_torch.sh: CPU where there is no GPU, since a
# bare `pip install torch` on Linux pulls a multi-GB CUDA build; TORCH_REQUIREMENT and
# TORCH_INDEX_URL choose another). What goes in next is the caller's: scripts/venv.sh adds the
# package in editable mode, scripts/oldest.sh the oldest declared dependencies, and
# scripts/wheel_check.sh the built wheel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$1"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
bash "$root/scripts/install_torch.sh" "$venv/bin/python"
