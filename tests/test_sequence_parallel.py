"""``sequence_parallel=True``: between the tensor-parallel regions each tensor rank holds its part
of the sequence, and training still ends where one device ends.

A tiny GPT whose plan marks where the sequence is split (its embedding layer, ``sequence_scatter``),
which modules see the whole sequence (attention, ``sequence_gather``; the MLP's first layer gathers
by itself) and which norms and dropouts sit between (``sequence``) trains two epochs with clipping
and dropout 0.1 on the residual stream, at tp=2 (also recomputing), tp=4 and pp=2 x tp=2 (1F1B,
ZB-H1 recomputing, interleaved recomputing, GPipe on batches of two lengths): every step's loss
and every weight equal one device's (1e-5; pipe_tp on one process with the same micro-batches and
layer-seeded dropout, or at tp=2 with the default stream Lightning's own loop), norms and
row-parallel biases equal on every tensor rank, stages exchange this rank's part of the sequence,
and a block makes an all-gather and a reduce-scatter per region forward and backward (plus the
column layers' second all-gather of the part they saved), no all-reduce. Layer level, at tp=2 and
tp=4, fp32 and bf16: every way the whole sequence reaches a layer (a module gathered for its column
layers with a norm inside, a column layer gathering for itself, a head gathered to compute whole)
equals the unsplit network. Checkpoints move between runs with and without it. A sequence the
tensor ranks cannot split evenly is refused at the first step; plans that do not account for the
sequence split are refused by name.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from lightning_pipe.tensor_parallel.plan import resolve_plan
from lightning_pipe.tensor_parallel.regions import count_collectives, sequence_active
from tests.distributed import run_distributed
from tests.gpt_models import DIM, SEQ, SEQUENCE_PLAN, TinyGPT, token_data
from tests.trainers import fit

TOL = 1e-5
DATA = token_data(32)


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


def _varying() -> DataLoader:
    """Two batches of 8 tokens, then two of 4, in this order (the pipeline's exchanges change
    shape between steps; no distributed sampler reorders them)."""
    ids, targets = DATA.tensors
    samples = [(ids[i], targets[i]) if i < 16 else (ids[i, :4], targets[i, :4]) for i in range(32)]
    return DataLoader(samples, batch_size=8)  # type: ignore[arg-type]


def _data(options: dict[str, Any]) -> tuple[DataLoader, dict[str, Any]]:
    """The loader a case trains on (``options["data"]``: ``"varying"`` or, by default, DATA) and
    the Trainer settings it needs."""
    if options.get("data") == "varying":
        return _varying(), {"use_distributed_sampler": False}
    return _loader(DATA, False), {}


class Losses(L.Callback):
    """Every training step's loss, as the step returned it."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.values.append(float(outputs["loss"]))


def sequence_worker(pp: int, tp: int, dropout: float, options: dict[str, Any]) -> dict[str, Any]:
    # A seed an earlier test set with seed_everything (inherited through the environment) would
    # re-seed the default generator at setup (Lightning's reset_seed), and the masks would differ
    # from the reference's, which starts from the model's own seed.
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(0)
    model = SequenceGPT(dropout=dropout)
    loader, settings = _data(options)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, sequence_parallel=True,
        timeout=timedelta(seconds=90), **{k: v for k, v in options.items() if k != "data"},
    )  # fmt: skip
    lengths: dict[int, set[int]] = {}  # layer -> the sequence lengths of its training inputs
    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda m, args, k=k: (
                lengths.setdefault(k, set()).add(args[0].shape[1])
                if m.training and sequence_active()
                else None
            )
        )
    losses = Losses()
    fit(model, strategy, pp * tp, loader, max_epochs=2, gradient_clip_val=0.5, callbacks=[losses], **settings)
    runtime = strategy.runtime
    # What each stage but the first receives: the input of its first layer.
    received = {
        k: lengths[k] for s in runtime.stage_indices if s > 0 for k in [runtime.partition.layer_range(s)[0]]
    }
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
        "received": received,
        "losses": losses.values,
    }


