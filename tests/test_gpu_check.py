"""The GPU check (``scripts/gpu_check.py``) in its reduced CPU form, as CI runs it, and the
CUDA-only decisions it cannot reach on a CPU, tested one by one: a host tensor broadcast over an
NCCL group travels through the device (F1 in docs/gpu.md), early receives are refused on CUDA
(F2), and a stage output NCCL cannot send is refused by name (F5, F6)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.data_parallel import replicas
from lightning_pipe.execution.executor import receives_early
from lightning_pipe.execution.wire import check_sendable
from lightning_pipe.schedule import build_schedule
from tests.distributed import run_distributed, script_main

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(argv: list[str], log: str) -> int | str | None:
    """``python scripts/gpu_check.py *argv`` in this (forked) process, as from a shell: no rank
    variables, its output to ``log`` (its errors to ``log.err``); its exit status."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    for fd, path in ((1, log), (2, f"{log}.err")):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        script_main(str(ROOT / "scripts" / "gpu_check.py"), argv, str(ROOT))
    except SystemExit as exit:
        return exit.code
    return 0


@pytest.mark.distributed  # a one-rank process group in a child process
def test_the_reduced_gpu_check_runs_and_passes(tmp_path: Path) -> None:
    """The script run with ``--cpu`` as CI runs it, in a process forked by the test harness (the
    imports done) instead of a fresh interpreter."""
    out, log = tmp_path / "gpu.json", tmp_path / "gpu.log"
    (code,) = run_distributed(
        gpu_check, 1, ["--cpu", "--json", str(out)], str(log), init_group=False, timeout=300
    )
    stdout = log.read_text(errors="replace")
    assert code == 0, stdout[-3000:] + Path(f"{log}.err").read_text(errors="replace")[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by_section: dict[str, list[dict]] = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert set(by_section) == {"throughput", "equality", "host syncs", "large", "device paths"}
    synced = by_section["host syncs"]  # the same steps; the sync debug mode itself needs CUDA
    assert [r["status"] for r in synced] == ["info"] * 3, synced
    equal = [r for r in by_section["equality"] if r["status"] == "ok"]
    # 3 schedules x 3 recomputation modes, and compiled layers under 1F1B and ZB-H1 (recomputed)
    assert len(equal) == 11, by_section["equality"]
    assert sum(r["name"].startswith("compiled layers") for r in equal) == 2, by_section["equality"]
    assert all(r["values"]["max_weight_gap"] <= 1e-5 for r in equal)
    assert any(r["status"] == "n/a" and "interleaved" in r["name"] for r in by_section["equality"])
    replayed = [r for r in by_section["device paths"] if r["name"].startswith("dropout masks")]
    assert len(replayed) == 3 and all(r["status"] == "ok" for r in replayed)
    missing = {r["name"] for r in by_section["device paths"] if r["status"] == "missing"}
    assert missing == {"pinned host memory for checkpoint reads"}
    timeline = next(r for r in by_section["device paths"] if r["name"].startswith("timeline spans"))
    assert timeline["status"] == "info" and timeline["values"]["positive"], timeline  # a real trace read
    assert 0.0 < timeline["values"]["compute_share"] <= 1.0, timeline
    ratio = by_section["throughput"][-1]["values"]["ratio"]
    assert math.isfinite(ratio) and ratio > 0
    assert "[equality]" in stdout  # the printed table


def test_host_tensors_travel_through_the_device_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert replicas.carrier_device(group) == torch.device("cuda", 3)  # type: ignore[arg-type]
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    assert replicas.carrier_device(group) is None  # type: ignore[arg-type]


def test_early_receives_are_refused_on_cuda() -> None:
    one_f_one_b = build_schedule("1f1b", 2, 4)
    interleaved = build_schedule("interleaved_1f1b", 4, 4, virtual_stages=2)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    with pytest.raises(ValueError, match=r"receive_early=True cannot run on CUDA.*deadlocks"):
        receives_early(True, cuda, one_f_one_b)
    assert receives_early(None, cuda, interleaved) is False
    assert receives_early(None, cpu, interleaved) is True
    assert receives_early(None, cpu, one_f_one_b) is False
    assert receives_early(True, cpu, one_f_one_b) is True


def test_what_nccl_cannot_send_is_named_before_the_exchange() -> None:
    cuda = torch.device("cuda", 0)
    label = "SEND_F stage 0 micro-batch 2"
    with pytest.raises(
        ValueError, match=r"SEND_F stage 0 micro-batch 2: output tensor 1 is on cpu.*device=x.device"
    ):
        check_sendable(torch.ones(2), cuda, label, 1)
    with pytest.raises(TypeError, match=r"output tensor 0 is int16, which NCCL cannot send"):
        check_sendable(torch.ones(2, dtype=torch.int16), cuda, label, 0)
    check_sendable(torch.ones(2, dtype=torch.int16), torch.device("cpu"), label, 0)  # gloo takes it
