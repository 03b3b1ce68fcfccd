"""What the cost model is told: the model's measured costs per layer, the devices' memory and the
links between them, all as plain numbers.

Keeping the inputs apart from the model that uses them (:mod:`.model`) means a planner can be
tested on costs written by hand, where the right answer is known by construction, and fed on a
real machine by :mod:`.measure` (and, later, by a probe of the real process group) without either
knowing about the other.

Times and bytes are per *micro-batch of* :attr:`ModelCosts.rows` *samples*, as measured; the model
scales them to a candidate's micro-batch size: linearly, past a fixed part that does not shrink
with the rows (kernel launches, Python, the weights read once) and that the measurement estimates
from two sizes. A layer's time is not linear in the rows on every device (caches, a kernel's
choice of tiles): :attr:`LayerCost.timings` holds it measured at the micro-batch sizes the
candidates run, and the model reads a size from them (:meth:`LayerCost.seconds_at`). Nothing
here is tensor-parallel yet: the model splits a layer's work and memory by
the share of its parameters the plan splits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

GB = 1e9
"""Bytes in a gigabyte, as the planner prints memory (decimal, like device spec sheets)."""


def format_bytes(nbytes: float) -> str:
    """``"5.1 GB"``, ``"12.4 MB"``, ``"900 kB"``: three significant digits, decimal units."""
    for unit, size in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.3g} B"


@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer, measured on a micro-batch of :attr:`ModelCosts.rows` samples."""

    forward_seconds: float
    backward_seconds: float
    forward_fixed_seconds: float = 0.0
    """The part of ``forward_seconds`` that does not scale with the rows."""
    backward_fixed_seconds: float = 0.0
    activation_bytes: int = 0
    """What autograd saves for backward in the forward (parameters left out)."""
    output_bytes: int = 0
    """The layer's output: a stage boundary after it sends this, forward and (as a gradient) back."""
    saved_input_bytes: int = 0
    """Of ``activation_bytes``, the layer's input (saved by this layer too when the previous one
    saved its output: counted once in a stage)."""
    saved_output_bytes: int = 0
    """Of ``activation_bytes``, the layer's own output."""
    parameter_bytes: int = 0
    split_parameter_bytes: int = 0
    """Of ``parameter_bytes``, what the tensor-parallel plan splits over the tensor ranks."""
    tensor_forward_collectives: int = 0
    """All-reduces of the hidden states in this layer's forward under tensor parallelism (one per
    row-parallel or vocab-parallel module)."""
    tensor_backward_collectives: int = 0
    """All-reduces of the input gradient in its backward (one per column-parallel module)."""
    optimizer_seconds: float = 0.0
    """One optimizer step over the layer's parameters, whole (0: not measured). It runs after the
    pipeline's last backward, outside the schedule, on the share of the parameters a rank updates."""
    parameter_tensors: int = 0
    """How many parameter tensors the layer has (FSDP2 pays per tensor:
    :attr:`ModelCosts.sharded_step_seconds`)."""
    timings: tuple[tuple[int, float, float], ...] = ()
    """The layer also measured at other micro-batch sizes: ``(rows, forward_seconds,
    backward_seconds)`` each (the sizes the candidates run, :func:`~.measure.measurement_sizes`)."""
    split_backward_ratio: float = 1.0
    """The backward split into input and weight gradients (zero-bubble schedules) over an ordinary
    one, at the measured rows (1: not measured; the layer profiler's
    :attr:`~lightning_pipe.partition.profile.LayerTime.split_backward_ratio`)."""

    def __post_init__(self) -> None:
        for name in (
            "forward_seconds",
            "backward_seconds",
            "forward_fixed_seconds",
            "backward_fixed_seconds",
            "optimizer_seconds",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {getattr(self, name)!r}.")
        if not self.split_backward_ratio > 0:
            raise ValueError(f"split_backward_ratio must be > 0, got {self.split_backward_ratio!r}.")
        if (
            self.forward_fixed_seconds > self.forward_seconds
            or self.backward_fixed_seconds > self.backward_seconds
        ):
            raise ValueError("A fixed part of a layer's time cannot exceed the time it is part of.")
        for timing in self.timings:
            rows, forward, backward = timing
            if not (rows >= 1 and forward >= 0 and backward >= 0):
                raise ValueError(
                    "timings must be (rows >= 1, forward seconds >= 0, backward seconds >= 0), "
                    f"got {timing!r}."
                )
        sizes = [timing[0] for timing in self.timings]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"timings must give each micro-batch size once, got sizes {sorted(sizes)}.")
        object.__setattr__(self, "timings", tuple(sorted(tuple(t) for t in self.timings)))
        if not 0 <= self.split_parameter_bytes <= self.parameter_bytes:
            raise ValueError(
                f"split_parameter_bytes ({self.split_parameter_bytes}) must lie between 0 and the layer's "
                f"parameter_bytes ({self.parameter_bytes})."
            )

    def seconds_at(self, rows: float, measured_rows: int, share: float = 1.0) -> tuple[float, float]:
        """Forward and backward seconds for a micro-batch of ``rows`` samples of which this rank does
        ``share`` of the work (``measured_rows``: :attr:`ModelCosts.rows`). Between two measured
        sizes, the line through them; below the smallest, the line from the fixed part (at no rows)
        through it; beyond the largest, the fixed part and the rest in proportion to the rows, from
        the largest. Of that, the fixed part is paid whole (as many launches whatever the split)
        and the rest in proportion to ``share``. A timing at ``measured_rows`` itself is the
        measurement above, not a second point at the same size."""
        others = [timing for timing in self.timings if timing[0] != measured_rows]
        points = sorted({(measured_rows, self.forward_seconds, self.backward_seconds), *others})
        out = []
        for index, fixed in ((1, self.forward_fixed_seconds), (2, self.backward_fixed_seconds)):
            line = [(0.0, fixed)] + [(float(p[0]), float(p[index])) for p in points]
            out.append(fixed + (_through(line, rows) - fixed) * share)
        return out[0], out[1]

    @property
    def split_share(self) -> float:
        """The share of the layer's parameters (and, as the model assumes, of its compute) that
        tensor parallelism splits."""
        return self.split_parameter_bytes / self.parameter_bytes if self.parameter_bytes else 0.0


