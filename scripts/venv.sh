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
  # torch first, the build that fits this machine (see scripts/new_venv.sh).
  bash "$root/scripts/new_venv.sh" "$venv"
  "$venv/bin/python" -m pip install --quiet -e "$root[dev,docs]"
  touch "$venv/.installed"
fi
export PATH="$venv/bin:$PATH"
