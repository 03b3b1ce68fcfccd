"""Splitting a layer list into contiguous stages: uniform, by parameters, explicit, and errors."""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from lightning_pipe.partition.balance import (
    PartitionMethod,
    compute_balance,
    parameter_count,
    split_layers,
)


def layer(params: int) -> nn.Module:
    """A layer with exactly ``params`` parameter elements (a parameter-free ReLU for 0)."""
    return nn.Linear(params, 1, bias=False) if params else nn.ReLU()


def stage_costs(costs: list[int], balance: list[int]) -> list[int]:
    out, start = [], 0
    for count in balance:
        out.append(sum(costs[start : start + count]))
        start += count
    return out


def all_balances(num_layers: int, num_stages: int) -> list[list[int]]:
    """Every split of ``num_layers`` into ``num_stages`` contiguous non-empty stages."""
    result = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = [0, *cuts, num_layers]
        result.append([b - a for a, b in itertools.pairwise(bounds)])
    return result


def assert_valid_balance(balance: list[int], num_layers: int, num_stages: int) -> None:
    assert len(balance) == num_stages
    assert all(isinstance(b, int) and b >= 1 for b in balance)
    assert sum(balance) == num_layers


# ---------------------------------------------------------------------------------------- uniform


def test_uniform_balance() -> None:
    layers = [nn.ReLU() for _ in range(10)]
    assert compute_balance(layers, 4, "uniform") == [3, 3, 2, 2]
    assert compute_balance(layers, 4, PartitionMethod.UNIFORM) == [3, 3, 2, 2]
    assert compute_balance(layers, 5, "uniform") == [2] * 5
    assert compute_balance(layers, 3, "uniform") == [4, 3, 3]
    assert compute_balance(layers, 10, "uniform") == [1] * 10
    assert compute_balance(layers, 1, "uniform") == [10]


def test_uniform_ignores_parameters() -> None:
    layers = [layer(1000), layer(1), layer(1), layer(1)]
    assert compute_balance(layers, 2, "uniform") == [2, 2]


# ---------------------------------------------------------------------------------------- parameters


def test_parameter_count() -> None:
    assert parameter_count(nn.Linear(4, 3)) == 4 * 3 + 3
    assert parameter_count(nn.ReLU()) == 0
    shared = nn.Linear(5, 5)
    # The same weights used twice inside one layer count once.
    assert parameter_count(nn.Sequential(shared, shared)) == 30
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    assert parameter_count(tied) == 16


def test_parameters_is_the_default() -> None:
    layers = [layer(100), layer(1), layer(1), layer(1), layer(1)]
    assert compute_balance(layers, 2) == compute_balance(layers, 2, "parameters") == [1, 4]
    assert compute_balance(layers, 2, PartitionMethod.PARAMETERS) == [1, 4]


def test_parameters_linear_layers_of_very_different_sizes() -> None:
    layers = [
        nn.Linear(256, 256),  # 65,792
        nn.Linear(256, 8),  # 2,056
        nn.Linear(8, 8),  # 72
        nn.Linear(8, 256),  # 2,304
        nn.Linear(256, 256),  # 65,792
        nn.Linear(256, 256),  # 65,792
    ]
    costs = [parameter_count(m) for m in layers]
    for num_stages in range(1, len(layers) + 1):
        balance = compute_balance(layers, num_stages)
        assert_valid_balance(balance, len(layers), num_stages)
        best = min(max(stage_costs(costs, b)) for b in all_balances(len(layers), num_stages))
        assert max(stage_costs(costs, balance)) == best, num_stages
    # Concretely, with three stages each big layer gets its own stage and the small ones are shared
    # out so that no stage carries more than a big layer plus 2,304: stage params [67920, 68096, 65792].
    assert compute_balance(layers, 3) == [3, 2, 1]
    assert stage_costs(costs, [3, 2, 1]) == [65_792 + 2_056 + 72, 2_304 + 65_792, 65_792]
    assert compute_balance(layers, 2) == [4, 2]


def test_parameters_minimises_largest_stage_against_brute_force() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        num_layers = rng.randint(1, 8)
        num_stages = rng.randint(1, num_layers)
        costs = [rng.choice([0, 0, 1, 3, 7, 20, 64, 500]) for _ in range(num_layers)]
        balance = compute_balance([layer(c) for c in costs], num_stages)
        assert_valid_balance(balance, num_layers, num_stages)
        best = min(max(stage_costs(costs, b)) for b in all_balances(num_layers, num_stages))
        assert max(stage_costs(costs, balance)) == best, (costs, num_stages, balance)


def test_parameter_free_layers_spread_out() -> None:
    # [1, 3], [2, 2] and [3, 1] all put the Linear's 16 parameters on the largest stage: the
    # documented tie-break (smallest largest layer count) picks [2, 2].
    layers = [nn.Linear(4, 4, bias=False), nn.ReLU(), nn.ReLU(), nn.ReLU()]
    assert compute_balance(layers, 2) == [2, 2]
    # All parameter-free: the same as uniform in layer count.
    relus = [nn.ReLU() for _ in range(7)]
    assert max(compute_balance(relus, 3)) == 3
    assert max(compute_balance(relus, 7)) == 1


