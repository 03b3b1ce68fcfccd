"""Choose a layout: every candidate predicted, the fastest that fits memory first.

Ties are predictions within :data:`TIE` (half a percent) of the fastest still unranked: closer
than any measurement here resolves (on a shared CPU, runs of one layout differ by more). They are
common where the processes share a host's cores: the step is then near all their work over the
cores, nearly the same for many layouts. Within such a group the order is, by

1. the shorter wait for shared cores (:attr:`~.cost_model.Prediction.shared_compute_seconds`; zero
   for every candidate on devices of their own, where the next key decides): fewer processes
   computing at once. ``benchmarks/auto_layout.py`` (4 gloo processes, 2 cores) met two ties in
   which one candidate waited for the cores and the other ran more of its step in the bubble, and
   the second measured faster both times: pp=2 x dp=2 under GPipe at two micro-batches against
   1F1B at one, predicted 234.4 and 234.3 ms, measured 275 and 236 ms (the example GPT), predicted
   200 ms each, measured 363 and 290 ms (a Llama). Candidates 1 - 3% apart leaned the same way (at
   one micro-batch against two: 209 and 206 ms predicted, 233 and 288 ms measured; interleaved
   schedules against 1F1B, two runs: predicted 1.01 - 1.02x its step, measured 1.03 - 1.20x);
2. the shorter schedule on devices of their own (:attr:`~.cost_model.Prediction.schedule_seconds`:
   the makespan with its bubble and message waits, the exposed communication and the optimizer
   step): on accelerators, the smaller bubble;
3. less data moved between replicas (communication hidden behind compute on paper still contends
   for the links and the memory bus);
4. less peak memory per rank (more room for the allocator's slack, which the model does not count);
5. fewer processes in each collective (tensor x data ranks: fewer to wait for, fewer to straggle);
6. the simpler layout (fewer pipeline stages, fewer tensor ranks, fewer micro-batches, no
   recomputation): a difference the cost model cannot see is not worth a more complex run.

then the step itself, then the candidate's name (two schedules with the same numbers). So the
order is total and the same on every rank and every run with the same measurements.

When nothing fits, :attr:`Plan.refusal` is one sentence with the least any candidate needs, that
candidate, and the limit, so that the user knows how far off the model is and what came closest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.planning.candidates import Constraints, ModelShape, enumerate_candidates
from lightning_pipe.planning.cost_model import Prediction, predict
from lightning_pipe.planning.costs import Machine, ModelCosts, format_bytes


class NothingFitsError(ValueError):
    """No candidate fits the memory each process has; the message is :attr:`Plan.refusal`."""


TIE = 0.005
"""Predicted steps closer than this share of the faster are a tie, decided by the other keys."""


def _rounded(seconds: float) -> float:
    """A part in a million: beyond what any measurement resolves (sums in another order tie)."""
    return float(f"{seconds:.6g}")


def schedule(p: Prediction) -> float:
    """The schedule on devices of their own as the tie-break compares it (to a part in a million)."""
    return _rounded(p.schedule_seconds)


def shared(p: Prediction) -> float:
    """The wait for shared cores as the tie-break compares it (to a part in a million)."""
    return _rounded(p.shared_compute_seconds)


def traffic(p: Prediction) -> float:
    """The data-parallel traffic as the tie-break compares it: to a tenth of a microsecond (free
    links' traffic, 1e-27 s against 2e-27 s, is none in both)."""
    return round(p.data_traffic_seconds, 7)


def _tie_key(p: Prediction) -> tuple[float, float, float, float, int, int, int, int, int, float, str]:
    """The order within a tie (the module docstring's)."""
    c = p.candidate
    return (
        shared(p),
        schedule(p),
        traffic(p),
        p.peak_bytes,
        p.communicating_processes,
        c.pipeline_parallel_size * c.virtual_stages,
        c.tensor_parallel_size,
        c.num_microbatches,
        int(c.recompute is not RecomputeMode.NEVER),
        p.step_seconds,
        str(c),
    )


def _in_order(predictions: Iterable[Prediction]) -> list[Prediction]:
    """Fastest first, each group of ties (within :data:`TIE` of the fastest left) by :func:`_tie_key`."""
    rest = sorted(predictions, key=lambda p: p.step_seconds)
    out: list[Prediction] = []
    while rest:
        bound = rest[0].step_seconds * (1 + TIE)
        # Sorted by the exact step, the group is a prefix: every prediction lands exactly once.
        size = sum(1 for p in rest if p.step_seconds <= bound)
        out += sorted(rest[:size], key=_tie_key)
        rest = rest[size:]
    return out


@dataclass(frozen=True)
class Plan:
    """Every candidate's prediction: those that fit, fastest first, then the others, smallest
    peak first."""

    predictions: tuple[Prediction, ...]
    memory_bytes: float
    batch: int

    @property
    def fitting(self) -> tuple[Prediction, ...]:
        return tuple(p for p in self.predictions if p.fits)

    @property
    def best(self) -> Prediction | None:
        """The fastest candidate that fits; ``None`` when none does."""
        fitting = self.fitting
        return fitting[0] if fitting else None

    @property
    def refusal(self) -> str | None:
        """``None`` when a candidate fits; otherwise the sentence saying why none does."""
        if self.best is not None:
            return None
        least = min(self.predictions, key=lambda p: p.peak_bytes)
        return (
            f"needs {format_bytes(least.peak_bytes)} per rank at best ({least.candidate}), "
            f"the limit is {format_bytes(self.memory_bytes)}"
        )

    def chosen(self) -> Prediction:
        """:attr:`best`, or :class:`NothingFitsError` with :attr:`refusal`."""
        best = self.best
        if best is None:
            raise NothingFitsError(
                f"No layout fits: the model {self.refusal}. Give each process more memory, or add "
                "processes (more pipeline stages or data ranks to shard over)."
            )
        return best


def plan_layout(
    costs: ModelCosts,
    machine: Machine,
    shape: ModelShape,
    batch: int,
    constraints: Constraints | None = None,
) -> Plan:
    """Predict every candidate for ``machine`` and a global batch of ``batch`` samples."""
    if shape.num_layers != len(costs.layers):
        raise ValueError(
            f"The shape has {shape.num_layers} layers but {len(costs.layers)} were measured: they must "
            "describe the same pipeline."
        )
    candidates = enumerate_candidates(machine.world_size, shape, batch, constraints or Constraints())
    predictions = [predict(c, costs, machine, batch) for c in candidates]
    return ranked(predictions, machine.memory_bytes, batch)


def ranked(predictions: Iterable[Prediction], memory_bytes: float, batch: int) -> Plan:
    """A :class:`Plan` of ``predictions``: those that fit fastest first (ties broken as the module
    docstring says), then the others, smallest peak first."""
    predictions = list(predictions)
    fitting = _in_order(p for p in predictions if p.fits)
    others = sorted(
        (p for p in predictions if not p.fits),
        key=lambda p: (p.peak_bytes, _rounded(p.step_seconds), _tie_key(p)),
    )
    return Plan(tuple(fitting + others), memory_bytes, batch)
