"""Predict one candidate's step time and peak memory per rank from measured costs.

The step time is what the engine would do, played on paper:

* the layers are split into ``pp x v`` stages as ``partition="time"`` splits them
  (:func:`~lightning_pipe.partition.balance.balance_by_time`), each stage's forward and backward
  per micro-batch being its layers' times at the candidate's micro-batch size (measured at that
  size where the measurement had it: :meth:`~.costs.LayerCost.seconds_at`), divided by the
  tensor size where the plan splits the work, plus the tensor-parallel all-reduces (exposed:
  they sit between a layer's matrix products) and, with recomputation, a second forward in
  backward (:mod:`.stage_costs`);
* the project's own simulator (:func:`~lightning_pipe.schedule.simulate`) plays the schedule with
  those times and the point-to-point message time between stages: its makespan holds the compute,
  the bubble and the waits for messages; each rank's actions, played in order, give its
  activation memory (:func:`~lightning_pipe.schedule.simulate.held_peak`);
* processes sharing compute (:attr:`~.costs.Machine.compute_slots`: 4 gloo processes on 2 CPU
  cores) cannot together compute faster than the slots allow: the step lasts at least all the
  processes' work divided by the slots. A pipeline rank idle in the bubble lends its core to the
  busy ones, so the bubble costs less there than on devices of its own (measured on this
  project's 2-core machine: pp=4 at 0.90-0.96 of DDP's throughput where the bubble alone predicts
  0.71); but its ranks are idle in the warm-up and cool-down, when few others compute and a core
  may go unused, and all compute at once in the steady state. So the schedule is played again
  with each computation slowed by the processes computing during it
  (:func:`~lightning_pipe.schedule.shared_cores.simulate_shared`): never shorter than the plain
  makespan, usually longer than all the work over the slots; the step takes the larger of the
  two. Tensor-parallel all-reduces keep their probed time there: the links' probe timed them with
  every process on the cores already, so sharing the cores does not slow them again;
* every collective that closes a stretch of computation (tensor parallelism's all-reduces, the
  data axis' reductions and gathers, FSDP2's per layer), and every message between stages, also
  waits for its last rank to arrive: processes sharing cores arrive apart, and one blocked is
  woken on a core others hold (:attr:`~.costs.Machine.collective_wait_seconds`, probed by
  :func:`~lightning_pipe.planning.cores.probe_collective_wait`; 0 with a device each);
* the data axis' communication for the mode (replicated: all-reduce; ZeRO-1: reduce-scatter and
  all-gather; FSDP2: all-gather and reduce-scatter, per micro-batch when resharding) is added where
  it outlasts the compute the engine overlaps it with.

The optimizer step (when measured) follows the schedule: each rank steps the parameters it updates.
Under FSDP2 those are DTensors, and DTensor dispatches each operation of the step tensor by
tensor: the step costs :attr:`~.costs.ModelCosts.sharded_step_seconds` more per parameter tensor
the rank holds (measured on one process), and FSDP2's hooks, which wrap and unwrap every tensor of
a layer around its gathers and reductions, a share of that per tensor and collective
(:data:`FSDP_GATHER_SHARE`, :data:`FSDP_REDUCE_SHARE`), counted with the data axis' communication.

Each step also pays the runtime's own small collectives, latency alone (:func:`step_collectives`,
at the probed links' latency: on gloo with 4 processes on 2 cores a few-byte all-reduce takes
5-8 ms, a step's several of them a few percent of the step).

Peak memory per rank is parameters, gradients and optimizer state as the data mode keeps them, and
the most activation bytes the rank's stages hold at once as the schedule runs its actions
(:func:`~lightning_pipe.schedule.simulate.held_peak`). Not counted: the allocator's slack,
framework buffers and what the optimizer step allocates while it runs; :mod:`.report` says so next
to the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.planning.candidates import Candidate, DataMode
from lightning_pipe.planning.costs import Links, Machine, ModelCosts
from lightning_pipe.planning.stage_costs import StageCost, stage_costs
from lightning_pipe.schedule.actions import PipelineSchedule
from lightning_pipe.schedule.builders import ScheduleKind, build_schedule
from lightning_pipe.schedule.shared_cores import simulate_shared
from lightning_pipe.schedule.simulate import SimulationResult, held_peak, simulate

FSDP_GATHER_SHARE = 1 / 3
"""FSDP2's hooks around one all-gather of a layer, per parameter tensor, as a share of the
optimizer step's DTensor overhead per tensor (:attr:`~.costs.ModelCosts.sharded_step_seconds`):
both are per-tensor dispatch on the host, so one measurement scales both to the machine.
Calibrated on this project's CPU host, one process (a world of one, the example GPT of width 128,
6 blocks, 78 parameter tensors in 8 units): ``fully_shard`` added 12 ms to a forward and backward
without resharding (one gather, one reduction) and 17.6 ms resharding (two gathers, one
reduction), its AdamW step 18 ms to plain AdamW's: 0.154 and 0.226 ms a tensor against 0.23 ms,
about a third of the step's overhead per tensor and collective."""

