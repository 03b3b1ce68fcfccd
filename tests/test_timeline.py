"""Timelines: recorded (2 gloo ranks) and planned (simulator) runs export to Chrome trace and PNG.

The Chrome trace must be valid JSON with one track per rank and one complete event per action;
the PNG must be a PNG; a recorded timeline must be causally consistent across processes (a
micro-batch's forward on stage 1 starts after stage 0 finished it); the CLI writes both files.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_pipe.batches.microbatch import signature
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.execution.stamps import DeviceEventClock
from lightning_pipe.execution.timeline import TimelineRecorder, gather_timeline
from lightning_pipe.partition.balance import compute_balance, split_layers
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.schedule.cli import main as schedule_cli
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.timeline import SPAN, TimelineEvent, events_from_simulation, timeline_stats
from lightning_pipe.schedule.timeline_export import plot_timeline, write_chrome_trace
from tests.distributed import run_distributed
from tests.models import make_batch, tuple_net

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
M, STEPS = 4, 2


def _load_trace(path: Path) -> tuple[list[dict[str, Any]], dict[int, str]]:
    doc = json.loads(path.read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    return complete, names


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # a drawn figure, not an empty canvas


def test_planned_timeline_exports(tmp_path: Path) -> None:
    schedule = build_schedule("1f1b", 4, 8)
    result = simulate(schedule, 1.0, 2.0)
    events = events_from_simulation(result, unit=1e-3)
    assert len(events) == sum(len(a) for a in schedule.actions) == 160

    trace = write_chrome_trace(events, tmp_path / "plan.json")
    complete, names = _load_trace(trace)
    assert len(complete) == 160
    assert {e["tid"] for e in complete} == {0, 1, 2, 3}  # exactly one track per rank
    assert {e["pid"] for e in complete} == {0}
    assert names == {r: f"rank {r}" for r in range(4)}
    # Rank 3 runs F0 from 3 ms to 4 ms, then B0 for 2 ms (timestamps in microseconds).
    f0 = next(e for e in complete if e["tid"] == 3 and e["name"] == "F0")
    b0 = next(e for e in complete if e["tid"] == 3 and e["name"] == "B0")
    assert f0["ts"] == pytest.approx(3000.0) and f0["dur"] == pytest.approx(1000.0)
    assert b0["ts"] == pytest.approx(4000.0) and b0["dur"] == pytest.approx(2000.0)
    assert f0["args"] == {"rank": 3, "stage": 3, "microbatch": 0}
    assert sum(e["name"].startswith("F") for e in complete if e["tid"] == 0) == 8
    assert {e["name"] for e in complete if e["cat"] == "comm"} == {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}

    stats = plot_timeline(events, tmp_path / "plan.png", title="1f1b planned")
    _assert_png(tmp_path / "plan.png")
    assert stats.makespan == pytest.approx(0.033)
    assert stats.bubble_fraction == pytest.approx(result.bubble_fraction)


def test_recorder_spans_and_stats() -> None:
    recorder = TimelineRecorder(rank=5, t0=100.0)
    schedule = build_schedule("gpipe", 2, 1)
    forward = schedule.actions[0][0]
    recorder(forward, 100.0, 100.5)
    recorder.add_span("optimizer step", 100.5, 101.0)
    with recorder.span("sleep"):
        pass
    assert [e.name for e in recorder.events] == ["F0", "optimizer step", "sleep"]
    first, opt = recorder.events[0], recorder.events[1]
    assert (first.rank, first.kind, first.stage, first.microbatch) == (5, "F", 0, 0)
    assert (first.start, first.end) == (0.0, 0.5)
    assert opt.kind == SPAN and not opt.is_compute and not opt.is_comm
    stats = timeline_stats(recorder.events[:2])
    assert stats.makespan == pytest.approx(1.0)
    assert stats.busy == {5: 0.5}
    assert stats.bubble_fraction == pytest.approx(0.5)
    # Without a process group, gathering returns the local events.
    assert gather_timeline(recorder) == sorted(recorder.events, key=lambda e: e.start)


def test_device_clock_reads_its_events_after_the_step_in_host_seconds() -> None:
    synchronized: list[torch.device] = []
    clock = DeviceEventClock(torch.device("cpu"), HostEvent, synchronized.append)
    assert len(synchronized) == 1  # its origin: the device drained once, when it is made
    recorder = TimelineRecorder(rank=1, clock=clock)
    recorder.start()
    assert len(synchronized) == 2  # a recording's start rebases it (waits, between steps)
    forward = build_schedule("gpipe", 2, 1).actions[0][0]
    HostEvent.waited = 0
    before = time.perf_counter()
    start = recorder.stamp()
    time.sleep(0.01)
    end = recorder.stamp()
    recorder(forward, start, end)
    with recorder.span("optimizer step"):
        time.sleep(0.005)
    after = time.perf_counter()
    assert HostEvent.waited == 0 and len(synchronized) == 2  # recording waited for nothing
    events = recorder.events
    assert HostEvent.waited == 4  # reading did, once per stamp
    f0, span = events
    assert (f0.name, f0.rank, span.name, span.kind) == ("F0", 1, "optimizer step", SPAN)
    # Host seconds from the recorder's origin, in order, as long as the sleeps.
    low, high = before - recorder.t0, after - recorder.t0
    assert low - 1e-3 <= f0.start < f0.end <= span.start < span.end <= high + 1e-3
    assert f0.end - f0.start >= 0.01 - 1e-4 and span.end - span.start >= 0.005 - 1e-4
    assert recorder.events == events and HostEvent.waited == 4  # read once


def test_a_device_clock_origin_is_not_taken_while_the_process_was_descheduled() -> None:
    """The origin's event and the host reading it stands for are taken together: a process
    descheduled between them (here, the first event's record comes 20 ms late) would put every
    time of the recording off by as much, as a whole-suite run saw (1.85 ms on a loaded machine)."""

    class LateOnce(HostEvent):
        late: ClassVar[list[float]] = [0.02]

        def record(self, stream: Any = None) -> None:
            if self.late:
                time.sleep(self.late.pop())
            super().record(stream)

    clock = DeviceEventClock(torch.device("cpu"), LateOnce, lambda device: None)
    before = time.perf_counter()
    stamp = clock.stamp()
    after = time.perf_counter()
    assert 0.0 <= clock.origin_error < 1e-3
    # The stamp's time is the host's when it was taken, to within the origin's error.
    assert before - clock.origin_error <= clock.seconds(stamp) <= after + clock.origin_error
    recorder = TimelineRecorder(rank=0, clock=clock)
    recorder.start()  # without a process group: the clock's error alone
    assert recorder.origin_error == clock.origin_error


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"lightning-pipe\[plot\]"):
        plot_timeline([TimelineEvent(0, "F0", "F", 0.0, 1.0, 0, 0)], tmp_path / "x.png")


def recorded_worker(kinds: list[str]) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    layers = list(tuple_net(seed=0))
    stage = split_layers(layers, compute_balance(layers, p, "uniform"))[rank]
    params = [q for layer in stage for q in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    executor = PipelineExecutor({rank: stage}, p, list(range(p)), torch.device("cpu"))
    out = {}
    for kind in kinds:
        kind, _, clock = kind.partition("@")
        recorder = TimelineRecorder()
        if clock == "events":  # a device clock's code path, with host-timed events
            clock_ = DeviceEventClock(torch.device("cpu"), HostEvent, lambda _: None)
            recorder = TimelineRecorder(clock=clock_)
        schedule = build_schedule(kind, p, M)
        recorder.start()
        HostEvent.waited = 0
        for step in range(STEPS):
            mbs = [make_batch(3, 5, seed=10 * step + i) for i in range(M)]
            opt.zero_grad()
            executor.run(
                schedule,
                rank,
                inputs=[x for x, _ in mbs],
                head=lambda out, i, mbs=mbs: F.mse_loss(out, mbs[i][1]),
                signatures=[signature(x) for x, _ in mbs],
                recorder=recorder,
            )
            with recorder.span("optimizer step"):
                opt.step()
        name = f"{kind}@{clock}" if clock else kind
        out[f"{name} waited in steps"] = HostEvent.waited if rank == 0 else []
        out[name] = gather_timeline(recorder)
        out[f"{name} waited to read"] = HostEvent.waited if rank == 0 else []
        errors = [0.0, 0.0]
        dist.all_gather_object(errors, recorder.origin_error)
        out[f"{name} origin error"] = errors if rank == 0 else []
    return out


class HostEvent:
    """A CUDA event's interface (``record``, ``synchronize``, ``elapsed_time`` in milliseconds)
    timed by the host's clock, which on a CPU is when the work is done: the device clock's code path
    (stamps in the step, read afterwards) runs here as it will on a GPU."""

    waited = 0
    """How many times an event was waited for."""

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        HostEvent.waited += 1

    def elapsed_time(self, other: HostEvent) -> float:
        return (other.time - self.time) * 1e3


KINDS = ["1f1b", "gpipe", "1f1b@events"]


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    results = run_distributed(recorded_worker, 2, KINDS, timeout=60)
    assert results[1] == {k: [] for k in results[0]}  # gathered on rank 0 only
    return results[0]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_recorded_timeline_two_ranks(recorded: dict[str, Any], kind: str, tmp_path: Path) -> None:
    events = recorded[kind]
    schedule = build_schedule(kind.partition("@")[0], 2, M)
    # Nothing waited for the device while the steps ran; with events, reading the timeline did.
    assert recorded[f"{kind} waited in steps"] == 0
    if kind.endswith("@events"):
        assert recorded[f"{kind} waited to read"] > 0
    for rank in range(2):
        mine = [e for e in events if e.rank == rank]
        assert len(mine) == STEPS * (len(schedule.actions[rank]) + 1)
        assert sum(e.kind == SPAN for e in mine) == STEPS
        assert sum(e.is_compute for e in mine) == STEPS * 2 * M
        assert all(e.end >= e.start for e in mine)
        # One rank's actions do not overlap (a comm batch shares one span).
        spans = sorted({(e.start, e.end) for e in mine})
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(spans))

    def compute(rank: int, name: str) -> list[TimelineEvent]:
        return [e for e in events if e.rank == rank and e.name == name]

    # Causality across processes (the clocks share one origin): forward flows 0 -> 1 and
    # backward 1 -> 0 in every step, up to the origins' estimation error (its bound: half the best
    # round trip, which a loaded machine stretches to milliseconds) and 100 us.
    slack = sum(recorded[f"{kind} origin error"]) + 1e-4
    for i in range(M):
        for f0, f1 in zip(compute(0, f"F{i}"), compute(1, f"F{i}"), strict=True):
            assert f1.start >= f0.end - slack
        for b1, b0 in zip(compute(1, f"B{i}"), compute(0, f"B{i}"), strict=True):
            assert b0.start >= b1.end - slack

    complete, names = _load_trace(write_chrome_trace(events, tmp_path / "run.json"))
    assert len(complete) == len(events)
    assert {e["tid"] for e in complete} == {0, 1} and set(names) == {0, 1}
    assert sum(e["name"] == "optimizer step" for e in complete) == 2 * STEPS

    stats = plot_timeline(events, tmp_path / "run.png", title=f"{kind} recorded")
    _assert_png(tmp_path / "run.png")
    assert 0.0 < stats.bubble_fraction < 1.0
    assert set(stats.busy) == {0, 1}


def test_cli_writes_png_and_trace(tmp_path: Path) -> None:
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    cmd = [
        sys.executable,
        "-m",
        "lightning_pipe.schedule",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--forward-time",
        "1",
        "--backward-time",
        "2",
        "--png",
        str(png),
        "--trace",
        str(trace),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("1f1b: 4 stages, 8 micro-batches, bubble 27.3%")
    assert "rank 3 | .  .  .  F0 B0 B0 F1 B1 B1" in out
    assert "makespan   33 ms" in out
    assert "stage 0: 4  stage 1: 3  stage 2: 2  stage 3: 1" in out
    complete, names = _load_trace(trace)
    assert len(complete) == 160 and set(names) == {0, 1, 2, 3}
    _assert_png(png)


def test_cli_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        schedule_cli(["--stages", "0"])
    assert exit_info.value.code == 2
    assert "num_stages must be an integer >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------------- from Trainer(strategy=...)
def fit_timeline_worker(path: str, max_steps: int, timeline_steps: int) -> list[str]:
    import tempfile
    import warnings
    from datetime import timedelta

    from lightning_pipe import PipeTPStrategy
    from tests.lightning_models import Regressor, dataset, loader
    from tests.trainers import fit

    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, num_microbatches=M, timeline=path, timeline_steps=timeline_steps,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory() as root:
        warnings.simplefilter("always")
        data = loader(dataset(64, seed=1), 8, reference=False)
        fit(Regressor(), strategy, 2, data, root, max_steps=max_steps)
    return [str(w.message) for w in caught if "timeline" in str(w.message)]


def _ts(event: dict[str, Any]) -> float:
    return float(event["ts"])


@pytest.mark.distributed
def test_fit_records_the_requested_steps_after_step_zero(tmp_path: Path) -> None:
    trace = tmp_path / "run.json"
    run_distributed(fit_timeline_worker, 2, str(trace), 6, 2, init_group=False, timeout=120)
    complete, names = _load_trace(trace)
    assert set(names) == {0, 1}
    for rank in (0, 1):
        computes = sorted((e for e in complete if e["tid"] == rank and e["cat"] == "compute"), key=_ts)
        assert len(computes) == 2 * 2 * M  # two steps of M forwards and M backwards
        steps = sorted((e for e in complete if e["tid"] == rank and e["name"] == "optimizer step"), key=_ts)
        assert len(steps) == 2
        # Each step's optimizer step follows that step's computations and precedes the next's.
        first, second = computes[: 2 * M], computes[2 * M :]
        assert _ts(first[-1]) < _ts(steps[0]) < _ts(second[0]) < _ts(second[-1]) < _ts(steps[1])


@pytest.mark.distributed
def test_one_step_by_default_and_step_zero_when_nothing_else_ran(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    run_distributed(fit_timeline_worker, 2, str(one), 5, 1, init_group=False, timeout=120)
    complete, _ = _load_trace(one)
    assert sum(e["cat"] == "compute" for e in complete) == 2 * 2 * M  # one step on each of 2 ranks
    only = tmp_path / "only.png"
    run_distributed(fit_timeline_worker, 2, str(only), 1, 1, init_group=False, timeout=120)
    _assert_png(only)  # step 0, the only one, drawn rather than nothing
    none = tmp_path / "none.png"
    warned = run_distributed(fit_timeline_worker, 2, str(none), 0, 1, init_group=False, timeout=120)
    assert not none.exists()
    assert any("no training step ran in this fit, so there is no timeline to write" in w for w in warned[0])


def test_plot_labels_rows_and_notes(tmp_path: Path) -> None:
    events = events_from_simulation(simulate(build_schedule("zb_h1", 2, 4), 1.0, 2.0), unit=1e-3)
    labels = {0: "rank 0\npp 0 · tp 0\nstage 0", 1: "rank 1\npp 1 · tp 0\nstage 1"}
    stats = plot_timeline(events, tmp_path / "z.png", title="t", row_labels=labels, note="a note")
    _assert_png(tmp_path / "z.png")
    assert 0.0 < stats.bubble_fraction < 1.0
