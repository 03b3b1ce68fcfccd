#!/usr/bin/env bash
# The oldest versions pyproject.toml declares (lightning 2.4, torchmetrics 1.1), in their own
# environment (.venv-oldest), run on a smoke subset: fit, validate, test and predict at pp=2 and
# pp=4, fit at pp=2 x tp=2, and an exact checkpoint resume at dp=2 x pp=2.
# .ci/run runs it after the full suite, so the declared range is tested, not assumed.
# CI=true, or FRESH_VENV=1, rebuilds the environment from scratch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-oldest"
if [[ "${CI:-}" == "true" || "${FRESH_VENV:-0}" == "1" ]]; then
  rm -rf "$venv"
fi
if [[ ! -x "$venv/bin/python" || ! -f "$venv/.installed" ]]; then
  bash "$root/scripts/new_venv.sh" "$venv"  # pip and torch, as for scripts/venv.sh
  "$venv/bin/python" -m pip install --quiet "lightning==2.4.*" "torchmetrics==1.1.*" "pytest>=7" "pytest-timeout>=2.1"
  "$venv/bin/python" -m pip install --quiet --no-deps -e "$root"
  touch "$venv/.installed"
fi
cd "$root"
"$venv/bin/python" -m pip list 2>/dev/null | grep -E '^(torch|lightning|torchmetrics) '
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_strategy_fit.py tests/test_strategy_eval.py tests/test_tensor_parallel_fit.py \
  tests/test_checkpoints.py::test_epoch_boundary_resume_is_exact_dp2_pp2_adam
