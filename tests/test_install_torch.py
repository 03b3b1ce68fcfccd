"""``scripts/install_torch.sh``: which torch build the README's commands install.

A fake ``python`` stands in for the environment's interpreter: it answers pip's dry run with a
report (the CUDA build's ``nvidia-*`` wheels, or a CPU build without them) and records the real
install command, so the script's choice is checked without a network or a download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_torch.sh"

_FAKE_PYTHON = """#!/usr/bin/env bash
# "python -m pip install --dry-run ... --report -": print the canned report; "python -c CODE":
# run CODE with the real interpreter; any other call: record it.
if [[ " $* " == *" --dry-run "* ]]; then cat "$FAKE_REPORT"; exit 0; fi
if [[ "$1" == "-c" ]]; then exec "$REAL_PYTHON" "$@"; fi
echo "$*" >> "$FAKE_LOG"
"""


def _install(tmp_path: Path, *, cuda_report: bool, gpu: bool, env: dict[str, str] | None = None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    wheels = ["torch", "filelock"] + (["nvidia-cublas-cu12", "nvidia-cudnn-cu12"] if cuda_report else [])
    report = tmp_path / "report.json"
    report.write_text(
        '{"install": [' + ", ".join(f'{{"metadata": {{"name": "{w}"}}}}' for w in wheels) + "]}"
    )
    log = tmp_path / "pip.log"
    # Only this fake's folder and the system's tools: no nvidia-smi of the machine running the test.
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    run_env = {
        "PATH": path,
        "FAKE_REPORT": str(report),
        "FAKE_LOG": str(log),
        "REAL_PYTHON": sys.executable,
        **(env or {}),
    }
    subprocess.run(["bash", str(SCRIPT), str(fake)], env=run_env, check=True, capture_output=True, text=True)
    return log.read_text().strip()


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("bash") is None, reason="the script's Linux branch"
)


def test_without_a_gpu_the_cuda_build_is_replaced_by_the_cpu_build(tmp_path: Path) -> None:
    assert _install(tmp_path, cuda_report=True, gpu=False) == (
        "-m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    )


def test_an_index_that_serves_a_cpu_build_is_used_as_it_is(tmp_path: Path) -> None:
    assert _install(tmp_path, cuda_report=False, gpu=False) == "-m pip install --quiet torch==2.13.0"


def test_with_a_gpu_the_configured_index_is_used(tmp_path: Path) -> None:
    assert _install(tmp_path, cuda_report=True, gpu=True) == "-m pip install --quiet torch==2.13.0"


def test_the_user_chooses_the_version_and_the_index(tmp_path: Path) -> None:
    env = {"TORCH_REQUIREMENT": "torch>=2.4", "TORCH_INDEX_URL": "https://example.invalid/whl/cu128"}
    assert _install(tmp_path, cuda_report=True, gpu=False, env=env) == (
        "-m pip install --quiet torch>=2.4 --index-url https://example.invalid/whl/cu128"
    )
