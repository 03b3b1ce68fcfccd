"""Split an ordered list of layers into contiguous pipeline stages.

A *balance* is the number of layers of each stage (torchgpipe's term). It comes from one of:

* ``"uniform"``: equal layer counts (the first stages take one more when it does not divide).
* ``"parameters"`` (default): the contiguous split that minimises the largest stage's parameter
  count, which balances memory and, for stacks of similar blocks, compute. Ties go to the split
  with the smallest largest layer count, so parameter-free layers (activations, dropout) spread out
  instead of piling onto one stage.
* ``"time"``: the contiguous split that minimises the slowest stage's measured forward plus
  backward time per micro-batch (torchgpipe's ``balance_by_time``; the times come from
  :mod:`lightning_pipe.partition.profile`).
* an explicit list of layer counts, one per stage.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from functools import cache

from torch import nn

from lightning_pipe.arguments import parse_option


class PartitionMethod(enum.Enum):
    """How :func:`compute_balance` chooses the balance when none is given."""

    UNIFORM = "uniform"
    PARAMETERS = "parameters"
    TIME = "time"


Partition = PartitionMethod | str | Sequence[int]


def check_partition(partition: Partition) -> None:
    """Raise the error :func:`compute_balance` would raise for an unknown method name, early."""
    if isinstance(partition, PartitionMethod | str):
        _parse_method(partition)
        return
    if not isinstance(partition, Sequence) or not partition:
        raise ValueError(
            f"partition must be 'parameters', 'uniform', 'time' or a list of layer counts per stage, got "
            f"{partition!r}."
        )
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in partition):
        raise ValueError(
            f"partition={list(partition)!r}: a partition list holds each stage's number of layers, every "
            "one an integer >= 1 (a stage without layers has nothing to run)."
        )


def measures_time(partition: Partition) -> bool:
    """Whether ``partition`` asks for layer times (``"time"``)."""
    return isinstance(partition, PartitionMethod | str) and _parse_method(partition) is PartitionMethod.TIME


def _parse_method(value: PartitionMethod | str) -> PartitionMethod:
    hint = ", or a list of layer counts per stage such as [3, 5]"
    return parse_option(PartitionMethod, value, "partition", hint=hint)


def _check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    balance = list(balance)
    if len(balance) != num_stages:
        raise ValueError(
            f"The partition {balance} has {len(balance)} entries but the pipeline has {num_stages} "
            f"stages: give one layer count per stage."
        )
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"Every stage needs at least one layer, got the partition {balance}.")
    if sum(balance) != num_layers:
        raise ValueError(
            f"The partition {balance} sums to {sum(balance)} layers but the model has {num_layers}: "
            "the layer counts must add up to the number of layers from configure_pipeline()."
        )
    return balance


def parameter_count(layer: nn.Module) -> int:
    """Number of distinct parameter elements of ``layer`` (a weight shared inside it counts once)."""
    return sum(p.numel() for p in {id(p): p for p in layer.parameters()}.values())


def _min_max_split(costs: Sequence[int], num_stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the max part.

    Two exact dynamic programmes, O(stages * layers^2) each (layer lists are tens to hundreds):
    the first finds the smallest achievable largest-stage cost, the second, among the splits that
    achieve it, the one with the smallest largest layer count. (One programme over the pair of
    maxima would not be exact: the max of pairs does not preserve their lexicographic order.)
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @cache
    def min_cost(start: int, stages: int) -> int:
        if stages == 1:
            return prefix[n] - prefix[start]
        return min(
            max(prefix[end] - prefix[start], min_cost(end, stages - 1))
            for end in range(start + 1, n - stages + 2)
        )

    bound = min_cost(0, num_stages)
    infeasible = (n + 1, ())

    @cache
    def fewest_layers(start: int, stages: int) -> tuple[int, tuple[int, ...]]:
        # Smallest largest layer count of a split of costs[start:] whose every part costs <= bound.
        if stages == 1:
            return (n - start, (n - start,)) if prefix[n] - prefix[start] <= bound else infeasible
        best: tuple[int, tuple[int, ...]] = infeasible
        for end in range(start + 1, n - stages + 2):
            if prefix[end] - prefix[start] > bound:
                break
            rest, split = fewest_layers(end, stages - 1)
            candidate = (max(end - start, rest), (end - start, *split))
            if rest <= n and candidate < best:
                best = candidate
        return best

    return list(fewest_layers(0, num_stages)[1])


def balance_by_time(times: Sequence[float], num_stages: int) -> list[int]:
    """The contiguous split of layers taking ``times`` seconds each into ``num_stages`` stages that
    minimises the slowest stage (``partition="time"``'s split; the layout planner predicts it)."""
    if not 1 <= num_stages <= len(times):
        raise ValueError(f"{len(times)} layers cannot be split into {num_stages} non-empty stages.")
    # Whole microseconds (at least one, so that a layer too fast to measure still counts).
    return _min_max_split([max(1, round(t * 1e6)) for t in times], num_stages)


def compute_balance(
    layers: Sequence[nn.Module],
    num_stages: int,
    partition: Partition = "parameters",
    times: Sequence[float] | None = None,
) -> list[int]:
    """Return the number of layers of each of ``num_stages`` stages (``times``: each layer's
    measured seconds per micro-batch, needed by ``partition="time"``)."""
    num_layers = len(layers)
    if num_stages < 1:
        raise ValueError(f"The pipeline needs at least one stage, got {num_stages}.")
    if num_layers < num_stages:
        raise ValueError(
            f"The model has {num_layers} layers but the pipeline has {num_stages} stages: every "
            f"stage needs at least one layer. Lower pipeline_parallel_size to at most {num_layers} "
            "or return finer-grained layers from configure_pipeline()."
        )
    if not isinstance(partition, PartitionMethod | str):
        return _check_balance(partition, num_layers, num_stages)
    method = _parse_method(partition)
    if method is PartitionMethod.UNIFORM:
        base, extra = divmod(num_layers, num_stages)
        return [base + (1 if s < extra else 0) for s in range(num_stages)]
    if method is PartitionMethod.TIME:
        if times is None or len(times) != num_layers:
            given = "none" if times is None else f"{len(times)}"
            raise ValueError(
                f'partition="time" needs one measured time per layer ({num_layers}), got {given}: '
                "profile the layers first (lightning_pipe.partition.profile.profile_layers)."
            )
        return balance_by_time(times, num_stages)
    return _min_max_split([parameter_count(layer) for layer in layers], num_stages)


def split_layers(layers: Sequence[nn.Module], balance: Sequence[int]) -> list[list[nn.Module]]:
    """Cut ``layers`` into consecutive groups of the sizes in ``balance``."""
    _check_balance(balance, len(layers), len(balance))
    stages: list[list[nn.Module]] = []
    start = 0
    for count in balance:
        stages.append(list(layers[start : start + count]))
        start += count
    return stages