def _through(points: list[tuple[float, float]], x: float) -> float:
    """The piecewise-linear function through ``points`` (sorted by x, the first at x = 0) at ``x``;
    beyond the last point, the line from the first through the last (a noisy last segment's slope
    is not extrapolated), never falling: a last point measured under the first (noise on a layer
    that costs little more per sample than per call) holds the time there, as a larger
    micro-batch never takes less time."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[0], points[-1]
    if x1 <= x0:
        return y1
    return max(y1, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class ModelCosts:
    """The measured model: its layers in pipeline order and what training adds per parameter."""

    layers: tuple[LayerCost, ...]
    rows: int
    """Samples in the micro-batch the layers were measured on."""
    input_bytes: int = 0
    """The first layer's input for that micro-batch (the first stage holds it until backward)."""
    optimizer_state_factor: float = 2.0
    """Optimizer state bytes per parameter byte (AdamW in the parameters' dtype: 2; SGD: 0;
    SGD with momentum: 1)."""
    gradient_factor: float = 1.0
    """Gradient bytes per parameter byte (1: gradients in the parameters' dtype)."""
    sharded_step_seconds: float = 0.0
    """Per parameter tensor, what an optimizer step over DTensors (FSDP2's sharded parameters)
    takes beyond the same step over plain tensors: DTensor dispatches every operation of the step
    tensor by tensor (0: not measured; :func:`~.measure.sharded_step_overhead`). FSDP2's hooks,
    which wrap and unwrap each tensor around its gathers and reductions, are counted from it."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("A model needs at least one layer to plan.")
        if self.rows < 1:
            raise ValueError(f"rows (samples per measured micro-batch) must be >= 1, got {self.rows}.")
        object.__setattr__(self, "layers", tuple(self.layers))


@dataclass(frozen=True)
class Links:
    """How fast the processes reach each other (bytes per second, seconds)."""

    p2p_bandwidth: float = 5e9
    p2p_latency: float = 20e-6
    collective_bandwidth: float = 5e9
    """The bus bandwidth of all-reduce, reduce-scatter and all-gather (the ring's per-link rate)."""
    collective_latency: float = 20e-6
    overlap_data_parallel: bool = True
    """Whether the data axis' communication runs behind compute, as the engine arranges it (the
    reducer under the last backward, ZeRO-1's gather under the next forward, FSDP2's prefetch):
    then only what outlasts that compute is exposed. Tensor parallelism's collectives sit between
    a layer's matrix products and are always exposed."""
    reduce_scatter_bandwidth: float | None = None
    """A reduce-scatter's bus bandwidth where it was measured apart (:func:`~.links.probe_links`);
    ``None``: the all-reduce's (a ring reduce-scatter is half an all-reduce). gloo is not a ring
    there: on 4 CPU processes of this project's machine a reduce-scatter of 8 MB took 25.7 ms, as
    long as an all-reduce of the same bytes (21.9 ms), and a 4 kB one 7.7 ms (all-reduce: 8.3)."""
    reduce_scatter_latency: float | None = None
    """Per ring step (``n - 1`` of them), where measured apart; ``None``: the all-reduce's."""
    all_gather_bandwidth: float | None = None
    """An all-gather's, where measured apart (gloo, the same 4 processes: 17.8 ms for 8 MB, 6.9 ms
    for 4 kB; half an all-reduce would be 14.6 and 2.6); ``None``: the all-reduce's."""
    all_gather_latency: float | None = None
    """Per ring step, where measured apart; ``None``: the all-reduce's."""

    def __post_init__(self) -> None:
        for name in ("p2p_bandwidth", "collective_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{name} must be a positive number of bytes per second, got {getattr(self, name)!r}."
                )
        for name in ("reduce_scatter_bandwidth", "all_gather_bandwidth"):
            rate = getattr(self, name)
            if rate is not None and not rate > 0:
                raise ValueError(
                    f"{name} must be a positive number of bytes per second or None, got {rate!r}."
                )
        for name in ("p2p_latency", "collective_latency", "reduce_scatter_latency", "all_gather_latency"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}.")

    def p2p(self, nbytes: float) -> float:
        """One message between pipeline neighbours."""
        return self.p2p_latency + nbytes / self.p2p_bandwidth

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce: every rank sends and receives ``2 (n - 1) / n`` of the bytes."""
        if ranks <= 1:
            return 0.0
        return (
            2 * (ranks - 1) * self.collective_latency
            + 2 * (ranks - 1) / ranks * nbytes / self.collective_bandwidth
        )

    def _half_ring(self, nbytes: float, ranks: int, bandwidth: float | None, latency: float | None) -> float:
        """``n - 1`` steps of latency and ``(n - 1) / n`` of the bytes through each link, at the
        operation's own measured rates where given, else the all-reduce's."""
        if ranks <= 1:
            return 0.0
        latency = self.collective_latency if latency is None else latency
        bandwidth = self.collective_bandwidth if bandwidth is None else bandwidth
        return (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        """A reduce-scatter of ``nbytes`` in all: read as a ring (half an all-reduce unless its
        own rates were measured)."""
        return self._half_ring(nbytes, ranks, self.reduce_scatter_bandwidth, self.reduce_scatter_latency)

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """An all-gather of ``nbytes`` in all (see :meth:`reduce_scatter`)."""
        return self._half_ring(nbytes, ranks, self.all_gather_bandwidth, self.all_gather_latency)


@dataclass(frozen=True)
class Machine:
    """The processes a layout is chosen for."""

    world_size: int
    memory_bytes: float
    """What each process may hold (CUDA's free memory, or the user's ``max_memory``)."""
    links: Links = Links()
    compute_slots: float | None = None
    """How many of the processes can compute at full speed at once; ``None``: each has its own
    device. Processes sharing a host's CPU cores (gloo on CPU: the cores over the threads per
    process) share its compute: a rank idle in a pipeline's bubble lends its core to the others,
    and layouts keeping every rank busy run at the cores' speed, not the processes'. Below 1 when
    all the processes together compute less than one alone (caches thrashed, other jobs)."""
    collective_wait_seconds: float = 0.0
    """What each collective closing a stretch of computation (and each message between pipeline
    stages) waits, beyond its own time, for its last rank to arrive: processes on shared cores
    arrive apart, the scheduler serving some first, and one blocked is woken on a core others
    hold (:func:`~lightning_pipe.planning.cores.probe_collective_wait`). 0 where each process has
    a device of its own."""

    def __post_init__(self) -> None:
        if self.compute_slots is not None and not self.compute_slots > 0:
            raise ValueError(
                f"compute_slots must be a positive number of processes or None, got {self.compute_slots!r}."
            )
        if not self.collective_wait_seconds >= 0:
            raise ValueError(
                "collective_wait_seconds must be a number of seconds >= 0, got "
                f"{self.collective_wait_seconds!r}."
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if not self.memory_bytes > 0:
            raise ValueError(f"memory_bytes must be a positive number of bytes, got {self.memory_bytes!r}.")
