"""No host synchronisation inside a training step (issue 44, item 1).

On CUDA every read of a device tensor's value on the host (``.item()``, ``float(t)``,
``torch.equal``, a ``.cpu()`` copy, a data-dependent shape...) stalls the host until the device
drains, so the next kernels and the next micro-batch's exchanges are not queued ahead.
:class:`tests.host_syncs.HostSyncCounter` counts, on the CPU, what would stall on CUDA.

Each configuration fits 10 training steps through the Lightning path users run
(``Trainer(strategy=PipeTPStrategy(...))``), the counter active inside the strategy's
``training_step`` (the whole engine step ``runtime.train_batch`` plus the strategy's own work
around it: replaying the logged values, returning the loss). The first step is not checked: it
runs the first-batch checks (the forward contract, the pipeline's header rounds, learning where a
Hugging Face model's inputs are in the batch), which read the device once. Every later step must
have no sync but those in :data:`ALLOWED`, each with its reason.

Two launches: pp=2 (world 2) under GPipe, 1F1B, interleaved 1F1B and ZB-H1, with skip connections
(the example U-Net) and a Hugging Face Llama (padded batches: the loss is weighted by tokens);
and world 4: pp=2 x tp=2 with sequence parallelism, pp=2 x dp=2 with ZeRO-1, pp=2 x dp=2 with
FSDP2 (the GPT, and the Llama: its token counts summed over the replicas).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed
from tests.host_syncs import HostSyncCounter
from tests.trainers import fit

STEPS, BATCH = 10, 8

ALLOWED: dict[tuple[str, str, str], str] = {
    ("bool", "lightning_pipe/huggingface/context.py", "masks"): (
        "Hugging Face's own code: transformers' create_masks_for_generate reads whether the attention "
        "mask pads (to take SDPA's is_causal shortcut), once per micro-batch and stage, as one device "
        "reads it once per forward"
    ),
    ("cpu", "lightning_pipe/runtime/step.py", "host_facts"): (
        "Hugging Face models (a loss averaged over tokens): the batch's token counts, with the kind of "
        "batch in the same copy, reach the host once per step before the schedule: each micro-batch's "
        "loss, logged values and Lightning's epoch weights are its share of the tokens, host numbers"
    ),
    ("tolist", "lightning_pipe/experts/dispatch.py", "dispatch_combine"): (
        "Expert parallelism (expert_parallel_size > 1): the dropless dispatch's split sizes, how many "
        "rows go to and come from each rank of the expert group, reach the host once per "
        "mixture-of-experts layer and forward (all_to_all_single takes host split sizes), as in "
        "Megatron-Core's and torchtitan's dropless all-to-all dispatchers"
    ),
}
"""(what, the file and the function where it is made) -> why it stays. Nothing else may wait."""


def _allowed(sync: str) -> bool:
    return any(
        sync.startswith(f"{what} at {path}:") and sync.endswith(f" {function}")
        for what, path, function in ALLOWED
    )


# ---------------------------------------------------------------------------------------- counter
def test_the_counter_sees_each_kind_of_read_and_not_host_tensors() -> None:
    counter = HostSyncCounter()
    x = torch.arange(6.0, device="cpu")
    with counter.counting() as syncs:
        bool(x.sum() > 0)
        float(x[0])
        int(x[1])
        [0, 1][x[1].long()]
        x.tolist()
        x.max().item()
        torch.equal(x, x)
        x[x > 2]
        x.nonzero()
        x.unique()
        torch.repeat_interleave(x.long())
        f"{x[0]:.3f}"
        host = x.cpu()
        float(host.sum()), host.tolist()  # on the host already: the copy counted once
        made = torch.tensor([1.0, 2.0])  # from Python data, no device: on the host
        float(made.sum())
        x.to(x.device)  # to the device it is on: no copy
        x.masked_fill(x > 2, 0.0)  # same shape whatever the values
        into = torch.empty(6)  # on the host
        into.copy_(x)  # a blocking copy from the device waits
        into.copy_(x, non_blocking=True)  # queued (its reader waits on an event, for its prefix)
        float(into.sum())
    kinds = [s.what for s in syncs]
    assert kinds == [
        "bool", "float", "int", "index", "tolist", "item", "equal", "boolean indexing", "nonzero",
        "unique", "repeat_interleave", "format", "cpu", "copy to the host",
    ], kinds  # fmt: skip
    assert all(s.where.startswith("tests/test_host_syncs.py:") for s in syncs), syncs
    with counter.counting() as quiet:
        float(x.sum())
    assert [s.what for s in quiet] == ["float"] and counter.per_step()[1] == {str(quiet[0]): 1}


# ---------------------------------------------------------------------------------------- models
class HuggingFaceStep(L.LightningModule):
    """A Hugging Face Llama called the Hugging Face way (``self.model(**batch).loss``)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.hf_families import build

        self.model = build("llama")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gpt(sequence: bool = False) -> tuple[L.LightningModule, DataLoader]:
    from tests.gpt_models import TinyGPT, token_data

    if sequence:
        from tests.test_sequence_parallel import SequenceGPT

        model: L.LightningModule = SequenceGPT()
    else:
        model = TinyGPT()
    return model, DataLoader(token_data(STEPS * BATCH), batch_size=BATCH)


