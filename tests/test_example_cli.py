"""The example that the README and docs/quickstart.md train (``bash examples/train.sh``): LightningCLI
with the pipe_tp strategy by class path, and a short run of the character GPT on 2 processes whose
validation loss must fall."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_pipe import PipeTPStrategy
from lightning_pipe.consolidate import main as consolidate_main
from tests.distributed import run_distributed, run_script, script_main
from tests.lightning_models import Regressor

ROOT = Path(__file__).resolve().parents[1]


def test_cli_accepts_strategy_by_class_path() -> None:
    cli = LightningCLI(
        Regressor,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.logger=false",
            "--trainer.strategy=lightning_pipe.PipeTPStrategy",
            "--trainer.strategy.pipeline_parallel_size=2",
            "--trainer.strategy.schedule=gpipe",
            "--trainer.strategy.num_microbatches=4",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, PipeTPStrategy)
    assert strategy.pipeline_parallel_size == 2 and strategy.num_microbatches == 4
    assert strategy.schedule.value == "gpipe"
    # The resolved config (what LightningCLI writes to config.yaml) names every strategy option.
    init_args = cli.config["trainer"]["strategy"]["init_args"]
    for option in ("pipeline_parallel_size", "num_microbatches", "schedule", "partition", "recompute"):
        assert option in init_args


def test_cli_help_lists_strategy_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LightningCLI(Regressor, run=False, args=["--trainer.strategy.help=lightning_pipe.PipeTPStrategy"])
    out = capsys.readouterr().out
    for option in (
        "pipeline_parallel_size",
        "num_microbatches",
        "schedule",
        "partition",
        "recompute",
        "timeout",
    ):
        assert f"--trainer.strategy.{option}" in out
    # Options of the DDP wrapper, which pipe_tp never builds, must not be offered.
    assert "find_unused_parameters" not in out and "static_graph" not in out


def from_a_shell(script: str, argv: list[str], log: str) -> int | str | None:
    """``python script *argv`` typed in a shell (no rank variables, no ``MASTER_*``: Lightning's
    launcher starts the other processes itself), run in this process forked by the test harness
    (the imports done) instead of a fresh interpreter; its stderr, and its children's, to ``log``.
    Waits for the processes the launcher started, which must succeed; the exit status."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ["PYTHONPATH"] = str(ROOT)
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    code: int | str | None = 0
    try:
        script_main(str(ROOT / script), argv, str(ROOT))
    except SystemExit as exit:
        code = exit.code
    children = []
    while True:
        try:
            children.append(os.wait()[1])
        except ChildProcessError:
            break
    assert children and all(status == 0 for status in children), (
        f"the launched processes ended with {children}"
    )
    return code


def _train_example(
    script: str, config: str, tmp_path: Path, *args: str, launcher: bool = True
) -> list[float]:
    """Run an example's LightningCLI ``fit`` with a CSV logger under ``tmp_path``; its validation
    losses in order.

    ``launcher``: as the README's command runs it (``python script fit ...``: Lightning's launcher
    starts the other process; the first is forked, see :func:`from_a_shell`); otherwise on ranks
    forked from the tests' fork server with torchrun's environment
    (:func:`tests.distributed.run_script`: the same script and arguments without a fresh
    interpreter per rank importing Lightning again)."""
    argv = [
        "fit", "--config", config, *args,
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
    ]  # fmt: skip
    if launcher:
        log = tmp_path / "launcher.err"
        (code,) = run_distributed(from_a_shell, 1, script, argv, str(log), init_group=False, timeout=300)
        assert code == 0, log.read_text(errors="replace")[-4000:]
    else:
        run_script(ROOT / script, argv, 2, ROOT)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    return [float(r["val_loss"]) for r in rows if r.get("val_loss")]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        ["--trainer.strategy.pipeline_parallel_size=2"],
        ["--trainer.strategy.pipeline_parallel_size=1", "--trainer.strategy.tensor_parallel_size=2"],
    ],
    ids=["pp2", "tp2"],
)
def test_example_gpt_learns_on_two_processes(tmp_path: Path, layout: list[str]) -> None:
    # pp=2 through Lightning's launcher, as the README's command; tp=2 on forked ranks.
    launcher = "--trainer.strategy.pipeline_parallel_size=2" in layout
    val = _train_example(
        "examples/gpt/train.py", "examples/gpt/configs/pipe_tp.yaml", tmp_path,
        "--trainer.devices=2",
        *layout,
        "--trainer.strategy.num_microbatches=4",
        "--trainer.max_steps=60",
        "--trainer.val_check_interval=30",
        "--trainer.limit_val_batches=5",
        "--model.d_model=64", "--model.n_layers=2",
        "--data.max_chars=300000", "--data.batch_size=16",
        launcher=launcher,
    )  # fmt: skip
    # Validation after 30 and 60 steps; the untrained model starts near ln(97) = 4.57.
    assert len(val) == 2 and val[0] < 3.5 and val[1] < val[0], val
    assert list(tmp_path.rglob("*.ckpt")), "ModelCheckpoint wrote nothing"


@pytest.mark.distributed
def test_example_huggingface_model_learns_on_two_processes(tmp_path: Path) -> None:
    """The Hugging Face example (CausalLMModule, no wrapper) at pp=2, then its checkpoint exported
    to a directory that transformers loads."""
    val = _train_example(
        "examples/huggingface/train.py", "examples/huggingface/configs/pipe_tp.yaml", tmp_path,
        "--trainer.max_steps=40",
        "--trainer.val_check_interval=20",
        "--trainer.limit_val_batches=4",
        "--data.max_chars=200000",
        launcher=False,
    )  # fmt: skip
    # Validation after 20 and 40 steps; the untrained model starts near ln(264) = 5.6.
    assert len(val) == 2 and val[0] < 4.0 and val[1] < val[0], val
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    out = tmp_path / "exported"
    # The command's entry point in this process (tests/test_checkpoint_format.py runs the command).
    assert consolidate_main([str(checkpoint), str(out), "--to-huggingface"]) == 0
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).model_type == "llama"
    assert list(out.glob("*.safetensors"))
