"""pipe_tp's edge cases: one process (pp=1) equals one device, bad configurations fail at setup
with messages that name the fix, and the bf16 precisions train."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

TRAIN, VAL = dataset(40, seed=1), dataset(16, seed=2)


def _fit(
    model: L.LightningModule,
    strategy: Any,
    devices: int,
    reference: bool = False,
    max_epochs: int = 1,
    **kw: Any,
) -> L.Trainer:
    """Train and validate on the same data under pipe_tp and on one device."""
    train, val = loader(TRAIN, 8, reference), loader(VAL, 8, reference)
    return fit(model, strategy, devices, train, val=val, max_epochs=max_epochs, **kw)


class FusedAdam(Regressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01, fused=True)


class ManualOpt(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NoPipeline(Regressor):
    configure_pipeline = None  # type: ignore[assignment]


class TwoCalls(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean() + self(x).sum() * 0


class StrayParameter(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.ones(()))


def _error(model: L.LightningModule, strategy: Any, **kw: Any) -> str:
    try:
        _fit(model, strategy, 1, **kw)
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def single_process_worker() -> dict[str, Any]:
    def strategy(**kw: Any) -> PipeTPStrategy:
        return PipeTPStrategy(timeout=timedelta(seconds=30), **kw)

    model = Regressor()
    trainer = _fit(model, strategy(num_microbatches=3), 1, max_epochs=2)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "manual": _error(ManualOpt(), strategy()),
        "no_pipeline": _error(NoPipeline(), strategy()),
        "two_calls": _error(TwoCalls(), strategy()),
        "stray": _error(StrayParameter(), strategy()),
        "too_many_stages": _error(Regressor(), strategy(pipeline_parallel_size=2)),
        "fused_fp16": _error(
            FusedAdam(), strategy(), plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
        ),
    }


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_distributed(single_process_worker, 1, timeout=300, init_group=False)[0]


@pytest.mark.distributed
def test_one_process_equals_one_device(single: dict[str, Any]) -> None:
    model = Regressor()
    trainer = _fit(model, "auto", 1, reference=True, max_epochs=2)
    for name, param in model.named_parameters():
        torch.testing.assert_close(single["params"][name], param.detach(), atol=1e-5, rtol=0)
    ref = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert single["metrics"].keys() == ref.keys()
    for key, value in ref.items():
        assert single["metrics"][key] == pytest.approx(value, abs=1e-5), key


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("manual", r"MisconfigurationException: ManualOpt uses manual optimization.*Use automatic"),
        ("no_pipeline", r"NoPipeline has no configure_pipeline\(\).*return list\(self.layers\)"),
        ("two_calls", r"TwoCalls.training_step called self\(\.\.\.\) 2 times.*exactly once"),
        ("stray", r"\['temperature'\] belong to no layer returned by configure_pipeline\(\)"),
        ("fused_fp16", r"fused optimizer\(s\) \['Adam'\] bypass .*without fused=True"),
        (
            "too_many_stages",
            r"pipeline_parallel_size \(2\) x tensor_parallel_size \(1\) = 2 does not divide the world size 1",
        ),
    ],
)
def test_setup_errors_name_the_fix(single: dict[str, Any], case: str, pattern: str) -> None:
    assert re.search(pattern, single[case], re.S), single[case]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"schedule": "zigzag"}, r"Unknown pipeline schedule 'zigzag': expected one of 'gpipe', '1f1b'"),
        ({"partition": "balanced"}, r"Unknown partition 'balanced': expected one of 'uniform', 'parameters'"),
        ({"recompute": "sometimes"}, r"Unknown recompute mode 'sometimes': expected one of 'never'"),
        ({"num_microbatches": 0}, r"^num_microbatches must be an integer >= 1 or None \(2 x pipeline_"),
        (
            {"pipeline_parallel_size": 0},
            r"^pipeline_parallel_size must be an integer >= 1 or 'auto', got 0\.$",
        ),
        (
            {"pipeline_parallel_size": -2},
            r"^pipeline_parallel_size must be an integer >= 1 or 'auto', got -2\.$",
        ),
        ({"tensor_parallel_size": -1}, r"^tensor_parallel_size must be an integer >= 1, got -1\.$"),
        ({"data_parallel_size": 0}, r"^data_parallel_size must be an integer >= 1 or 'auto', got 0\.$"),
        ({"virtual_stages": 0}, r"^virtual_stages must be an integer >= 1 or None, got 0\.$"),
        (
            {"virtual_stages": 2},
            r"^virtual_stages=2 \(several stages per pipeline rank\) needs schedule='interleaved_1f1b', the "
            r"only schedule with several; got schedule='1f1b'\.$",
        ),
        ({"partition": [2, "x"]}, r"^partition=\[2, 'x'\]: a partition list holds each stage's number of"),
        ({"partition": [5, 0]}, r"^partition=\[5, 0\]: .* every one an integer >= 1"),
        (
            {"bucket_cap_mb": 0},
            r"^bucket_cap_mb must be a number > 0 \(megabytes per gradient bucket\), got 0",
        ),
        ({"shard_optimizer_state": "yes"}, r"^shard_optimizer_state must be True or False, got 'yes'\.$"),
        ({"overlap_param_gather": 1}, r"^overlap_param_gather must be True or False, got 1\.$"),
        (
            {"start_method": "thread"},
            r"^start_method must be one of \['popen', 'spawn', 'fork', 'forkserver'\]",
        ),
        ({"tensor_parallel_plan": ["colwise"]}, r"^tensor_parallel_plan must map module-name patterns"),
        (
            {"timeout": timedelta(0)},
            r"^timeout must be a positive datetime\.timedelta or a positive number of seconds, got "
            r"datetime\.timedelta\(0\); e\.g\. PipeTPStrategy\(timeout=600\)",
        ),
        (
            {"timeout": -5},
            r"^timeout must be a positive .* got -5; e\.g\.",
        ),
        ({"timeout": "soon"}, r"^timeout must be a positive .* got 'soon'"),
        (
            {"shard_parameters": True, "data_parallel_size": 4, "data_parallel_replicate_size": 3},
            r"^data_parallel_replicate_size=3 does not divide data_parallel_size=4: HSDP splits the 4 "
            r"data-parallel ranks into replicas of equal shard groups\. Use one of \[1, 2, 4\]\.$",
        ),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PipeTPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "devices", "pattern"),
    [
        (
            {"pipeline_parallel_size": 3},
            2,
            r"^pipe_tp cannot lay out 2 processes \(2 devices x 1 nodes\): pipeline_parallel_size \(3\) x "
            r"tensor_parallel_size \(1\) = 3 does not divide the world size 2",
        ),
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            3,
            r"^pipe_tp cannot lay out 3 processes .* data_parallel_size \(2\) x tensor_parallel_size \(2\) "
            r"does not divide",
        ),
        (
            {"pipeline_parallel_size": 2, "partition": [3, 2, 1]},
            2,
            r"^partition=\[3, 2, 1\] gives 3 stages their layer counts, but the pipeline has 2 stages",
        ),
        (
            {"shard_parameters": True, "pipeline_parallel_size": 1, "data_parallel_replicate_size": 3},
            4,
            r"^pipe_tp cannot lay out 4 processes \(4 devices x 1 nodes\) as dp=4 x pp=1 x tp=1: "
            r"data_parallel_replicate_size=3 does not divide data_parallel_size=4: .* Use one of \[1, 2, 4\]",
        ),
    ],
    ids=["pp3-on-2", "dp2xtp2-on-3", "partition-length", "hsdp-replicas-on-4"],
)
def test_a_layout_that_cannot_fit_the_devices_is_refused_before_launch(
    kwargs: dict[str, Any], devices: int, pattern: str
) -> None:
    """Refused when the Trainer is built, in this (the launching) process: nothing is launched."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=pattern):
        L.Trainer(strategy=PipeTPStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


def test_a_tensor_group_across_nodes_is_refused_before_launch() -> None:
    """tp=4 on 2 nodes of 2 devices: each tensor group would span both nodes (the layout rule: tensor
    groups inside a node); tp=2 there fits."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    nodes = {"accelerator": "cpu", "devices": 2, "num_nodes": 2, "logger": False}
    with pytest.raises(MisconfigurationException) as info:
        L.Trainer(strategy=PipeTPStrategy(pipeline_parallel_size=1, tensor_parallel_size=4), **nodes)
    assert str(info.value).startswith(
        "pipe_tp cannot lay out 4 processes (2 devices x 2 nodes) as dp=1 x pp=1 x tp=4: "
        "tensor_parallel_size=4 does not divide the 2 processes (devices) per node on 2 nodes"
    ), info.value
    L.Trainer(strategy=PipeTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), **nodes)


@pytest.mark.parametrize(
    ("arg", "option"),
    [
        ("pipeline_parallel_size=-1", "pipeline_parallel_size"),
        ("data_parallel_size=-2", "data_parallel_size"),
        ("tensor_parallel_size=0", "tensor_parallel_size"),
        ("num_microbatches=0", "num_microbatches"),
        ("virtual_stages=0", "virtual_stages"),
        ("bucket_cap_mb=-1", "bucket_cap_mb"),
        ("timeout=0", "timeout"),
        ("timeline_steps=0", "timeline_steps"),
        ("data_parallel_replicate_size=0", "data_parallel_replicate_size"),
    ],
)
def test_lightning_cli_refuses_a_bad_size_while_parsing(
    capsys: pytest.CaptureFixture[str], arg: str, option: str
) -> None:
    """The parser itself refuses the value (exit 2, its usage and one ``error:`` naming the option),
    before the strategy is built: no traceback, no dump of every option."""
    from lightning.pytorch.cli import LightningCLI

    args = ["--trainer.accelerator=cpu", "--trainer.strategy=lightning_pipe.PipeTPStrategy"]
    with pytest.raises(SystemExit) as exit_:
        LightningCLI(Regressor, run=False, args=[*args, f"--trainer.strategy.{arg}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    assert f'Parser key "{option}"' in err and "restriction v>0" in err, err
    assert "Traceback" not in err and "init_args=Namespace" not in err, err


def test_a_bad_value_the_parser_cannot_judge_is_the_constructors_one_sentence() -> None:
    """A combination the types cannot see (virtual stages without the interleaved schedule) is
    still the constructor's one sentence among LightningCLI's own."""
    from lightning.pytorch.cli import LightningCLI

    args = [
        "--trainer.strategy=lightning_pipe.PipeTPStrategy",
        "--trainer.strategy.virtual_stages=2",
    ]
    with pytest.raises(ValueError) as err:
        LightningCLI(Regressor, run=False, args=["--trainer.accelerator=cpu", *args])
    assert "- virtual_stages=2 (several stages per pipeline rank) needs schedule='interleaved_1f1b'" in str(
        err.value
    ), err.value


def test_timeout_in_seconds_is_accepted() -> None:
    assert PipeTPStrategy(timeout=30)._timeout == timedelta(seconds=30)
    assert PipeTPStrategy(timeout=2.5)._timeout == timedelta(seconds=2.5)


def bf16_worker(precision: str) -> dict[str, Any]:
    model = Regressor()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    trainer = _fit(model, strategy, 2, precision=precision, max_epochs=2)
    return {
        "params": {
            n: p.detach().float().clone()
            for n, p in model.named_parameters()
            if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank
        },
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
    }


# On one device, splitting each batch of 8 into two micro-batches of 4 (the only numerical change
# pipe_tp makes) moves the final weights by at most ~1.6e-4 under bf16-mixed and ~2e-3 under
# bf16-true (bf16 keeps ~3 significant digits and the matmul shapes change). The tolerances are a
# few times that, far below the effect of a 15% learning-rate error or of a skipped step.
BF16_TOL = {"bf16-mixed": 5e-4, "bf16-true": 5e-3}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_like_one_device(precision: str) -> None:
    got = run_distributed(bf16_worker, 2, precision, timeout=300, init_group=False)
    model = Regressor()
    trainer = _fit(model, "auto", 1, reference=True, precision=precision, max_epochs=2)
    tol = BF16_TOL[precision]
    merged = {n: p for r in got for n, p in r["params"].items()}
    assert merged.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(merged[name], param.detach().float(), atol=tol, rtol=0, msg=name)
    assert got[0]["metrics"] == got[1]["metrics"]
    assert got[0]["global_step"] == got[1]["global_step"] == trainer.global_step == 10
    reference = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert got[0]["metrics"].keys() == reference.keys()
    for key, value in reference.items():
        assert got[0]["metrics"][key] == pytest.approx(value, abs=tol), key