def reference_worker(dropout: float, options: dict[str, Any] | None) -> dict[str, Any]:
    """One device: pipe_tp on one process with the run's micro-batches and layer-seeded dropout
    (``options``), or Lightning's own loop (``None``); its weights and losses."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(0)
    model = SequenceGPT(dropout=dropout)
    losses = Losses()
    if options is None:
        fit(model, "auto", 1, _loader(DATA, True), max_epochs=2, gradient_clip_val=0.5, callbacks=[losses])
    else:
        loader, settings = _data(options)
        engine = {k: v for k, v in options.items() if k != "data"}
        strategy = PipeTPStrategy(pipeline_parallel_size=1, **engine)
        fit(model, strategy, 1, loader, max_epochs=2, gradient_clip_val=0.5, callbacks=[losses], **settings)
    return {"state": model.state_dict(), "losses": losses.values}


def _reference(dropout: float, options: dict[str, Any] | None) -> dict[str, Any]:
    """One device, in a fresh process like the ranks (the random stream of dropout must not
    depend on what earlier tests left in the test process)."""
    return run_distributed(reference_worker, 1, dropout, options, timeout=120, init_group=False)[0]


def _one_device(options: dict[str, Any]) -> dict[str, Any] | None:
    """What the one-device run shares with ``options``: the micro-batches and, with layer-seeded
    dropout (sequence parallelism's default), the seeding; without it, Lightning's own loop
    (whole batches, the default random stream, which SequenceDropout's whole-sequence draw
    follows)."""
    if options.get("layer_seeded_dropout") is False:
        return None
    shared = {k: options[k] for k in ("num_microbatches", "data") if k in options}
    return {**shared, "layer_seeded_dropout": True}


CASES = [
    (1, 2, 0.1, {"num_microbatches": 1}),
    (1, 2, 0.1, {"num_microbatches": 2, "recompute": "always"}),
    (1, 4, 0.1, {"num_microbatches": 1}),
    (2, 2, 0.1, {"num_microbatches": 2}),
    (2, 2, 0.1, {"num_microbatches": 4, "schedule": "zb_h1", "recompute": "always"}),
    (2, 2, 0.1, {"num_microbatches": 4, "schedule": "interleaved_1f1b", "recompute": "except_last"}),
    (2, 2, 0.1, {"num_microbatches": 2, "schedule": "gpipe", "data": "varying"}),
    (1, 2, 0.1, {"num_microbatches": 1, "layer_seeded_dropout": False}),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("pp", "tp", "dropout", "options"),
    CASES,
    ids=[
        "tp2",
        "tp2-recompute",
        "tp4",
        "pp2xtp2-1f1b",
        "pp2xtp2-zbh1-recompute",
        "pp2xtp2-interleaved-recompute",
        "pp2xtp2-gpipe-varying-lengths",
        "tp2-default-stream-vs-lightning",
    ],
)
def test_sequence_parallel_fit_matches_one_device(
    pp: int, tp: int, dropout: float, options: dict[str, Any]
) -> None:
    got = run_distributed(sequence_worker, pp * tp, pp, tp, dropout, options, timeout=300, init_group=False)
    expected = _reference(dropout, _one_device(options))
    state = got[0]["state"]
    assert state.keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=key)
    assert len(expected["losses"]) == 8
    for r in got:  # every step's loss, on every rank
        torch.testing.assert_close(r["losses"], expected["losses"], atol=TOL, rtol=0)
    by_stage: dict[int, list[dict[str, torch.Tensor]]] = {}
    for r in got:  # norms and row-parallel biases: equal on every tensor rank (their gradients summed)
        by_stage.setdefault(r["coords"].pp_rank, []).append(r["replicated"])
    for copies in by_stage.values():
        assert any("ln" in n for n in copies[0]), "the stage holds norms"
        for other in copies[1:]:
            for name, value in copies[0].items():
                torch.testing.assert_close(other[name], value, atol=0, rtol=0, msg=name)
    # Stages exchange this rank's part of the sequence.
    received = [lengths for r in got for lengths in r["received"].values()]
    if pp > 1:
        assert all(r["received"] for r in got if r["coords"].pp_rank == pp - 1), received
    parts = {SEQ // tp, 4 // tp} if options.get("data") == "varying" else {SEQ // tp}
    assert all(lengths == parts for lengths in received), received
    counted = [r["counts"] for r in got if r["counts"]]
    assert counted
    for counts in counted:
        # attention: gather (its module), reduce-scatter (proj); MLP: gather (its first layer),
        # reduce-scatter (its last); backward the opposite, and the column layers, which saved
        # only their part of the sequence, gather it again for their weights' gradients.
        # Megatron's pattern: no all-reduce anywhere in the block.
        assert counts == {
            "sequence_all_gather_forward": 2,
            "sequence_reduce_scatter_forward": 2,
            "sequence_reduce_scatter_backward": 2,
            "sequence_all_gather_backward": 2,
            "sequence_all_gather_recompute": 2,
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


# ----------------------------------------------------------------------------- layer level
# A network whose plan uses every way the whole sequence reaches a layer: a module gathered for
# its column layers, which hold a norm (computed whole) and a column layer fed by it (not the
# gathered tensor itself); a column layer that gathers its own input; a head gathered to compute
# whole (no column layer); the split after a layer computed whole.
W, B2, S2 = 8, 2, 8
NET_PLAN = {
    "pre": "sequence_scatter",
    "ln": "sequence",
    "mix": "sequence_gather",
    "mix.a": "colwise",
    "mix.b": "colwise",
    "mix.out": "rowwise",
    "fc": "colwise",
    "fc2": "rowwise",
    "head": "sequence_gather",
}


class Mixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(W)
        self.a = torch.nn.Linear(W, 2 * W)
        self.b = torch.nn.Linear(W, 2 * W, bias=False)
        self.out = torch.nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.a(x)) * self.b(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.pre, self.ln, self.mix = torch.nn.Linear(W, W), torch.nn.LayerNorm(W), Mixer()
        self.fc, self.fc2 = torch.nn.Linear(W, 2 * W), torch.nn.Linear(2 * W, W)
        self.head = torch.nn.Linear(W, 3)
        with torch.no_grad():  # norms that are not the identity, so that wrong sums show
            for p in (self.ln.weight, self.ln.bias, self.mix.norm.weight, self.mix.norm.bias):
                p.add_(torch.randn_like(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        h = h + self.mix(self.ln(h))
        h = h + self.fc2(torch.relu(self.fc(h)))
        return self.head(h)


def _net_input() -> torch.Tensor:
    return torch.randn(B2, S2, W, generator=torch.Generator().manual_seed(5), requires_grad=True)


def _net_reference(bf16: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    net, x = Net(), _net_input()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = net(x)
    out.float().square().sum().backward()
    return out.detach().float(), x.grad, {n: p.grad for n, p in net.named_parameters()}


def net_worker(bf16: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_pipe.tensor_parallel import apply_plan

    group = dist.group.WORLD
    net = Net()
    resolved = resolve_plan(net, NET_PLAN, dist.get_world_size(), sequence_parallel=True)
    apply_plan(net, resolved, group, seed=0, sequence_parallel=True)
    x = _net_input()
    with count_collectives() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = net(x)
        out.float().square().sum().backward()
    grads = {}
    for name, p in net.named_parameters():
        grad = p.grad.clone()
        # What the runtime sums over the tensor group: norms between the regions, row biases.
        if name.startswith("ln.") or name in ("mix.out.bias", "fc2.bias"):
            dist.all_reduce(grad, group=group)
        grads[name] = (grad, tensor_parallel_dim(p))
    return {"out": out.detach().float(), "x_grad": x.grad, "grads": grads, "counts": dict(counter)}


@pytest.mark.distributed
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_way_the_sequence_is_gathered_equals_the_whole_network(tp: int, bf16: bool) -> None:
    expected_out, expected_x, expected = _net_reference(bf16)
    tol = 3e-2 if bf16 else 1e-5
    for rank, got in enumerate(run_distributed(net_worker, tp, bf16, timeout=120)):
        torch.testing.assert_close(got["out"], expected_out, atol=tol, rtol=tol)
        torch.testing.assert_close(got["x_grad"], expected_x, atol=tol, rtol=tol)
        for name, (grad, dim) in got["grads"].items():
            want = expected[name] if dim is None else expected[name].chunk(tp, dim)[rank]
            torch.testing.assert_close(grad, want, atol=tol, rtol=tol, msg=name)
        # mix.b is fed by the norm inside mix, not by the gathered tensor: plain tensor parallelism
        # there (one all-reduce backward); every other column layer saves only its part.
        assert got["counts"] == {
            "sequence_all_gather_forward": 3,  # mix, fc, head
            "sequence_reduce_scatter_forward": 2,  # mix.out, fc2
            "sequence_all_gather_backward": 3,  # fc2, mix.out, pre's split
            "sequence_all_gather_recompute": 2,  # fc, mix.a
            "sequence_reduce_scatter_backward": 2,  # fc, mix's gather
            "all_reduce_backward": 1,  # mix.b
        }, got["counts"]


# ----------------------------------------------------------------------------- checkpoints
class PlainGPT(SequenceGPT):
    """SequenceGPT's tensor-parallel plan without its sequence-parallel entries."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {k: v for k, v in SEQUENCE_PLAN.items() if not v.startswith("sequence")}


def checkpoint_worker(root: str, sequence: bool, resume: str | None) -> dict[str, torch.Tensor]:
    """One epoch at tp=2 with or without sequence parallelism, saving a checkpoint (or, from
    ``resume``, the second epoch); the whole weights at the end."""
    import lightning as L

    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(0)
    model = SequenceGPT() if sequence else PlainGPT()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=1, tensor_parallel_size=2, sequence_parallel=sequence,
        num_microbatches=1, timeout=timedelta(seconds=90),
    )  # fmt: skip
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, filename="last", save_on_train_epoch_end=True)
    fit(
        model, strategy, 2, _loader(DATA, False), root, resume, max_epochs=1 if resume is None else 2,
        gradient_clip_val=0.5, enable_checkpointing=True, callbacks=[cb],
    )  # fmt: skip
    return gather_model_state(model, strategy.runtime.partition, strategy.mesh)