FSDP_REDUCE_SHARE = 1 / 3
"""The same for one reduce-scatter of a layer's gradients (see :data:`FSDP_GATHER_SHARE`)."""


@dataclass(frozen=True)
class MemoryUse:
    """One rank's bytes at its peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted step and memory, with the parts the step time is made of (on the
    busiest rank)."""

    candidate: Candidate
    step_seconds: float
    compute_seconds: float
    """The busiest rank's layer compute (no communication, no recomputation)."""
    bubble_seconds: float
    """The makespan beyond the busiest rank's work: pipeline fill and drain, and message waits."""
    tensor_seconds: float
    """Tensor-parallel all-reduces on the busiest rank."""
    recompute_seconds: float
    data_seconds: float
    """The data axis' communication left exposed (the worst rank's), FSDP2's hooks around it
    included."""
    data_traffic_seconds: float
    """The data axis' communication in all, hidden or not: between layouts predicted equally fast,
    the one moving less is safer (hidden traffic still contends for links and memory)."""
    memory: MemoryUse
    """The rank with the highest peak."""
    rank_memory: tuple[MemoryUse, ...]
    """Each pipeline rank's (the same on every tensor and data rank of it)."""
    fits: bool
    optimizer_seconds: float = 0.0
    """The optimizer step on the slowest rank (after the schedule: nothing overlaps it)."""
    shared_compute_seconds: float = 0.0
    """The step beyond the schedule's makespan because the processes share fewer compute slots
    than there are processes (:attr:`~.costs.Machine.compute_slots`): the schedule played with each
    computation slowed by the processes computing during it, and at least their work, all of it,
    over the slots."""
    step_collectives_seconds: float = 0.0
    """The runtime's own small collectives of each step (:func:`step_collectives`)."""

    @property
    def peak_bytes(self) -> float:
        return self.memory.total

    @property
    def schedule_seconds(self) -> float:
        """The step on devices of their own: the step less the wait for shared cores (the
        schedule's makespan, the exposed communication and the optimizer step). Between layouts
        predicted equally fast because the cores are the bottleneck, the one with the shorter
        schedule relies less on ranks idle in the bubble lending their cores."""
        return self.step_seconds - self.shared_compute_seconds

    @property
    def communicating_processes(self) -> int:
        """The processes each step's collectives span (tensor ranks x data ranks; a pipeline's
        neighbours only exchange point-to-point messages)."""
        return self.candidate.tensor_parallel_size * self.candidate.data_parallel_size


@lru_cache(maxsize=256)
def _schedule(kind: ScheduleKind, stages: int, m: int, v: int) -> PipelineSchedule:
    return build_schedule(kind, stages, m, virtual_stages=v)  # built and validated once per shape


