"""``sequence_parallel=True``: between the tensor-parallel regions each tensor rank holds its part
of the sequence, and training still ends where one device ends.

A tiny GPT whose plan marks where the sequence is split (its embedding layer, ``sequence_scatter``),
which modules see the whole sequence (attention, ``sequence_gather``; the MLP's first layer gathers
by itself) and which norms and dropouts sit between (``sequence``) trains two epochs with clipping:

* tp=2 and tp=4 with dropout 0.1 on the residual stream (each rank applies its part of the mask one
  device draws for the whole sequence), also with ``recompute="always"``;
* pp=2 x tp=2 (stages exchange sequence parts), without dropout (each stage's rank has its own
  random stream);

and every weight equals one device's (1e-5), norms and row-parallel biases equal on every tensor
rank. A block does an all-gather and a reduce-scatter per region forward, no all-reduce forward. A
sequence the tensor ranks cannot split evenly is refused at the first step; plans that do not
account for the sequence split are refused by name.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from lightning_pipe.tensor_parallel.plan import resolve_plan
from lightning_pipe.tensor_parallel.regions import count_collectives
from tests.distributed import run_distributed
from tests.gpt_models import DIM, SEQ, TinyGPT, token_data
from tests.trainers import fit

TOL = 1e-5
DATA = token_data(32)

SEQUENCE_PLAN = {
    "layers.0": "sequence_scatter",
    "layers.0.tokens": "vocab",
    "layers.*.ln1": "sequence",
    "layers.*.ln2": "sequence",
    "layers.*.attn": "sequence_gather",
    "layers.*.attn.qkv": "colwise",
    "layers.*.attn.proj": "rowwise",
    "layers.*.mlp.0": "colwise",
    "layers.*.mlp.2": "rowwise",
    "layers.*.drop": "sequence",
    "layers.3.ln": "sequence",
    "layers.3.out": "colwise_logits",
}


class SequenceGPT(TinyGPT):
    """TinyGPT with a sequence-parallel plan; dropout on the residual stream only (attention
    dropout draws per tensor rank from its own stream, which no one device draws)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout=dropout)
        for block in self.layers[1:3]:
            block.attn.drop.p = 0.0

    def tensor_parallel_plan(self) -> dict[str, str]:
        return dict(SEQUENCE_PLAN)


def _loader(data: TensorDataset, reference: bool) -> DataLoader:
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0) if reference else None
    return DataLoader(data, batch_size=8, sampler=sampler)


def sequence_worker(pp: int, tp: int, dropout: float, options: dict[str, Any]) -> dict[str, Any]:
    # A seed an earlier test set with seed_everything (inherited through the environment) would
    # re-seed the default generator at setup (Lightning's reset_seed), and the masks would differ
    # from the reference's, which starts from the model's own seed.
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(0)
    model = SequenceGPT(dropout=dropout)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, sequence_parallel=True,
        timeout=timedelta(seconds=90), **options,
    )  # fmt: skip
    fit(model, strategy, pp * tp, _loader(DATA, False), max_epochs=2, gradient_clip_val=0.5)
    runtime = strategy.runtime
    state = gather_model_state(model, runtime.partition, strategy.mesh)
    replicated = {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if runtime.partition.stage_of_key(n) in runtime.stage_indices and tensor_parallel_dim(p) is None
    }
    counts: dict[str, int] = {}
    # One block's collectives, forward and backward, on its part of the sequence.
    if runtime.partition.stage_of_layer(1) in runtime.stage_indices:
        block = model.layers[1]
        x = torch.randn(2, SEQ // tp, DIM, requires_grad=True)
        with count_collectives() as counter:
            block(x).sum().backward()
        counts = dict(counter)
    return {
        "state": state,
        "replicated": replicated,
        "coords": strategy.mesh.coordinates,
        "counts": counts,
        "layout_log": runtime.describe(),
    }


def reference_worker(dropout: float) -> dict[str, torch.Tensor]:
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(0)
    model = SequenceGPT(dropout=dropout)
    fit(model, "auto", 1, _loader(DATA, True), max_epochs=2, gradient_clip_val=0.5)
    return model.state_dict()


def _reference(dropout: float) -> dict[str, torch.Tensor]:
    """One device, in a fresh process like the ranks (the random stream of dropout must not
    depend on what earlier tests left in the test process)."""
    return run_distributed(reference_worker, 1, dropout, timeout=120, init_group=False)[0]


CASES = [
    (1, 2, 0.1, {"num_microbatches": 1}),
    (1, 2, 0.1, {"num_microbatches": 1, "recompute": "always"}),
    (1, 4, 0.1, {"num_microbatches": 1}),
    (2, 2, 0.0, {"num_microbatches": 2}),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("pp", "tp", "dropout", "options"),
    CASES,
    ids=["tp2-dropout", "tp2-dropout-recompute", "tp4-dropout", "pp2xtp2"],
)
def test_sequence_parallel_fit_matches_one_device(
    pp: int, tp: int, dropout: float, options: dict[str, Any]
) -> None:
    got = run_distributed(sequence_worker, pp * tp, pp, tp, dropout, options, timeout=300, init_group=False)
    expected = _reference(dropout)
    state = got[0]["state"]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=key)
    by_stage: dict[int, list[dict[str, torch.Tensor]]] = {}
    for r in got:  # norms and row-parallel biases: equal on every tensor rank (their gradients summed)
        by_stage.setdefault(r["coords"].pp_rank, []).append(r["replicated"])
    for copies in by_stage.values():
        assert any("ln" in n for n in copies[0]), "the stage holds norms"
        for other in copies[1:]:
            for name, value in copies[0].items():
                torch.testing.assert_close(other[name], value, atol=0, rtol=0, msg=name)
    counted = [r["counts"] for r in got if r["counts"]]
    assert counted
    for counts in counted:
        # attention: gather (its module), reduce-scatter (proj); MLP: gather (its first layer),
        # reduce-scatter (its last); the opposite in backward.
        # Inside the gathered attention the column layer keeps ``f`` (whose backward all-reduces the
        # partial gradients: anything else there, a norm, gets whole gradients too), and the
        # gather's backward keeps this rank's part.
        assert counts == {
            "sequence_all_gather_forward": 2,
            "sequence_reduce_scatter_forward": 2,
            "sequence_reduce_scatter_backward": 1,
            "sequence_all_gather_backward": 2,
            "all_reduce_backward": 1,
        }, counts
    assert "sequence parallel: between the tensor-parallel regions" in got[0]["layout_log"]


