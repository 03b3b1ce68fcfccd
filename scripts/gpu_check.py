"""The project's GPU check: pipe_tp on one CUDA device against ``strategy="auto"``.

    python scripts/gpu_check.py                 # on a machine with an NVIDIA GPU (NCCL, bf16)
    python scripts/gpu_check.py --cpu           # reduced: CPU, gloo, small sizes (what CI runs)
    python scripts/gpu_check.py --json out.json # also write the results as JSON

Five sections, each a row group of the printed table:

* ``throughput``: the example GPT (``examples/gpt``) at pp=1 under ``pipe_tp`` and under
  ``strategy="auto"``, bf16-mixed on CUDA (fp32 on the CPU): tokens/s, MFU (model FLOPs per token
  from the model's shape, against the device's dense bf16 peak) and peak memory, and the ratio of
  step times pipe_tp / auto (goal <= 1.03); and pipe_tp with ``compile=True`` (each layer compiled;
  ``aot_eager`` on the CPU), its step time against eager.
* ``equality``: a one-rank world through ``PipeTPStrategy(process_group_backend="nccl")`` (gloo on
  the CPU) with every schedule kind and recomputation mode at pp=1, and with compiled layers under
  1F1B and ZB-H1, fp32, weights after a few SGD steps against ``auto`` (1e-5).
* ``large``: a decoder of >= 300M parameters (bf16, SDPA) at pp=1 under ``pipe_tp``: MFU (goal
  >= 40% on an H100-class GPU). Reduced to a small decoder on the CPU (the path, not the figure).
* ``host syncs``: the example GPT's training steps under each schedule one device runs (GPipe,
  1F1B, ZB-H1; two micro-batches; pp=1), every step after the first under
  ``torch.cuda.set_sync_debug_mode("error")``: a step that makes the host wait for the device
  fails its row with the call that did (``tests/test_host_syncs.py`` counts the same calls on the
  CPU at pp=2, tensor, sequence and data parallelism). On the CPU the steps run without the mode.
* ``device paths``: dropout masks replayed for recomputation and the zero-bubble input/weight
  split on the device's RNG (weights equal to no recomputation); a meta-built stage materialised
  directly on the device (parameters there; host memory growth during setup against the stage's
  size); a recorded step's timeline, whose compute spans come from CUDA events on the stream
  (most of a pp=1 step; host-timed they would be the launches); and what is not implemented yet
  (pinned host memory for checkpoint reads), reported as such rather than skipped silently.

One process, one device: NCCL refuses two ranks of one communicator on one GPU, so multi-rank
NCCL paths (pipeline exchanges, the data-parallel reducer, tensor-parallel collectives) are not
covered here; ``docs/gpu.md`` lists them with what reading torch's NCCL semantics found.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from gpt_model import MODEL_VOCAB, CharGPT  # noqa: E402

from lightning_pipe import PipeTPStrategy  # noqa: E402

# Dense bf16 peaks (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


@dataclass
class Row:
    section: str
    name: str
    status: str  # "ok", "FAIL", "missing" (not implemented), "n/a" (cannot run here), "info"
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setup:
    device: str
    backend: str
    precision: str
    steps: int
    batch: int
    seq_len: int
    gpt: dict[str, int]
    large: dict[str, int]


def _setup(cpu: bool) -> Setup:
    if cpu:
        return Setup(
            device="cpu",
            backend="gloo",
            precision="32-true",
            steps=6,
            batch=8,
            seq_len=32,
            gpt=dict(d_model=64, n_heads=4, n_layers=2, max_len=64),
            large=dict(d_model=96, n_heads=4, n_layers=2, max_len=64),
        )
    return Setup(
        device="cuda",
        backend="nccl",
        precision="bf16-mixed",
        steps=30,
        batch=32,
        seq_len=256,
        gpt=dict(d_model=512, n_heads=8, n_layers=8, max_len=256),
        large=dict(d_model=1024, n_heads=16, n_layers=24, max_len=1024),  # 302M parameters
    )


def flops_per_token(model: dict[str, int], seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of CharGPT: 6 x the matrix
    parameters plus causal attention's scores and values (PaLM's appendix B, halved for the mask
    as FlashAttention's papers count it)."""
    d, layers = model["d_model"], model["n_layers"]
    matrices = layers * 12 * d * d + d * MODEL_VOCAB
    return 6 * matrices + 6 * layers * seq_len * d


class _Timer(L.Callback):
    """Step times after the first two (warm-up: allocator, autotuning, lazy initialisation)."""

    def __init__(self, device: str) -> None:
        self.device, self.times, self._start = device, [], 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync()
        if trainer.global_step > 2:
            self.times.append(time.perf_counter() - self._start)