@lru_cache(maxsize=512)
def _schedule_sim(
    kind: ScheduleKind, stages: int, m: int, v: int, tf: tuple[float, ...], tb: tuple[float, ...], comm: float
) -> SimulationResult:
    return simulate(_schedule(kind, stages, m, v), tf, tb, comm)


@lru_cache(maxsize=1024)
def _shared_sim(
    kind: ScheduleKind,
    stages: int,
    m: int,
    v: int,
    tf: tuple[float, ...],
    tb: tuple[float, ...],
    comm: float,
    slots: float,
    replicas: int,
    waits: tuple[tuple[float, ...], tuple[float, ...]],
) -> SimulationResult:
    plain = _schedule_sim(kind, stages, m, v, tf, tb, comm)
    schedule = _schedule(kind, stages, m, v)
    return simulate_shared(schedule, tf, tb, comm, slots, replicas, plain=plain, unpaced_forward=waits[0],
                           unpaced_backward=waits[1])  # fmt: skip


def _memory(
    c: Candidate,
    costs: ModelCosts,
    stages: Sequence[StageCost],
    held: Sequence[int],
    schedule: PipelineSchedule,
    rank: int,
) -> MemoryUse:
    """Pipeline rank ``rank``'s peak, holding the stages ``held``."""
    p = sum(stages[s].parameters for s in held)
    g = p * costs.gradient_factor
    k, dp = costs.optimizer_state_factor, c.data_parallel_size
    if c.recompute is RecomputeMode.NEVER:
        activations = held_peak(schedule, rank, {s: stages[s].activations for s in held})
    else:
        # Inputs kept per micro-batch alive, and one micro-batch's whole activations while its
        # forward runs again (two under except_last: the last micro-batch keeps its own).
        whole = max(stages[s].activations for s in held)
        last = 1 if c.recompute is RecomputeMode.EXCEPT_LAST else 0
        kept = {s: stages[s].kept_when_recomputed for s in held}
        if schedule.splits_backward:
            # Zero-bubble: the forward run again at the input-gradient pass is held until the
            # weight pass, which ZB-H1 defers (the executor's meter counts the same): all of a
            # micro-batch's activations but its stage input, which it kept already. The last
            # micro-batch under except_last is not run again; counting its replay too overstates
            # that micro-batch's window by one replay, on the safe side.
            replayed = {s: stages[s].activations - stages[s].stage_input for s in held}
            activations = held_peak(schedule, rank, kept, replayed) + last * whole
        else:
            activations = held_peak(schedule, rank, kept) + (1 + last) * whole
    if c.data_mode is DataMode.REPLICATED:
        return MemoryUse(p, g, k * p, activations)
    if c.data_mode is DataMode.ZERO1:
        return MemoryUse(p, g, k * p / dp, activations)
    if c.reshard_after_forward:
        # Shards, plus the layer in use and the one prefetched, whole, with the layer's gradient.
        largest = max(stages[s].largest_layer for s in held)
        return MemoryUse(
            p / dp + 2 * largest, g / dp + largest * costs.gradient_factor, k * p / dp, activations
        )
    # Without resharding the stage stays gathered through the step and its gradients whole until
    # the window's reduce-scatter: the shards on top of what a replica holds.
    return MemoryUse(p / dp + p, g + g / dp, k * p / dp, activations)


def _exposed(comm: float, window: float, links: Links) -> float:
    return max(0.0, comm - window) if links.overlap_data_parallel else comm