def indivisible_worker() -> str:
    ids = DATA.tensors[0][:, :7]
    data = TensorDataset(ids, DATA.tensors[1][:, :7])
    strategy = PipeTPStrategy(
        pipeline_parallel_size=1,
        tensor_parallel_size=2,
        sequence_parallel=True,
        timeout=timedelta(seconds=60),
    )
    try:
        fit(SequenceGPT(), strategy, 2, _loader(data, False), max_steps=1)
    except Exception as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_sequence_the_tensor_ranks_cannot_split_is_refused_at_the_first_step() -> None:
    for message in run_distributed(indivisible_worker, 2, timeout=120, init_group=False):
        assert "this batch's sequence length is 7, which 2 does not divide" in message
        assert "pad_to_multiple_of=2" in message


def test_plans_that_do_not_account_for_the_sequence_split_are_refused() -> None:
    model = SequenceGPT()
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        resolve_plan(model, SEQUENCE_PLAN, 2)
    forgot_norm = {k: v for k, v in SEQUENCE_PLAN.items() if k != "layers.*.ln2"}
    with pytest.raises(ValueError, match=r"does not account for 'layers.1.ln2', 'layers.2.ln2'"):
        resolve_plan(model, forgot_norm, 2, sequence_parallel=True)
    no_split = {k: v for k, v in SEQUENCE_PLAN.items() if v != "sequence_scatter"}
    with pytest.raises(ValueError, match="a 'sequence_scatter' entry"):
        resolve_plan(model, no_split, 2, sequence_parallel=True)
    # Hugging Face's names: "sequence_parallel" is ours "sequence".
    hf = {**SEQUENCE_PLAN, "layers.*.ln1": "sequence_parallel"}
    assert resolve_plan(model, hf, 2, sequence_parallel=True)["layers.1.ln1"].value == "sequence"


def test_plan_entries_that_would_sum_or_split_wrongly_are_refused() -> None:
    model = SequenceGPT(dropout=0.1)
    whole_block = {**SEQUENCE_PLAN, "layers.1": "sequence"}
    with pytest.raises(ValueError, match=re.escape("'layers.1': 'sequence' contains other plan entries")):
        resolve_plan(model, whole_block, 2, sequence_parallel=True)
    inside_gather = {**SEQUENCE_PLAN, "layers.*.attn.drop": "sequence"}
    with pytest.raises(ValueError, match=re.escape("is inside 'layers.1.attn' (sequence_gather)")):
        resolve_plan(model, inside_gather, 2, sequence_parallel=True)
    unnamed_dropout = {k: v for k, v in SEQUENCE_PLAN.items() if k != "layers.*.drop"}
    with pytest.raises(ValueError, match=re.escape("does not account for 'layers.1.drop', 'layers.2.drop'")):
        resolve_plan(model, unnamed_dropout, 2, sequence_parallel=True)
