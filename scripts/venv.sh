#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install lightning_pipe into it.
# Sourced by .ci/run and examples/train.sh, so a newcomer needs nothing but Python 3.10+.
# CI=true, or FRESH_VENV=1, rebuilds it from scratch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [[ "${CI:-}" == "true" || "${FRESH_VENV:-0}" == "1" ]]; then
  rm -rf "$venv"
fi
if [[ ! -x "$venv/bin/python" || ! -f "$venv/.installed" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # torch first, the build that fits this machine (CPU where there is no GPU: a bare
  # `pip install torch` on Linux pulls a multi-GB CUDA build); TORCH_REQUIREMENT and
  # TORCH_INDEX_URL choose another (see scripts/install_torch.sh).
  bash "$root/scripts/install_torch.sh" "$venv/bin/python"
  "$venv/bin/python" -m pip install --quiet -e "$root[dev,docs]"
  touch "$venv/.installed"
fi
export PATH="$venv/bin:$PATH"