def _data(setup: Setup, steps: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL_VOCAB, (steps * setup.batch, setup.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=setup.batch)


def _trainer(setup: Setup, strategy: Any, precision: str, steps: int, **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu" if setup.device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # one order for both strategies
        **kw,
    )


def _pipe_tp(setup: Setup, **options: Any) -> PipeTPStrategy:
    return PipeTPStrategy(
        pipeline_parallel_size=1,
        process_group_backend=setup.backend,
        timeout=timedelta(seconds=120),
        **options,
    )


def _peak_memory(device: str) -> float | None:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def _run_throughput(setup: Setup, model_shape: dict[str, int], strategy: Any, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = CharGPT(**model_shape, warmup_steps=1)
    timer = _Timer(setup.device)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = _trainer(setup, strategy, setup.precision, steps, callbacks=[timer])
    trainer.fit(model, _data(setup, steps))
    step = sorted(timer.times)[len(timer.times) // 2]  # the median step
    tokens = setup.batch * setup.seq_len / step
    peak = _peak_flops(setup.device)
    mfu = tokens * flops_per_token(model_shape, setup.seq_len) / peak if peak else None
    return {"step_s": step, "tokens_per_s": tokens, "mfu": mfu, "peak_mib": _peak_memory(setup.device)}


def _peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def check_throughput(setup: Setup) -> list[Row]:
    # One micro-batch: at pp=1 there is no pipeline to fill, so the batch runs whole, as under auto.
    ours = _run_throughput(setup, setup.gpt, _pipe_tp(setup, num_microbatches=1), setup.steps)
    theirs = _run_throughput(setup, setup.gpt, "auto", setup.steps)
    ratio = ours["step_s"] / theirs["step_s"]
    compiled = _run_throughput(
        setup, setup.gpt, _pipe_tp(setup, num_microbatches=1, compile=_compile(setup)), setup.steps
    )
    speedup = compiled["step_s"] / ours["step_s"]
    rows = [
        Row("throughput", "example GPT, pipe_tp pp=1", "info", ours),
        Row("throughput", "example GPT, auto", "info", theirs),
        Row("throughput", f"example GPT, pipe_tp pp=1, compile={_compile(setup)}", "info", compiled),
        Row("throughput", "step time compiled / eager (pipe_tp)", "info", {"ratio": speedup}),
    ]
    # The goal is for a GPU; on a shared CPU the ratio is reported, not judged.
    status = "info" if setup.device != "cuda" else ("ok" if ratio <= 1.03 else "FAIL")
    rows.append(Row("throughput", "step time pipe_tp / auto (goal <= 1.03)", status, {"ratio": ratio}))
    return rows


def _final_weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def _fit_weights(setup: Setup, strategy: Any, steps: int, dropout: float = 0.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    kind = _SGDGPT if dropout == 0 else _DropoutGPT
    model = kind(**setup.gpt, warmup_steps=1)
    # Built here, eagerly, so that both strategies start from the same weights (under pipe_tp a
    # model built in configure_model() is initialised stage by stage, the same on every layout but
    # not as one process draws it).
    model.configure_model()
    L.seed_everything(1, verbose=False)
    _trainer(setup, strategy, "32-true", steps).fit(model, _data(setup, steps, seed=3))
    return _final_weights(model)


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max((a[k] - b[k]).abs().max().item() for k in a)


SCHEDULES = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "zb_h1"}]
"""Interleaved 1F1B needs two pipeline ranks or more (its stages alternate between ranks), so one
device cannot run it: a row says so."""
RECOMPUTE = ["never", "except_last", "always"]


def _compile(setup: Setup) -> Any:
    """The ``compile`` option the check uses: inductor on CUDA; on the CPU AOTAutograd without
    code generation (the same graphs and backward split, seconds instead of minutes of C++)."""
    return True if setup.device == "cuda" else {"backend": "aot_eager"}


def check_equality(setup: Setup) -> list[Row]:
    steps = 3
    expected = _fit_weights(setup, "auto", steps)
    rows = []
    for schedule in SCHEDULES:
        for recompute in RECOMPUTE:
            options = {**schedule, "recompute": recompute, "num_microbatches": 2}
            name = f"{schedule['schedule']}, recompute {recompute}"
            try:
                gap = _gap(_fit_weights(setup, _pipe_tp(setup, **options), steps), expected)
            except Exception as err:  # a row per failure, so one broken kind does not hide the rest
                rows.append(Row("equality", name, "FAIL", {"error": f"{type(err).__name__}: {err}"[:300]}))
                continue
            rows.append(Row("equality", name, "ok" if gap <= 1e-5 else "FAIL", {"max_weight_gap": gap}))
    for options in ({"schedule": "1f1b"}, {"schedule": "zb_h1", "recompute": "always"}):
        name = "compiled layers, " + ", ".join(f"{k}={v}" for k, v in options.items())
        strategy = _pipe_tp(setup, num_microbatches=2, compile=_compile(setup), **options)
        try:
            gap = _gap(_fit_weights(setup, strategy, steps), expected)
        except Exception as err:
            rows.append(Row("equality", name, "FAIL", {"error": f"{type(err).__name__}: {err}"[:300]}))
            continue
        rows.append(Row("equality", name, "ok" if gap <= 1e-5 else "FAIL", {"max_weight_gap": gap}))
    try:
        _fit_weights(setup, _pipe_tp(setup, schedule="interleaved_1f1b", virtual_stages=2), 1)
        rows.append(Row("equality", "interleaved_1f1b", "FAIL", {"error": "ran on one rank: compare it"}))
    except Exception as err:
        first = str(err).splitlines()[0][:160]
        rows.append(
            Row("equality", "interleaved_1f1b (needs >= 2 pipeline ranks)", "n/a", {"refused": first})
        )
    return rows


class _NoSyncAfterFirstStep(L.Callback):
    """Wraps the strategy's ``training_step``: every step after the first runs under
    ``torch.cuda.set_sync_debug_mode("error")`` (on CUDA), which raises at any call that makes
    the host wait for the device (the first step's checks may read the device once)."""

    def __init__(self, device: str) -> None:
        self.device, self.steps = device, 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        original = strategy.training_step

        def checked(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            if self.device != "cuda" or self.steps == 1:
                return original(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        strategy.training_step = checked  # type: ignore[method-assign]


def check_host_syncs(setup: Setup) -> list[Row]:
    steps = 4
    rows = []
    for schedule in SCHEDULES:
        name = f"no host sync after the first step: {schedule['schedule']}"
        watch = _NoSyncAfterFirstStep(setup.device)
        torch.manual_seed(0)
        model = CharGPT(**setup.gpt, warmup_steps=1)
        strategy = _pipe_tp(setup, num_microbatches=2, **schedule)
        trainer = _trainer(setup, strategy, setup.precision, steps, callbacks=[watch])
        try:
            trainer.fit(model, _data(setup, steps))
        except Exception as err:  # the mode's error says what synchronised; the traceback where
            ours = [f for f in traceback.extract_tb(err.__traceback__) if "lightning_pipe" in f.filename]
            where = f"{ours[-1].filename.split('lightning_pipe')[-1]}:{ours[-1].lineno}" if ours else "?"
            error = f"{type(err).__name__}: {err}"[:300]
            rows.append(Row("host syncs", name, "FAIL", {"at": where, "error": error}))
            continue
        checked = max(0, watch.steps - 1) if setup.device == "cuda" else 0
        status = "ok" if setup.device == "cuda" else "info"
        note = "sync debug mode: error" if setup.device == "cuda" else "CPU: the mode needs CUDA"
        rows.append(Row("host syncs", name, status, {"steps_checked": checked, "note": note}))
    return rows


def check_large(setup: Setup) -> list[Row]:
    shape = setup.large
    params = shape["n_layers"] * 12 * shape["d_model"] ** 2 + 2 * shape["d_model"] * MODEL_VOCAB
    result = _run_throughput(setup, shape, _pipe_tp(setup, num_microbatches=1), max(6, setup.steps // 2))
    goal = result["mfu"] is not None and result["mfu"] >= 0.40
    status = "info" if setup.device != "cuda" else ("ok" if goal else "FAIL")
    return [
        Row(
            "large", f"decoder {params / 1e6:.1f}M parameters, pipe_tp pp=1 (MFU goal >= 40%)", status, result
        )
    ]


class _SGDGPT(CharGPT):
    """The example GPT trained with plain SGD for the equality rows: Adam divides each gradient
    by its running magnitude, so where a gradient is almost zero (the padded vocabulary's logits)
    float32 rounding of a different micro-batch summation becomes a step of up to the learning
    rate; SGD keeps the comparison to the gradients themselves (as tests/ do)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DropoutGPT(CharGPT):
    """The example GPT with dropout after every block: recomputation must replay the masks."""

    def configure_model(self) -> None:
        super().configure_model()
        assert self.layers is not None
        for block in list(self.layers)[1:-1]:
            block.mlp.append(torch.nn.Dropout(0.2))


def check_device_paths(setup: Setup) -> list[Row]:
    # First: it reads the host's peak memory, which later runs would raise.
    rows = [_check_materialisation(setup)]
    steps = 3
    base = _fit_weights(setup, _pipe_tp(setup, recompute="never", num_microbatches=2), steps, dropout=0.2)
    for options in (
        {"recompute": "always"},
        {"schedule": "zb_h1"},
        {"schedule": "zb_h1", "recompute": "always"},
    ):
        name = "dropout masks replayed: " + ", ".join(f"{k}={v}" for k, v in options.items())
        gap = _gap(
            _fit_weights(setup, _pipe_tp(setup, num_microbatches=2, **options), steps, dropout=0.2), base
        )
        rows.append(Row("device paths", name, "ok" if gap <= 1e-6 else "FAIL", {"max_weight_gap": gap}))
    rows.append(
        Row(
            "device paths",
            "pinned host memory for checkpoint reads",
            "missing",
            {"note": "not implemented: pretrained and checkpoint tensors are read to pageable memory"},
        )
    )
    rows.append(_check_timeline(setup))
    return rows


def _check_timeline(setup: Setup) -> Row:
    """A recorded step's compute share (pp=1: the step is its forwards and backwards): timed by
    CUDA events on the stream (docs/gpu.md F4) it is most of the step; timed by the host it would
    be the kernels' launch, a small part of it."""
    steps = 3
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "timeline.json"
        torch.manual_seed(0)
        strategy = _pipe_tp(setup, num_microbatches=2, timeline=str(trace))
        trainer = _trainer(setup, strategy, setup.precision, steps)
        trainer.fit(CharGPT(**setup.gpt, warmup_steps=1), _data(setup, steps))
        spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    compute = [e for e in spans if e.get("cat") == "compute"]
    start, end = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    share = sum(e["dur"] for e in compute) / (end - start)
    values = {"compute_share": share, "spans": len(spans), "positive": all(e["dur"] > 0 for e in compute)}
    name = "timeline spans from CUDA events (compute share of a pp=1 step >= 0.5)"
    if setup.device != "cuda":
        return Row("device paths", name, "info", {**values, "note": "CPU: the host's clock"})
    return Row("device paths", name, "ok" if share >= 0.5 and values["positive"] else "FAIL", values)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Placement(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.devices = {p.device.type for p in pl_module.parameters()}
        self.bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        self.rss_after = _rss_mib()


def _check_materialisation(setup: Setup) -> Row:
    """A meta-built stage materialised on the device: every parameter there, and the host's peak
    resident memory grown by less than the stage's size during setup (no host copy)."""
    if setup.device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context's host memory is not the stage's
    torch.manual_seed(0)
    model, placement = CharGPT(**setup.large, warmup_steps=1), _Placement()
    before = _rss_mib()
    _trainer(setup, _pipe_tp(setup), setup.precision, 1, callbacks=[placement]).fit(model, _data(setup, 1))
    stage_mib = placement.bytes / 2**20
    growth = placement.rss_after - before
    on_device = placement.devices == {setup.device}
    # On the CPU the device is the host, so the growth is the stage itself: only the placement counts.
    ok = on_device and (setup.device != "cuda" or growth < 0.5 * stage_mib)
    values = {
        "parameter_devices": sorted(placement.devices),
        "stage_mib": stage_mib,
        "host_peak_growth_mib": growth,
    }
    return Row("device paths", "meta-built stage materialised on the device", "ok" if ok else "FAIL", values)


def _versions() -> dict[str, Any]:
    import lightning

    info: dict[str, Any] = {"torch": torch.__version__, "lightning": lightning.__version__}
    if torch.cuda.is_available():
        info.update(
            device=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    else:
        info["device"] = "cpu"
    return info


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_table(rows: list[Row], versions: dict[str, Any]) -> None:
    print(" ".join(f"{k}={v}" for k, v in versions.items()))
    width = max(len(r.name) for r in rows)
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            print(f"\n[{section}]")
        values = ", ".join(f"{k} {_format(v)}" for k, v in row.values.items())
        print(f"  {row.name:<{width}}  {row.status:<7}  {values}")


SECTIONS = {
    "device paths": check_device_paths,  # first: its host-memory figure is a process peak
    "throughput": check_throughput,
    "equality": check_equality,
    "host syncs": check_host_syncs,
    "large": check_large,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU form (gloo, small sizes)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--sections", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu for the reduced check")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    warnings.filterwarnings("ignore")
    setup = _setup(args.cpu)
    rows: list[Row] = []
    for name in args.sections:
        rows += SECTIONS[name](setup)
    versions = _versions()
    print_table(rows, versions)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"versions": versions, "setup": asdict(setup), "rows": [asdict(r) for r in rows]}, indent=1
            )
        )
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
