"""The structure that keeps the code readable: the engine without Lightning, no import cycle, one
engine call per Lightning hook.

* ``import lightning_pipe.runtime`` (or the whole package) in a fresh interpreter imports no
  Lightning, and ``"pipe_tp"`` is still registered once Lightning loads, whichever comes first.
* Only ``lightning_pipe/strategy/`` (the adapter) and ``lightning_pipe/modules/`` (ready
  LightningModules) import ``lightning``; no module of the package imports
  (directly or not) a module that imports it back; each package imports only what the map in
  ``docs/architecture.md`` allows it.
* ``schedule/`` stays data in one process (no ``torch.distributed``), and no module of
  ``execution/`` or ``schedule/`` holds more than a few hundred lines (one concept per module).
* Under ``Trainer.fit``, the adapter calls the engine at most three times per training step
  (``begin_accumulation``, ``train_batch``, ``clip_grad_norm_``), and the engine holds no callback
  into the adapter but the head it is handed per batch.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_engine_imports_no_lightning() -> None:
    out = _fresh(
        "import sys, lightning_pipe.runtime, lightning_pipe\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    assert out.strip() == "[]", out


@pytest.mark.parametrize("first", ["lightning_pipe", "lightning"])
def test_pipe_tp_is_registered_whichever_is_imported_first(first: str) -> None:
    second = "lightning" if first == "lightning_pipe" else "lightning_pipe"
    out = _fresh(
        f"import {first}\nimport {second}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "import lightning as L\n"
        "t = L.Trainer(strategy='pipe_tp', accelerator='cpu', devices=2, logger=False)\n"
        "print(type(t.strategy).__name__, 'pipe_tp' in StrategyRegistry)"
    )
    assert out.strip().splitlines()[-1] == "PipeTPStrategy True", out


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (``from pkg import sub``
    counts as importing ``pkg.sub``; imports inside functions count too, those under ``if
    TYPE_CHECKING:`` do not)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # names used in annotations only are not imports at run time
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_pipe"):
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                found |= set(subs) if len(subs) == len(node.names) else {node.module, *subs}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle() -> None:
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


ALLOWED: dict[str, set[str]] = {
    # docs/architecture.md's table, as data: the package -> the packages it may import.
    "arguments": set(),
    "collectives": set(),
    "mesh": {"arguments"},
    "faults": set(),
    "schedule": {"arguments"},
    "skip": set(),
    "execution": {"schedule", "faults", "arguments", "skip"},
    "partition": {"execution", "arguments", "skip"},
    "batches": {"execution", "mesh", "skip"},
    "data_parallel": {"collectives"},
    "tensor_parallel": {"data_parallel", "collectives", "arguments"},
    "checkpoint": {"partition", "tensor_parallel", "data_parallel", "mesh"},
    "construction": {"checkpoint", "tensor_parallel"},
    "consolidate": {"checkpoint", "mesh", "huggingface"},
}
_ENGINE = set(ALLOWED)
ALLOWED["runtime"] = _ENGINE
ALLOWED["huggingface"] = {"execution", "tensor_parallel", "runtime", "checkpoint"}
ALLOWED["strategy"] = _ENGINE | {"runtime", "huggingface", "_registration"}
ALLOWED["modules"] = set()


def test_packages_import_only_what_the_architecture_map_allows() -> None:
    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    offenders = []
    for module, deps in sorted(_imports().items()):
        own = package(module)
        if own in ("lightning_pipe", "_registration"):
            continue  # the public API lists everything; the registration imports nothing
        for dep in sorted(deps):
            if package(dep) != own and package(dep) not in ALLOWED[own]:
                offenders.append(f"{module} imports {dep}")
    assert offenders == [], "\n".join(offenders) + "\n(see docs/architecture.md)"


def test_only_the_adapter_imports_lightning() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if {"strategy", "modules"} & set(path.relative_to(PACKAGE).parts):
            continue  # the Lightning adapter, and the ready LightningModules
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names):
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == [], offenders


PUBLIC = (
    "begin_accumulation",
    "train_batch",
    "eval_batch",
    "clip_grad_norm_",
    "agree_end",
    "keep_own",
    "logical",
)


class CountEngineCalls(L.Callback):
    """Counts the adapter's calls of the runtime's public methods during each training step."""

    def __init__(self) -> None:
        self.per_step: list[Counter[str]] = []
        self._current: Counter[str] | None = None
        self.adapter_callbacks: list[str] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        for name in PUBLIC:
            method = getattr(runtime, name)

            def counted(*args: Any, __name: str = name, __method: Any = method, **kwargs: Any) -> Any:
                if self._current is not None:
                    self._current[__name] += 1
                return __method(*args, **kwargs)

            setattr(runtime, name, counted)
        # Nothing the engine keeps may call back into the adapter (the head is handed per batch).
        seen: set[int] = set()

        def walk(obj: Any, path: str, depth: int) -> None:
            if id(obj) in seen or depth > 3:
                return
            seen.add(id(obj))
            owner = getattr(obj, "__self__", None)
            module = getattr(getattr(obj, "__func__", obj), "__module__", "") or ""
            if callable(obj) and (module.startswith("lightning_pipe.strategy") or owner is trainer.strategy):
                self.adapter_callbacks.append(path)
            for key, value in getattr(obj, "__dict__", {}).items():
                if key not in ("module", "layers", "parameters", "stages") and not key.startswith("__"):
                    walk(value, f"{path}.{key}", depth + 1)

        walk(runtime, "runtime", 0)

    def on_train_batch_start(self, *args: Any) -> None:
        self._current = Counter()

    def on_train_batch_end(self, *args: Any) -> None:
        assert self._current is not None
        self.per_step.append(self._current)
        self._current = None


def calls_worker(root: str) -> tuple[list[dict[str, int]], list[str]]:
    counter = CountEngineCalls()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    fit(
        Regressor(), strategy, 2, loader(dataset(64, seed=1), 8, reference=False), root,
        max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=[counter],
    )  # fmt: skip
    return [dict(c) for c in counter.per_step], counter.adapter_callbacks


@pytest.mark.distributed
def test_one_engine_call_per_lightning_hook() -> None:
    with tempfile.TemporaryDirectory() as root:
        for per_step, callbacks in run_distributed(calls_worker, 2, root, init_group=False, timeout=120):
            assert callbacks == [], callbacks
            assert len(per_step) == 8  # 4 optimizer steps of 2 accumulated batches
            for k, calls in enumerate(per_step):
                window_start = k % 2 == 0
                expected = {"train_batch": 1} | ({"begin_accumulation": 1} if window_start else {})
                if not window_start:  # the window's last batch: clipping, then the optimizer step
                    expected["clip_grad_norm_"] = 1
                assert calls == expected, (k, calls)
                assert sum(calls.values()) <= 3


TOP_LEVEL = {
    # What a Lightning user and a model author import from the top level; the rest from the
    # subpackage that owns it (lightning_pipe.runtime, .mesh, .schedule, ...).
    "PipeTPStrategy",
    "CausalLMModule",
    "Stash",
    "Pop",
    "stash",
    "pop",
    "skippable",
    "load_from_checkpoint",
    "CheckpointError",
    "ConfigurationError",
    "StepCheckError",
    "ModelCallError",
    "PeerLostError",
}
SUBPACKAGES = (
    "batches",
    "checkpoint",
    "execution",
    "huggingface",
    "mesh",
    "partition",
    "runtime",
    "schedule",
    "skip",
    "tensor_parallel",
)


def test_the_top_level_lists_what_users_and_model_authors_need() -> None:
    import lightning_pipe

    assert set(lightning_pipe.__all__) == TOP_LEVEL
    for name in lightning_pipe.__all__:
        assert getattr(lightning_pipe, name) is not None, name
    # No former names kept for a release that never happened (ShardStyle, ShardedCheckpoint, ...).
    for former in ("ShardStyle", "ShardedCheckpoint", "is_sharded_checkpoint", "CheckpointMode"):
        assert not hasattr(lightning_pipe, former), former
    with pytest.raises(TypeError, match="checkpoint"):
        lightning_pipe.PipeTPStrategy(checkpoint="always")  # type: ignore[call-arg]


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_name_a_subpackage_lists_is_there(package: str) -> None:
    module = importlib.import_module(f"lightning_pipe.{package}")
    names = getattr(module, "__all__", None)
    assert names, f"lightning_pipe.{package} lists no public names"
    for name in names:
        assert hasattr(module, name), f"lightning_pipe.{package}.{name}"


def _imports_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            return True
    return False


def test_schedules_are_data_in_one_process() -> None:
    # Recording a run and syncing the ranks' clocks live beside the executor (execution/timeline.py,
    # execution/clock.py); schedule/ builds, checks, simulates and draws without a process group.
    offenders = [
        str(p.relative_to(PACKAGE)) for p in (PACKAGE / "schedule").rglob("*.py") if _imports_distributed(p)
    ]
    assert offenders == [], offenders


MAX_LINES = 400
SMALL_PACKAGES = ("execution", "schedule")  # one concept per module: a few hundred lines at most


@pytest.mark.parametrize("package", SMALL_PACKAGES)
def test_modules_hold_a_few_hundred_lines_at_most(package: str) -> None:
    sizes = {
        str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
        for p in (PACKAGE / package).rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}, "see docs/architecture.md"
