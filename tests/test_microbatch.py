"""Splitting batches into micro-batches along dim 0, micro-batch signatures, and the runtime's
counting, loss shares and sample micro-batch (`lightning_pipe.runtime.batch`)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_pipe.batches.microbatch import (
    batch_size,
    map_tensors,
    microbatch_sizes,
    signature,
    split_microbatches,
)
from lightning_pipe.runtime.batch import (
    count_microbatches,
    sample_microbatch,
    split_batch,
    weighted_microbatches,
)

Pair = namedtuple("Pair", ["inputs", "target"])


def rows(n: int, width: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n * width, dtype=dtype).reshape(n, width)


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(("size", "m"), [(8, 4), (10, 4), (7, 3), (5, 5), (9, 1), (13, 6)])
def test_microbatch_sizes_like_tensor_split(size: int, m: int) -> None:
    expected = [len(c) for c in torch.tensor_split(torch.arange(size), m)]
    assert microbatch_sizes(size, m) == expected
    assert sum(microbatch_sizes(size, m)) == size


def test_microbatch_sizes_uneven_first_get_extra() -> None:
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(11, 4) == [3, 3, 3, 2]


def test_microbatch_sizes_errors() -> None:
    with pytest.raises(ValueError, match="A batch of 3 samples cannot be split into 4 micro-batches"):
        microbatch_sizes(3, 4)
    with pytest.raises(ValueError, match="batch size of at least 4"):
        microbatch_sizes(3, 4)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        microbatch_sizes(8, 0)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got -2"):
        microbatch_sizes(8, -2)


def test_split_batch_smaller_than_num_microbatches() -> None:
    with pytest.raises(ValueError, match="A batch of 2 samples cannot be split into 3 micro-batches"):
        split_microbatches(rows(2), 3)


# ---------------------------------------------------------------------------------------- split


def test_split_tensor() -> None:
    x = rows(8)
    parts = split_microbatches(x, 4)
    assert len(parts) == 4
    for k, part in enumerate(parts):
        torch.testing.assert_close(part, x[2 * k : 2 * k + 2])
    torch.testing.assert_close(torch.cat(parts), x)


def test_split_tensor_uneven_matches_tensor_split() -> None:
    x = rows(10)
    parts = split_microbatches(x, 4)
    expected = torch.tensor_split(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    for got, want in zip(parts, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_split_one_microbatch_is_whole_batch() -> None:
    x = rows(5)
    (only,) = split_microbatches(x, 1)
    torch.testing.assert_close(only, x)


def test_split_tuple_and_list_keep_their_type() -> None:
    x, y = rows(6), torch.arange(6)
    for batch in [(x, y), [x, y]]:
        parts = split_microbatches(batch, 3)
        assert len(parts) == 3
        for k, part in enumerate(parts):
            assert type(part) is type(batch)
            assert len(part) == 2
            torch.testing.assert_close(part[0], x[2 * k : 2 * k + 2])
            torch.testing.assert_close(part[1], y[2 * k : 2 * k + 2])


def test_split_dict_keeps_keys_and_type() -> None:
    batch = {"x": rows(4), "y": torch.arange(4)}
    parts = split_microbatches(batch, 2)
    assert [type(p) for p in parts] == [dict, dict]
    assert all(list(p) == ["x", "y"] for p in parts)
    torch.testing.assert_close(parts[1]["x"], batch["x"][2:])
    torch.testing.assert_close(parts[0]["y"], batch["y"][:2])
    ordered = OrderedDict(b=rows(4), a=torch.arange(4))
    parts = split_microbatches(ordered, 2)
    assert all(type(p) is OrderedDict and list(p) == ["b", "a"] for p in parts)


def test_split_namedtuple() -> None:
    batch = Pair(rows(6), torch.arange(6))
    parts = split_microbatches(batch, 2)
    for k, part in enumerate(parts):
        assert isinstance(part, Pair)
        torch.testing.assert_close(part.inputs, batch.inputs[3 * k : 3 * k + 3])
        torch.testing.assert_close(part.target, batch.target[3 * k : 3 * k + 3])


def test_split_nested_structure() -> None:
    batch = {
        "inputs": (rows(5), [torch.ones(5, 2), {"mask": torch.zeros(5, dtype=torch.bool)}]),
        "target": Pair(torch.arange(5), torch.arange(5.0)),
    }
    parts = split_microbatches(batch, 2)
    assert [p["inputs"][0].shape[0] for p in parts] == [3, 2]
    for k, (start, stop) in enumerate([(0, 3), (3, 5)]):
        part = parts[k]
        assert isinstance(part["inputs"], tuple)
        assert isinstance(part["inputs"][1], list)
        assert isinstance(part["target"], Pair)
        torch.testing.assert_close(part["inputs"][0], batch["inputs"][0][start:stop])
        torch.testing.assert_close(part["inputs"][1][0], torch.ones(stop - start, 2))
        assert part["inputs"][1][1]["mask"].dtype is torch.bool
        assert part["inputs"][1][1]["mask"].shape == (stop - start,)
        torch.testing.assert_close(part["target"].target, torch.arange(5.0)[start:stop])


def test_split_copies_non_tensor_leaves() -> None:
    batch = {"x": rows(4), "name": "abc", "scale": 0.5, "extra": None, "ids": (7, "seven")}
    parts = split_microbatches(batch, 4)
    for part in parts:
        assert part["x"].shape == (1, 3)
        assert part["name"] == "abc"
        assert part["scale"] == 0.5
        assert part["extra"] is None
        assert part["ids"] == (7, "seven")


def test_split_tensor_not_first_leaf() -> None:
    parts = split_microbatches(("label", rows(4)), 2)
    assert [p[0] for p in parts] == ["label", "label"]
    torch.testing.assert_close(parts[1][1], rows(4)[2:])


def test_split_keeps_views_of_the_batch() -> None:
    x = rows(4)
    parts = split_microbatches(x, 2)
    assert parts[1].data_ptr() == x[2:].data_ptr()


# ---------------------------------------------------------------------------------------- errors


def test_mismatched_dim0_raises() -> None:
    with pytest.raises(
        ValueError, match=r"must share dim 0.*the first tensor has 4 rows but another has shape \(3, 2\)"
    ):
        split_microbatches((rows(4), torch.zeros(3, 2)), 2)
    with pytest.raises(ValueError, match="must share dim 0"):
        split_microbatches({"x": rows(4), "nested": [torch.zeros(5)]}, 2)


def test_scalar_tensor_after_first_raises() -> None:
    with pytest.raises(ValueError, match=r"another has shape \(\)"):
        split_microbatches((rows(4), torch.tensor(1.0)), 2)


def test_scalar_first_tensor_raises() -> None:
    with pytest.raises(
        TypeError,
        match=r"^Cannot split a batch whose first tensor is a scalar \(0-dim\) into micro-batches\.$",
    ):
        split_microbatches(torch.tensor(3.0), 1)


@pytest.mark.parametrize("batch", ["text", 3, None, (), [1, 2], {"a": "b"}, (None, ("x",))], ids=repr)
def test_batch_without_tensors_raises(batch: object) -> None:
    with pytest.raises(TypeError, match=r"holds no tensor\. Supported batches are tensors"):
        split_microbatches(batch, 1)


def test_batch_without_tensors_names_its_type() -> None:
    with pytest.raises(TypeError, match="batch of type str"):
        batch_size("text")


def test_batch_size() -> None:
    assert batch_size(rows(7)) == 7
    assert batch_size({"a": "meta", "b": (torch.zeros(5, 1), torch.zeros(5))}) == 5


# ---------------------------------------------------------------------------------------- signature


def test_signature_equal_for_equal_shapes_and_dtypes() -> None:
    a = (torch.zeros(2, 3), {"m": torch.ones(2, dtype=torch.bool)})
    b = (torch.randn(2, 3), {"m": torch.zeros(2, dtype=torch.bool)})
    assert signature(a) == signature(b)
    assert hash(signature(a)) == hash(signature(b))
    # Usable as a dict key (the executor caches shape headers by it).
    assert {signature(a): 1}[signature(b)] == 1


def test_signature_of_microbatches_from_an_even_split() -> None:
    parts = split_microbatches((rows(8), torch.arange(8)), 4)
    assert len({signature(p) for p in parts}) == 1
    uneven = split_microbatches((rows(10), torch.arange(10)), 4)
    assert len({signature(p) for p in uneven}) == 2


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 4)),
        (torch.zeros(2, 3), torch.zeros(3, 3)),
        (torch.zeros(2, 3), torch.zeros(2, 3, 1)),
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)),
        (torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)),
        ((torch.zeros(2),), (torch.zeros(2), torch.zeros(2))),
        ({"x": torch.zeros(2)}, {"y": torch.zeros(2)}),
        ({"x": torch.zeros(2), "y": torch.zeros(2)}, {"y": torch.zeros(2), "x": torch.zeros(2)}),
        ((torch.zeros(2), "meta"), (torch.zeros(2), 3)),
        (torch.zeros(2), (torch.zeros(2),)),
        (torch.zeros(2), {"x": torch.zeros(2)}),
    ],
    ids=[
        "width",
        "rows",
        "rank",
        "float-dtype",
        "int-dtype",
        "length",
        "keys",
        "key-order",
        "leaf-type",
        "tensor-vs-tuple",
        "tensor-vs-dict",
    ],
)
def test_signature_differs(a: object, b: object) -> None:
    assert signature(a) != signature(b)


def test_signature_ignores_values_of_non_tensor_leaves_of_same_type() -> None:
    assert signature((torch.zeros(2), "a")) == signature((torch.ones(2), "b"))
    assert signature({"k": None, "x": torch.zeros(2)}) == signature({"k": None, "x": torch.ones(2)})


def test_the_runtime_counts_microbatches_and_caps_them_at_the_batch() -> None:
    batch = torch.arange(10.0).reshape(5, 2)
    assert count_microbatches(batch, None, 2) == (4, False)  # 2 x pipeline_parallel_size
    assert count_microbatches(batch[:3], None, 2) == (3, False)
    assert count_microbatches(batch, 4, 2) == (4, False)
    assert count_microbatches(batch, 8, 2) == (5, True)  # fewer than asked: one sample each
    sizes, pieces = split_batch(batch, 2)
    assert sizes == [3, 2]
    assert [p.tolist() for p in pieces] == [batch[:3].tolist(), batch[3:].tolist()]


def test_microbatch_shares_by_items_by_samples_and_without_items() -> None:
    pieces = ["a", "b"]
    by_samples = weighted_microbatches(pieces, [3, 1], [3.0, 1.0], counted=False)
    assert [(m.index, m.data, m.size, m.share, m.items) for m in by_samples] == [
        (0, "a", 3, 0.75, None),
        (1, "b", 1, 0.25, None),
    ]
    by_items = weighted_microbatches(pieces, [3, 1], [2.0, 6.0], counted=True)
    assert [(m.share, m.items) for m in by_items] == [(0.25, 2.0), (0.75, 6.0)]
    # A replica's part without loss items: weighed by samples, and carrying no items.
    empty = weighted_microbatches(pieces, [3, 1], [0.0, 0.0], counted=True)
    assert [(m.share, m.items) for m in empty] == [(0.75, None), (0.25, None)]


def test_the_sample_partition_time_measures_is_a_batch_first_microbatch() -> None:
    """``ParallelRuntime(example_input=...)``: one micro-batch of forward's example input, split
    as a batch would be, through the model's ``pipeline_input`` when it has one."""
    example = (torch.arange(12.0).reshape(6, 2), torch.arange(6))
    sample = sample_microbatch(example, None, 2)  # 4 micro-batches of 6 samples: 2, 2, 1, 1
    assert isinstance(sample, tuple) and [t.tolist() for t in sample] == [
        example[0][:2].tolist(),
        example[1][:2].tolist(),
    ]
    first = sample_microbatch(example, 2, 4, lambda mb: mb[0] * 10)
    assert first.tolist() == (example[0][:3] * 10).tolist()
    assert sample_microbatch(example[0][:1], 3, 1).shape == (1, 2)  # capped at the batch's samples


@dataclasses.dataclass
class _Held:
    tokens: torch.Tensor
    name: str = "x"


def test_map_tensors_keeps_every_structure_a_batch_may_have() -> None:
    """What context parallelism cuts a batch with: each tensor replaced, every container (named
    tuples, ordered dicts, dataclasses) rebuilt as its own type, other leaves kept."""
    batch = OrderedDict(
        pair=Pair(torch.zeros(2, 4), [torch.ones(2, 4), 3]), held=_Held(torch.ones(2, 4)), note=None
    )
    out = map_tensors(batch, lambda t: t[:, :2])
    assert type(out) is OrderedDict and list(out) == ["pair", "held", "note"]
    assert type(out["pair"]) is Pair and out["pair"].inputs.shape == (2, 2)
    assert out["pair"].target[0].shape == (2, 2) and out["pair"].target[1] == 3
    assert type(out["held"]) is _Held and out["held"].tokens.shape == (2, 2) and out["held"].name == "x"
    assert out["note"] is None
