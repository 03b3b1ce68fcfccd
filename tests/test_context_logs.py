"""Logged values made the whole sequences' over a context group (``strategy/context_logs.py``),
in one process: the group's all-reduce is played by adding a peer rank's tensor, captured from
the same function on the peer's records (the launch in ``tests/test_context_parallel_axis.py``
checks it against one device under Lightning)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.strategy import context_logs
from lightning_pipe.strategy.context_logs import whole_over_context
from lightning_pipe.strategy.log_capture import LoggedValue

CPU = torch.device("cpu")


def _records(*named: tuple[str, float]) -> list[LoggedValue]:
    # a batch of 4 samples: the weights of the micro-batches add up to 4
    return [
        LoggedValue("training_step", name, {}, None, torch.tensor(value * 4.0, dtype=torch.float64), 4.0)
        for name, value in named
    ]


def _peer_tensor(monkeypatch: pytest.MonkeyPatch, records: list[LoggedValue], items: float) -> torch.Tensor:
    captured: list[torch.Tensor] = []

    def capture(t: torch.Tensor, group: Any = None) -> None:  # and a twin of the peer as the other rank
        captured.append(t.clone())
        t += captured[-1]

    monkeypatch.setattr(context_logs.dist, "all_reduce", capture)
    whole_over_context(records, items, 4, None, 2, CPU)  # type: ignore[arg-type]
    return captured[0]


def _with_peer(monkeypatch: pytest.MonkeyPatch, peer: torch.Tensor) -> None:
    def add(t: torch.Tensor, group: Any = None) -> None:
        t += peer

    monkeypatch.setattr(context_logs.dist, "all_reduce", add)


def test_each_value_is_weighted_by_the_ranks_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = _peer_tensor(monkeypatch, _records(("loss", 2.0), ("acc", 0.5)), items=30.0)
    _with_peer(monkeypatch, peer)
    mine = _records(("loss", 1.0), ("acc", 0.25))
    whole_over_context(mine, 10.0, 4, None, 2, CPU)  # type: ignore[arg-type]
    assert float(mine[0].value) == pytest.approx((1.0 * 10 + 2.0 * 30) / 40, abs=1e-12)
    assert float(mine[1].value) == pytest.approx((0.25 * 10 + 0.5 * 30) / 40, abs=1e-12)
    assert mine[0].weight == 4.0  # epoch averages still count the batch's samples


def test_no_tokens_on_any_rank_gives_the_plain_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_peer(monkeypatch, _peer_tensor(monkeypatch, _records(("loss", 2.0)), items=0.0))
    mine = _records(("loss", 1.0))
    whole_over_context(mine, 0.0, 4, None, 2, CPU)  # type: ignore[arg-type]
    assert float(mine[0].value) == pytest.approx(1.5)


@pytest.mark.parametrize("peer_names", [("loss", "acc"), ("acc",), ("loss", "acc", "extra"), ()])
def test_ranks_logging_different_keys_are_refused(
    monkeypatch: pytest.MonkeyPatch, peer_names: tuple[str, ...]
) -> None:
    _with_peer(monkeypatch, _peer_tensor(monkeypatch, _records(*((n, 1.0) for n in peer_names)), items=5.0))
    with pytest.raises(MisconfigurationException, match="logged different keys in this batch"):
        whole_over_context(_records(("acc", 1.0), ("loss", 1.0)), 5.0, 4, None, 2, CPU)  # type: ignore[arg-type]


def test_a_rank_that_logged_nothing_still_meets_its_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_peer(monkeypatch, _peer_tensor(monkeypatch, _records(("loss", 1.0)), items=5.0))
    with pytest.raises(MisconfigurationException, match="logged different keys in this batch"):
        whole_over_context([], 5.0, 4, None, 2, CPU)  # type: ignore[arg-type]


def test_a_logged_metric_and_a_batch_without_tokens_are_warned_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(context_logs, "_warned", set())
    monkeypatch.setattr(context_logs.dist, "all_reduce", lambda t, group=None: t.add_(t.clone()))
    metric = LoggedValue("validation_step", "val_acc", {}, "accuracy", 0.0, 0.0)
    with pytest.warns(UserWarning, match=r"Metric\(s\) \['accuracy'\] are updated with each rank's part"):
        whole_over_context([metric], 5.0, 4, None, 2, CPU)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="counts no loss items"):
        whole_over_context(_records(("loss", 1.0)), None, 4, None, 2, CPU)  # type: ignore[arg-type]
    assert context_logs._warned == {"metric", "items"}


def test_unread_on_cuda_different_keys_give_nan_not_a_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the verdict is not read (it would stall the step): the values become NaN."""
    _with_peer(monkeypatch, _peer_tensor(monkeypatch, _records(("acc", 2.0), ("loss", 3.0)), items=5.0))
    mine = _records(("loss", 1.0), ("acc", 1.0))
    whole_over_context(mine, 5.0, 4, None, 2, CPU, read_verdict=False)  # type: ignore[arg-type]
    assert all(torch.isnan(torch.as_tensor(r.value)) for r in mine)