def _unet() -> tuple[L.LightningModule, DataLoader]:
    from tests.test_skip_schedules import load_example

    models: Any = load_example()
    return models.UNet(), DataLoader(models.shapes_dataset(STEPS * BATCH), batch_size=BATCH)


def _llama() -> tuple[L.LightningModule, DataLoader]:
    from tests.hf_families import batches

    rows = [{k: v[i] for k, v in b.items()} for b in batches("padded", STEPS, BATCH) for i in range(BATCH)]
    return HuggingFaceStep(), DataLoader(rows, batch_size=BATCH)  # type: ignore[arg-type]


MODELS = {"gpt": _gpt, "sequence_gpt": lambda: _gpt(True), "unet": _unet, "llama": _llama}

CONFIGS: dict[str, tuple[int, str, dict[str, Any]]] = {
    # name: (world size, model, strategy options)
    "pp=2 gpipe": (2, "gpt", {"schedule": "gpipe"}),
    "pp=2 1f1b": (2, "gpt", {"schedule": "1f1b"}),
    "pp=2 interleaved (v=2)": (2, "gpt", {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
    "pp=2 zb_h1": (2, "gpt", {"schedule": "zb_h1"}),
    "pp=2 skips (U-Net)": (2, "unet", {}),
    "pp=2 Hugging Face Llama": (2, "llama", {}),
    # World 4: what the tensor and data axes add to a step, each micro-batch's (two of them: the
    # schedules' steady states, where more micro-batches take other paths, are the pp=2 runs').
    "pp=2 x tp=2 sequence parallel": (
        4,
        "sequence_gpt",
        {"tensor_parallel_size": 2, "sequence_parallel": True, "num_microbatches": 2},
    ),
    "pp=2 x dp=2 ZeRO-1": (
        4,
        "gpt",
        {"data_parallel_size": 2, "shard_optimizer_state": True, "num_microbatches": 2},
    ),
    "pp=2 x dp=2 FSDP2": (
        4,
        "gpt",
        {"data_parallel_size": 2, "shard_parameters": True, "num_microbatches": 2},
    ),
    # Token counts summed over the replicas, and FSDP2's agreement whether a batch kind is new.
    "pp=2 x dp=2 FSDP2 Hugging Face Llama": (
        4,
        "llama",
        {"data_parallel_size": 2, "shard_parameters": True, "num_microbatches": 2},
    ),
}


def worker(names: list[str]) -> dict[str, list[dict[str, int]]]:
    """Fit each configuration for :data:`STEPS` steps; each step's syncs, by configuration."""
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])  # a fit's teardown takes it out of the environment
    out = {}
    for name in names:
        _, model_name, options = CONFIGS[name]
        L.seed_everything(0, verbose=False)
        model, data = MODELS[model_name]()
        settings = {"num_microbatches": 4, **options}  # four unless the configuration says
        strategy = PipeTPStrategy(pipeline_parallel_size=2, timeout=timedelta(seconds=90), **settings)
        counter = HostSyncCounter()
        counter.wrap(strategy, "training_step")
        fit(model, strategy, world, data, max_steps=STEPS)
        out[name] = counter.per_step()
    return out


def _table(results: list[dict[str, list[dict[str, int]]]]) -> str:
    """Per configuration and rank: syncs in step 0, and the most in any later step, with where."""
    lines = []
    for name in results[0]:
        for rank, result in enumerate(results):
            steps = result[name]
            later = max((sum(s.values()) for s in steps[1:]), default=0)
            lines.append(f"{name:32} rank {rank}: step 0: {sum(steps[0].values()):3}, later steps: {later:3}")
            worst = max(steps[1:], key=lambda s: sum(s.values()), default={})
            lines += [f"      {n} x {sync}" for sync, n in sorted(worst.items())]
            first = [f"{n} x {sync}" for sync, n in sorted(steps[0].items()) if sync not in worst]
            lines += [f"      step 0 only: {line}" for line in first]
    return "\n".join(lines)


def _check(results: list[dict[str, list[dict[str, int]]]]) -> None:
    print(_table(results))
    for name in results[0]:
        for rank, result in enumerate(results):
            steps = result[name]
            assert len(steps) == STEPS, (name, rank, len(steps))
            for i, step in enumerate(steps[1:], start=1):
                counts = [n for sync, n in step.items() if sync.endswith(" host_facts")]
                assert sum(counts) <= 1, f"{name}, rank {rank}, step {i}: the batch's facts copied {counts}"
                extra = {sync: n for sync, n in step.items() if not _allowed(sync)}
                assert not extra, f"{name}, rank {rank}, step {i}: host syncs {extra}\n{_table(results)}"


@pytest.mark.distributed
def test_no_host_sync_after_the_first_step_at_pp2() -> None:
    names = [n for n, (world, _, _) in CONFIGS.items() if world == 2]
    _check(run_distributed(worker, 2, names, timeout=400, init_group=False))


@pytest.mark.distributed
def test_no_host_sync_after_the_first_step_with_tensor_and_data_parallelism() -> None:
    names = [n for n, (world, _, _) in CONFIGS.items() if world == 4]
    _check(run_distributed(worker, 4, names, timeout=400, init_group=False))