def _data_seconds(
    c: Candidate,
    costs: ModelCosts,
    stages: Sequence[StageCost],
    held: Sequence[int],
    links: Links,
    wait: float,
) -> float:
    """The data axis' communication a rank leaves exposed per step; ``wait``: what each collective
    waits for its last rank (:attr:`.Machine.collective_wait_seconds`)."""
    dp = c.data_parallel_size
    if dp == 1:
        return 0.0
    p = sum(stages[s].parameters for s in held)
    g = p * costs.gradient_factor
    first = stages[min(held)]  # the rank's first forward and its last backward run this stage
    if c.data_mode is DataMode.REPLICATED:
        return _exposed(links.all_reduce(g, dp) + wait, first.backward, links)
    if c.data_mode is DataMode.ZERO1:
        return _exposed(links.reduce_scatter(g, dp) + wait, first.backward, links) + _exposed(
            links.all_gather(p, dp) + wait, first.forward, links
        )
    # FSDP2: every pipeline layer is a unit of its own (data_parallel.fully_sharded), gathered and
    # reduced by a collective of its own: the latency once per layer, the bytes once in all.
    units = sum(stages[s].layers for s in held)
    gather = units * (links.all_gather(p / units, dp) + wait)
    reduce = units * (links.reduce_scatter(g / units, dp) + wait)
    if c.reshard_after_forward:
        # Per micro-batch: gathered for the forward, again for the backward, reduced after it.
        per_microbatch = _exposed(gather, first.forward, links) + _exposed(
            gather + reduce, first.backward, links
        )
        return c.num_microbatches * per_microbatch
    return _exposed(gather, first.forward, links) + _exposed(reduce, first.backward, links)


def step_collectives(c: Candidate, links: Links) -> float:
    """The collectives the runtime makes each training step besides the model's
    (:mod:`lightning_pipe.runtime.step_checks`), each a few bytes, so their latency: the batch
    agreement over the model replica (``pp x tp`` ranks: an all-reduce on the device group and one
    on the host group) and, with a pipeline, the last stage's results sent to every pipeline rank
    (three broadcasts: the payload's size, its bytes, the loss; a broadcast read as an
    all-gather's ``n - 1`` steps). Counted on this project's gloo runs (4 processes, each step's
    ``torch.distributed`` calls): pp=2 x dp=2 made 3 all-reduces and 3 broadcasts over its 2
    pipeline ranks, pp=4 2 all-reduces and 3 broadcasts over 4. A model counting loss items adds
    an all-reduce over the data axis, not counted (the planner does not know the hooks)."""
    replica = c.pipeline_parallel_size * c.tensor_parallel_size
    seconds = 2 * links.all_reduce(0, replica) if replica > 1 else 0.0
    if c.pipeline_parallel_size > 1:
        seconds += 3 * links.all_gather(0, c.pipeline_parallel_size)
    return seconds


