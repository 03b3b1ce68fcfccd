"""One pipeline stage's costs per micro-batch, from its layers' measured costs.

The cost model (:mod:`.cost_model`) plays a candidate's schedule with these: each stage's forward
and backward time at the candidate's micro-batch size (measured at that size where the
measurement had it: :meth:`~.costs.LayerCost.seconds_at`), divided by the tensor size where the
plan splits the work, plus the tensor-parallel all-reduces (exposed: they sit between a layer's
matrix products; kept apart as waits, which shared cores do not slow) and, with recomputation, a
second forward in backward; and the bytes a stage holds: its parameters as a tensor rank holds
them, the activations it saves per micro-batch, its input and output. The layers are split into
stages as ``partition="time"`` splits them
(:func:`~lightning_pipe.partition.balance.balance_by_time`), so that a candidate run with
:func:`stage_balance` is the one predicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.partition.balance import balance_by_time
from lightning_pipe.planning.candidates import Candidate
from lightning_pipe.planning.costs import LayerCost, Links, ModelCosts

SPLIT_ACTIVATION_SHARE = 0.7
"""Of a tensor-split layer's saved activations, the share the tensor ranks split (Korthikanti et
al. 2022, arXiv:2205.05198, Table 2: without sequence parallelism a transformer layer saves
``sbh (10 + 24/t + 5as/(ht))`` bytes, the 24 and the attention scores split, the 10 of the norms
and residuals whole: at least 24/34)."""


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's costs per micro-batch, as one tensor rank runs and holds it."""

    forward: float
    backward: float
    compute: float
    tensor: float
    forward_wait: float
    """Of ``forward``, the tensor-parallel all-reduces: waits, which sharing the cores does not
    slow (:func:`~lightning_pipe.schedule.shared_cores.simulate_shared`)."""
    backward_wait: float
    """Of ``backward``, the same (the recomputed forward's included)."""
    recompute: float
    activations: float
    kept_when_recomputed: float
    """The stage input and output per micro-batch, what recomputation keeps until the backward."""
    stage_input: float
    output: float
    """The stage's output per micro-batch: the message to the next stage."""
    parameters: float
    largest_layer: float
    optimizer: float
    """One optimizer step over the stage's parameters as a tensor rank holds them (whole on the
    data axis)."""
    layers: int
    tensors: int
    """The stage's parameter tensors."""


@lru_cache(maxsize=256)
def _balance(times: tuple[float, ...], stages: int) -> tuple[int, ...]:
    return tuple(balance_by_time(times, stages))


def stage_balance(costs: ModelCosts, candidate: Candidate) -> list[int]:
    """The layers per stage the prediction assumes (``partition="time"``'s split of the measured
    times), to run the candidate with exactly that split."""
    return list(
        _balance(tuple(la.forward_seconds + la.backward_seconds for la in costs.layers), candidate.num_stages)
    )


def stage_costs(costs: ModelCosts, c: Candidate, rows: float, links: Links, wait: float) -> list[StageCost]:
    """Each of ``c``'s stages' costs per micro-batch of ``rows`` samples (the layers split as
    :func:`stage_balance` splits them); ``wait``: what each collective waits for its last rank
    (:attr:`.Machine.collective_wait_seconds`)."""
    layers = costs.layers
    out, start = [], 0
    for count in stage_balance(costs, c):
        inputs = layers[start - 1].output_bytes if start else costs.input_bytes
        hidden = layers[start - 1].output_bytes if start else layers[0].output_bytes
        out.append(_stage(layers[start : start + count], costs, c, rows, inputs, hidden, links, wait))
        start += count
    return out


def _stage(
    group: Sequence[LayerCost],
    costs: ModelCosts,
    c: Candidate,
    rows: float,
    inputs: int,
    hidden: int,
    links: Links,
    wait: float,
) -> StageCost:
    """One stage's costs per micro-batch of ``rows`` samples; ``inputs``: the bytes of its input (at
    the measured rows), ``hidden``: of the hidden states its first tensor all-reduce carries;
    ``wait``: what each collective waits for its last rank (:attr:`.Machine.collective_wait_seconds`)."""
    tp, scale = c.tensor_parallel_size, rows / costs.rows
    forward = backward = tensor_f = tensor_b = activations = parameters = largest = optimizer = 0.0
    previous_saved_output = float(inputs)  # the stage input, held until its backward
    for layer in group:
        # A tensor two neighbours both save (one's output, the next's input) exists once.
        shared = min(layer.saved_input_bytes, previous_saved_output)
        previous_saved_output = layer.saved_output_bytes
        keep = 1 - layer.split_share + layer.split_share / tp
        f, b = layer.seconds_at(rows, costs.rows, keep)
        forward += f
        # Zero-bubble schedules run the backward as an input pass and a weight pass: measured.
        backward += b * (layer.split_backward_ratio if c.schedule.splits_backward else 1.0)
        one = links.all_reduce(hidden * scale, tp) + (wait if tp > 1 else 0.0)
        tensor_f += layer.tensor_forward_collectives * one
        tensor_b += layer.tensor_backward_collectives * one
        split = SPLIT_ACTIVATION_SHARE if layer.split_parameter_bytes else 0.0
        activations += (layer.activation_bytes - shared) * scale * (1 - split + split / tp)
        held = layer.parameter_bytes - layer.split_parameter_bytes + layer.split_parameter_bytes / tp
        parameters += held
        optimizer += layer.optimizer_seconds * (
            held / layer.parameter_bytes if layer.parameter_bytes else 1.0
        )
        largest = max(largest, held)
        hidden = layer.output_bytes
    # The step holds the stage's input and output per micro-batch until its backward: the input in
    # full (a first layer that saved it too was counted without it), the output where the last
    # layer did not save it.
    boundary = (inputs + group[-1].output_bytes) * scale
    activations += (inputs + group[-1].output_bytes - group[-1].saved_output_bytes) * scale
    replayed = 0.0  # the forwards recomputation runs again, per micro-batch
    if c.recompute is RecomputeMode.ALWAYS:
        replayed = 1.0
    elif c.recompute is RecomputeMode.EXCEPT_LAST:
        replayed = (c.num_microbatches - 1) / c.num_microbatches
    recompute = (forward + tensor_f) * replayed
    return StageCost(
        forward=forward + tensor_f,
        backward=backward + tensor_b + recompute,
        compute=forward + backward,
        tensor=tensor_f + tensor_b,
        forward_wait=tensor_f,
        backward_wait=tensor_b + tensor_f * replayed,
        recompute=recompute,
        activations=activations,
        kept_when_recomputed=boundary,
        stage_input=inputs * scale,
        output=group[-1].output_bytes * scale,
        parameters=parameters,
        largest_layer=largest,
        optimizer=optimizer,
        layers=len(group),
        tensors=sum(layer.parameter_tensors for layer in group),
    )
