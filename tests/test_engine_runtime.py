"""``examples/train_engine.py``: ``ParallelRuntime`` without Lightning, under torchrun.

dp=2 x pp=2 x tp=2 (8 processes) with global-norm clipping and AdamW trains to the losses of a
plain PyTorch loop on the whole batch (``clip_grad_norm_``, same initial weights) within 1e-5; its
sharded checkpoint, saved after step 6, resumes at pp=4 and continues on the same losses. So meta
construction, tensor-parallel sharding, the data-parallel reducer, clipping and checkpoints all go
through the runtime's public API as a user's loop calls it. With ``--shard-parameters`` (FSDP2
over the data axis) at dp=2 x pp=2 the losses are the same, and its checkpoint resumes unsharded
at pp=4. The sharded run goes through torchrun itself (4 processes, each a fresh interpreter);
the others, the 3D run's 8 ranks among them, run the same script with the same arguments on ranks
forked from the tests' fork server (``tests.distributed.run_script``), which spares them the
imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_pipe.construction.materialize import materialize
from tests.distributed import run_script

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_engine.py"
STEPS = 12


def _plain_torch_losses() -> dict[int, float]:
    """The example's model and data in an ordinary loop, on one process, without lightning_pipe's
    runtime (the initial values are the ones a meta-built model gets from its seed, 0)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from train_engine import build_model, global_batch
    finally:
        sys.path.remove(str(SCRIPT.parent))
    model = build_model()
    materialize(model, torch.device("cpu"), 0, set(), None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = {}
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses[step] = loss.item()
    return losses


def _run(cwd: Path, processes: int, *args: str, torchrun: bool = False) -> dict[int, float]:
    """The example on ``processes`` ranks: under torchrun itself, or on ranks forked from the
    tests' fork server with torchrun's environment (the same script and arguments, without a fresh
    interpreter per rank importing torch again)."""
    out = cwd / f"losses-{processes}-{len(args)}.json"
    argv = ["--steps", str(STEPS), "--losses", str(out), *args]
    if torchrun:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            str(SCRIPT), *argv,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    else:
        run_script(SCRIPT, argv, processes, cwd)
    return {int(step): loss for step, loss in json.loads(out.read_text()).items()}


def test_runtime_trains_dp_pp_tp_like_one_process_and_resumes_at_another_layout(tmp_path: Path) -> None:
    three_d = _run(tmp_path, 8, "--dp", "2", "--pp", "2", "--tp", "2", "--save-at", "6")
    assert (tmp_path / "engine.ckpt" / "pipe_tp_metadata.json").is_file()
    one = _plain_torch_losses()
    assert sorted(three_d) == list(range(STEPS))
    for step, loss in one.items():
        assert three_d[step] == pytest.approx(loss, abs=1e-5), f"dp2 x pp2 x tp2, step {step}"
    resumed = _run(tmp_path, 4, "--pp", "4", "--resume")
    assert sorted(resumed) == list(range(6, STEPS))  # continues after the saved step
    for step, loss in resumed.items():
        assert loss == pytest.approx(one[step], abs=1e-5), f"resumed at pp=4, step {step}"


def test_runtime_with_sharded_parameters_trains_like_one_process_and_resumes_unsharded(
    tmp_path: Path,
) -> None:
    """``--shard-parameters`` (FSDP2 over the data axis) at dp=2 x pp=2: the same losses; its
    checkpoint resumes at pp=4 without sharding on the same losses."""
    sharded = _run(
        tmp_path, 4, "--dp", "2", "--pp", "2", "--shard-parameters", "--save-at", "6", torchrun=True
    )
    one = _plain_torch_losses()
    for step, loss in one.items():
        assert sharded[step] == pytest.approx(loss, abs=1e-5), f"dp2 x pp2 sharded, step {step}"
    resumed = _run(tmp_path, 4, "--pp", "4", "--resume")
    assert sorted(resumed) == list(range(6, STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(one[step], abs=1e-5), f"resumed unsharded at pp=4, step {step}"