def predict(candidate: Candidate, costs: ModelCosts, machine: Machine, batch: int) -> Prediction:
    """``candidate``'s step time and peak memory per rank for a global batch of ``batch`` samples."""
    c, links = candidate, machine.links
    rows = batch / c.data_parallel_size / c.num_microbatches
    wait = machine.collective_wait_seconds
    stages = stage_costs(costs, c, rows, links, wait)
    pp = c.pipeline_parallel_size
    message = 0.0
    if pp > 1:
        # A message between stages waits as a collective does: its receiver, blocked, is woken on
        # a core others hold (on the Llama, the wait per message took interleaved 1F1B at v=4
        # from 1.37x its measured step to 1.11x, beside 1F1B's 1.24 and 1.20x).
        message = links.p2p(max(s.output for s in stages[:-1])) + wait
    sim_inputs = (tuple(s.forward for s in stages), tuple(s.backward for s in stages))
    sim = _schedule_sim(c.schedule, c.num_stages, c.num_microbatches, c.virtual_stages, *sim_inputs, message)
    ranks = [[s for s in range(c.num_stages) if s % pp == r] for r in range(pp)]
    busiest = max(range(pp), key=lambda r: sim.busy[r])
    m = c.num_microbatches
    data = max(_data_seconds(c, costs, stages, held, links, wait) for held in ranks)
    unhidden = replace(links, overlap_data_parallel=False)
    traffic = max(_data_seconds(c, costs, stages, held, unhidden, wait) for held in ranks)
    schedule = _schedule(c.schedule, c.num_stages, c.num_microbatches, c.virtual_stages)
    memories = [_memory(c, costs, stages, held, schedule, r) for r, held in enumerate(ranks)]
    worst = max(memories, key=lambda use: use.total)
    mine = ranks[busiest]
    shared = 0.0
    if machine.compute_slots is not None:
        # Every tensor and data rank of a pipeline rank computes its stages (recomputation
        # included). Each computation is slowed by the processes computing during it
        # (schedule.shared_cores), and the step is never shorter than all of their work over the
        # slots. Its tensor all-reduces are not slowed: the links' probe timed them with every
        # rank on the cores already, and the wait for the last rank is counted in them. (Paced as
        # work, the GPT's pp=1 x tp=4 measured 0.58 - 0.85x its prediction in runs whose pp=1 x
        # dp=4 measured 0.95 - 1.03x: docs/planner-accuracy.md.)
        slots = min(machine.compute_slots, machine.world_size)
        replicas = c.tensor_parallel_size * c.data_parallel_size
        waits = (tuple(s.forward_wait for s in stages), tuple(s.backward_wait for s in stages))
        contended = _shared_sim(
            c.schedule,
            c.num_stages,
            m,
            c.virtual_stages,
            sim_inputs[0],
            sim_inputs[1],
            message,
            slots,
            replicas,
            waits,
        )
        work = replicas * (sum(sim.busy) - m * sum(s.forward_wait + s.backward_wait for s in stages))
        shared = max(0.0, contended.makespan - sim.makespan, work / slots - sim.makespan)
    # The optimizer steps the parameters a rank updates (a data rank's shard under ZeRO-1 and
    # FSDP2), every process at once: on shared cores, at the cores' pace.
    sharded = c.data_mode is not DataMode.REPLICATED
    optimizer = max(sum(stages[s].optimizer for s in held) for held in ranks) / (
        c.data_parallel_size if sharded else 1
    )
    hooks = 0.0
    if c.data_mode is DataMode.FSDP2 and c.data_parallel_size > 1:
        # DTensor's dispatch per tensor: in the step over the rank's sharded parameters, and in
        # FSDP2's hooks around each gather and reduction (per micro-batch when resharding: a
        # gather for the forward, another for the backward, a reduction after it).
        tensors = max(sum(stages[s].tensors for s in held) for held in ranks)
        per_tensor = costs.sharded_step_seconds * tensors
        optimizer += per_tensor
        if c.reshard_after_forward:
            hooks = per_tensor * m * (2 * FSDP_GATHER_SHARE + FSDP_REDUCE_SHARE)
        else:
            hooks = per_tensor * (FSDP_GATHER_SHARE + FSDP_REDUCE_SHARE)
    if machine.compute_slots is not None:
        # Every process steps (and runs its hooks) at once: on shared cores, at the cores' pace.
        pace = max(1.0, machine.world_size / machine.compute_slots)
        optimizer *= pace
        hooks *= pace
    data += hooks
    collectives = step_collectives(c, links)
    return Prediction(
        candidate=c,
        step_seconds=sim.makespan + shared + data + optimizer + collectives,
        compute_seconds=m * sum(stages[s].compute for s in mine),
        bubble_seconds=sim.makespan - sim.busy[busiest],
        tensor_seconds=m * sum(stages[s].tensor for s in mine),
        recompute_seconds=m * sum(stages[s].recompute for s in mine),
        data_seconds=data,
        data_traffic_seconds=traffic,
        memory=worst,
        rank_memory=tuple(memories),
        fits=worst.total <= machine.memory_bytes,
        optimizer_seconds=optimizer,
        shared_compute_seconds=shared,
        step_collectives_seconds=collectives,
    )