def test_parameter_tie_break_smallest_largest_layer_count() -> None:
    layers = [layer(2), layer(1), layer(1), nn.ReLU(), nn.ReLU()]
    balance = compute_balance(layers, 3)
    # [1, 2, 2] -> stage params [2, 2, 0]: the minimal max (2) with the minimal max layer count (2).
    assert balance == [1, 2, 2]


def test_parameter_tie_break_against_brute_force_on_documented_cases() -> None:
    """Cases where the DP's tie-break agrees with brute force (guards the primary objective too)."""
    cases = [
        ([16, 0, 0, 0], 2),
        ([0, 0, 0, 16], 2),
        ([0, 0, 5, 0, 0, 0], 3),
        ([4, 4, 0, 0, 0, 0], 2),
    ]
    for costs, num_stages in cases:
        balance = compute_balance([layer(c) for c in costs], num_stages)
        scored = [(max(stage_costs(costs, b)), max(b)) for b in all_balances(len(costs), num_stages)]
        assert (max(stage_costs(costs, balance)), max(balance)) == min(scored), (costs, balance)


# ---------------------------------------------------------------------------------------- explicit


def test_explicit_balance() -> None:
    layers = [nn.ReLU() for _ in range(6)]
    assert compute_balance(layers, 3, [1, 2, 3]) == [1, 2, 3]
    assert compute_balance(layers, 3, (4, 1, 1)) == [4, 1, 1]
    assert isinstance(compute_balance(layers, 3, (4, 1, 1)), list)


# ---------------------------------------------------------------------------------------- errors


def test_fewer_layers_than_stages() -> None:
    layers = [nn.ReLU() for _ in range(3)]
    for partition in ["uniform", "parameters", [1, 1, 1, 1, 1]]:
        with pytest.raises(ValueError, match="The model has 3 layers but the pipeline has 5 stages"):
            compute_balance(layers, 5, partition)
    with pytest.raises(ValueError, match="at most 3"):
        compute_balance(layers, 5)


def test_no_stages() -> None:
    with pytest.raises(ValueError, match="at least one stage, got 0"):
        compute_balance([nn.ReLU()], 0)


def test_explicit_balance_wrong_length() -> None:
    layers = [nn.ReLU() for _ in range(10)]
    with pytest.raises(
        ValueError, match=r"The partition \[5, 3, 2\] has 3 entries but the pipeline has 2 stages"
    ):
        compute_balance(layers, 2, [5, 3, 2])


def test_explicit_balance_wrong_sum() -> None:
    layers = [nn.ReLU() for _ in range(10)]
    with pytest.raises(ValueError, match=r"The partition \[5, 4\] sums to 9 layers but the model has 10"):
        compute_balance(layers, 2, [5, 4])
    with pytest.raises(ValueError, match="sums to 11 layers but the model has 10"):
        compute_balance(layers, 2, [5, 6])


@pytest.mark.parametrize("balance", [[0, 10], [11, -1], [5.0, 5]], ids=["zero", "negative", "float"])
def test_explicit_balance_entry_below_one(balance: list) -> None:
    layers = [nn.ReLU() for _ in range(10)]
    with pytest.raises(ValueError, match="Every stage needs at least one layer, got the partition"):
        compute_balance(layers, 2, balance)


def test_unknown_method() -> None:
    layers = [nn.ReLU() for _ in range(4)]
    with pytest.raises(
        ValueError, match="Unknown partition 'balanced': expected one of 'uniform', 'parameters'"
    ):
        compute_balance(layers, 2, "balanced")


# ---------------------------------------------------------------------------------------- split


def test_split_layers_groups() -> None:
    layers = [nn.Linear(i + 1, 1) for i in range(6)]
    stages = split_layers(layers, [1, 3, 2])
    assert [len(s) for s in stages] == [1, 3, 2]
    assert stages[0][0] is layers[0]
    assert all(a is b for a, b in zip(stages[1], layers[1:4], strict=True))
    assert all(a is b for a, b in zip(stages[2], layers[4:], strict=True))
    assert [m for s in stages for m in s] == layers


def test_split_layers_accepts_sequential_and_checks_balance() -> None:
    seq = nn.Sequential(*[nn.ReLU() for _ in range(4)])
    stages = split_layers(seq, compute_balance(list(seq), 2, "uniform"))
    assert [len(s) for s in stages] == [2, 2]
    assert all(isinstance(s, list) for s in stages)
    with pytest.raises(ValueError, match="sums to 3 layers but the model has 4"):
        split_layers(list(seq), [1, 2])
    with pytest.raises(ValueError, match="Every stage needs at least one layer"):
        split_layers(list(seq), [4, 0])


def test_the_layout_log_says_which_elements_are_tied_across_stages() -> None:
    """A weight tied across stages has a copy on each: the log says so, or the stages' counts
    would seem to add up to more than the model."""
    from lightning_pipe.partition.model import partition_model

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # the head tied to the embedding
    split = partition_model(model, list(model), 2)
    assert split.tied_counts == (40, 40)
    log = split.describe(list(model))
    assert "stage 0: layers 0-0 (Embedding), 40 parameters, 40 of them tied with stage 1" in log
    assert "stage 1: layers 1-2 (Linear, Linear), 60 parameters, 40 of them tied with stage 0" in log
    untied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert "tied" not in partition_model(untied, list(untied), 2).describe(list(untied))