@pytest.mark.distributed
@pytest.mark.parametrize("first", [True, False], ids=["with-then-without", "without-then-with"])
def test_checkpoints_move_between_runs_with_and_without_sequence_parallelism(
    tmp_path: Any, first: bool
) -> None:
    """Sequence parallelism changes no parameter: an epoch with it (or without), saved, then
    resumed for a second epoch without it (or with), ends at two epochs of one device."""
    run_distributed(checkpoint_worker, 2, str(tmp_path / "a"), first, None, timeout=200, init_group=False)
    saved = tmp_path / "a" / "last.ckpt"
    assert saved.exists()
    got = run_distributed(
        checkpoint_worker, 2, str(tmp_path / "b"), not first, str(saved), timeout=200, init_group=False
    )[0]
    expected = _reference(0.0, None)["state"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=0, msg=key)


def recomputed_parts_worker() -> dict[bool, int]:
    """In one process, a fake two-rank group: whether the part of the sequence a gathered module's
    column layers saved is still alive after a forward, without and with recomputation."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import checkpoint

    from lightning_pipe.tensor_parallel import apply_plan

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    alive = {}
    for recompute in (False, True):
        net = Net()
        resolved = resolve_plan(net, NET_PLAN, 2, sequence_parallel=True)
        apply_plan(net, resolved, dist.group.WORLD, seed=0, sequence_parallel=True)
        parts: list[Any] = []
        net.ln.register_forward_hook(lambda m, a, out, parts=parts: parts.append(weakref.ref(out)))
        x = _net_input()
        out = checkpoint(net, x, use_reentrant=False) if recompute else net(x)
        gc.collect()
        alive[recompute] = sum(ref() is not None for ref in parts)
        del out
    dist.destroy_process_group()
    return alive


@pytest.mark.distributed
def test_recomputation_frees_the_parts_column_layers_save() -> None:
    """The part ``mix``'s column layers save (``ln``'s output) lives until backward without
    recomputation, and not at all with it (the shared second gather holds no activation)."""
    assert run_distributed(recomputed_parts_worker, 1, timeout=60, init_group=False)[0] == {False: 1, True: 0}
