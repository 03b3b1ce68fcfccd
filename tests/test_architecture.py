"""The structure that keeps the code readable: the engine without Lightning, no import cycle, one
engine call per Lightning hook.

* ``import lightning_pipe.runtime`` (or the whole package) in a fresh interpreter imports no
  Lightning, and ``"pipe_tp"`` is still registered once Lightning loads, whichever comes first.
* Only ``lightning_pipe/strategy/`` (the adapter) and ``lightning_pipe/modules/`` (ready
  LightningModules) import ``lightning``; no module of the package imports
  (directly or not) a module that imports it back, and no package a package that imports it
  back, counting every import (at the top, inside functions, under ``if TYPE_CHECKING:``, by
  name); each package imports only what the map ``ALLOWED`` allows it, and the table in
  ``docs/architecture.md`` is that map.
* No module of ``runtime/``, ``execution/``, ``tensor_parallel/``, ``strategy/`` or ``schedule/`` is over 400
  lines unless ``docs/architecture.md`` says why ("Modules over 400 lines").
* These checks read the source (``tests/import_graph.py``), and each is shown to fail on a
  synthetic violation.
* ``schedule/`` stays data in one process (no ``torch.distributed``).
* Under ``Trainer.fit``, the adapter calls the engine at most three times per training step
  (``begin_accumulation``, ``train_batch``, ``clip_grad_norm_``), and the engine holds no callback
  into the adapter but the head it is handed per batch.
"""

from __future__ import annotations

import ast
import importlib
import itertools
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
from tests.import_graph import (
    BY_NAME,
    LOCAL,
    TOP,
    TYPE_ONLY,
    Graph,
    describe,
    find_cycles,
    module_graph,
    oversize_reasons,
    package_graph,
    package_of,
    render_cycle,
    size_offenders,
    table_differences,
)
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
DOCS = PACKAGE.parent / "docs"


def _fresh(*codes: str) -> list[str]:
    """What each of ``codes`` prints, run by a fresh interpreter: all at once (each costs seconds
    of imports on one core, and the CI machine has two)."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for code in codes
    ]
    outputs = []
    try:
        for process in started:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs


_REGISTERED = (
    "from lightning.pytorch.strategies import StrategyRegistry\n"
    "import lightning as L\n"
    "t = L.Trainer(strategy='pipe_tp', accelerator='cpu', devices=2, logger=False)\n"
    "print(type(t.strategy).__name__, 'pipe_tp' in StrategyRegistry)"
)


_DEFERRED = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "peft",
)
"""Modules the engine imports only where they are used (FSDP2 and DTensor where parameters are
sharded, Hugging Face where a model is one): about a second each to import, which every rank of
every launch would pay."""


@pytest.fixture(scope="module")
def fresh() -> dict[str, list[str]]:
    """Two fresh interpreters, run side by side, for three questions (each costs seconds of
    imports). Which module is imported first (``lightning_pipe``: the engine and the top-level
    package first, which Lightning modules they imported (none), then ``lightning``; or
    ``lightning``) -> the lines printed, the last saying whether ``"pipe_tp"`` is registered."""
    engine_first, lightning_first = _fresh(
        "import sys, lightning_pipe.runtime, lightning_pipe\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
        f"print(sorted(m for m in {_DEFERRED!r} if m in sys.modules))\n"
        "import lightning\n" + _REGISTERED,
        "import lightning\nimport lightning_pipe\n" + _REGISTERED,
    )
    return {
        "lightning_pipe": engine_first.strip().splitlines(),
        "lightning": lightning_first.strip().splitlines(),
    }


def test_the_engine_imports_no_lightning(fresh: dict[str, list[str]]) -> None:
    assert fresh["lightning_pipe"][0] == "[]", fresh["lightning_pipe"]


def test_the_engine_defers_its_heavy_imports(fresh: dict[str, list[str]]) -> None:
    assert fresh["lightning_pipe"][1] == "[]", fresh["lightning_pipe"]


@pytest.mark.parametrize("first", ["lightning_pipe", "lightning"])
def test_pipe_tp_is_registered_whichever_is_imported_first(first: str, fresh: dict[str, list[str]]) -> None:
    out = fresh[first]
    assert out[-1] == "PipeTPStrategy True", out


def _graph() -> Graph:
    return module_graph(PACKAGE)


def test_no_import_cycle_between_modules() -> None:
    """Imports inside functions, under ``if TYPE_CHECKING:`` and by name count: a cycle held apart
    only by them is still two modules that cannot be read (or moved) one without the other."""
    graph = _graph()
    cycles = find_cycles({module: set(targets) for module, targets in graph.items()})
    assert cycles == [], "import cycles:\n" + "\n".join(render_cycle(c, graph) for c in cycles)


def test_no_import_cycle_between_packages() -> None:
    """Importing any module runs its package's ``__init__`` first, so packages must not cycle
    either (a cycle through two ``__init__`` modules shows here, not between modules)."""
    packages = package_graph(_graph())
    cycles = find_cycles({package: set(targets) for package, targets in packages.items()})
    detail = [
        " -> ".join(c) + "".join(f"\n    {packages[a][b]}" for a, b in itertools.pairwise(c)) for c in cycles
    ]
    assert cycles == [], "package cycles:\n" + "\n".join(detail)


ALLOWED: dict[str, set[str]] = {
    # docs/architecture.md's table, as data (test_the_architecture_table_is_this_map compares
    # them): the package -> the packages it may import.
    "arguments": set(),
    "collectives": set(),
    "mesh": {"arguments"},
    "experts": {"tensor_parallel", "arguments"},
    "context": set(),
    "faults": set(),
    "schedule": {"arguments"},
    "skip": set(),
    "execution": {"schedule", "faults", "arguments", "skip"},
    "partition": {"execution", "arguments", "skip"},
    "batches": {"execution", "mesh", "skip"},
    "data_parallel": {"collectives"},
    "tensor_parallel": {"data_parallel", "collectives", "arguments"},
    "checkpoint": {"partition", "tensor_parallel", "data_parallel", "mesh", "experts"},
    "construction": {"checkpoint", "tensor_parallel", "experts"},
    "planning": {"schedule", "partition", "execution", "tensor_parallel", "skip", "collectives"},
}
_ENGINE = set(ALLOWED)
ALLOWED["runtime"] = _ENGINE
ALLOWED["huggingface"] = {"execution", "tensor_parallel", "runtime", "checkpoint", "context", "experts"}
ALLOWED["consolidate"] = {"checkpoint", "mesh", "huggingface"}
ALLOWED["plan"] = {"planning", "huggingface", "construction", "execution", "schedule"}
# The adapter drives the runtime through its package's face (ParallelRuntime and the vocabulary of
# its signatures, test_the_adapter_reaches_the_runtime_through_its_face); beside it, only what the
# runtime does not own: the mesh, checkpoint files, fault naming, the data's batches, meta/pretrained
# construction contexts for Lightning's init_module, schedule kinds and timeline files, the option
# checks, and a Hugging Face model's reading.
ALLOWED["strategy"] = {
    "runtime", "mesh", "checkpoint", "faults", "batches", "construction", "schedule", "arguments",
    "huggingface", "planning",
}  # fmt: skip
ALLOWED["modules"] = set()


def test_the_adapter_reaches_the_runtime_through_its_face() -> None:
    """The strategy imports ``lightning_pipe.runtime`` (its ``__all__``: ``ParallelRuntime``, its
    options and the types of its signatures), never a module inside it, so the runtime's modules
    can be split or renamed without touching the adapter."""
    offenders = [
        describe(module, target, edge)
        for module, targets in sorted(_graph().items())
        if module.startswith("lightning_pipe.strategy")
        for target, edge in sorted(targets.items())
        if target.startswith("lightning_pipe.runtime.")
    ]
    assert offenders == [], "import `lightning_pipe.runtime` (add the name to its __all__):\n" + "\n".join(
        offenders
    )


def test_packages_import_only_what_the_architecture_map_allows() -> None:
    offenders = []
    for module, targets in sorted(_graph().items()):
        own = package_of(module)
        if own in ("lightning_pipe", "_registration"):
            continue  # the public API lists everything; the registration imports the adapter by name
        for target, edge in sorted(targets.items()):
            if package_of(target) != own and package_of(target) not in ALLOWED[own]:
                offenders.append(describe(module, target, edge))
    assert offenders == [], "\n".join(offenders) + "\n(see docs/architecture.md)"


def test_the_architecture_table_is_this_map() -> None:
    differences = table_differences((DOCS / "architecture.md").read_text(), ALLOWED)
    assert differences == [], "docs/architecture.md's table and ALLOWED differ:\n" + "\n".join(differences)


SIZE_LIMIT = 400
SIZE_LIMITED = ("runtime", "execution", "tensor_parallel", "strategy", "schedule")


def _sizes(package: Path) -> dict[str, int]:
    return {
        path.relative_to(package.parent).as_posix(): len(path.read_text().splitlines())
        for sub in SIZE_LIMITED
        for path in sorted((package / sub).rglob("*.py"))
    }


def test_modules_stay_under_the_size_limit_or_the_document_says_why() -> None:
    reasons = oversize_reasons((DOCS / "architecture.md").read_text())
    offenders = size_offenders(_sizes(PACKAGE), reasons, SIZE_LIMIT)
    assert offenders == [], "\n".join(offenders)


# The checks above, checked: each fails on a violation of its rule.


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    ("importer", "how"),
    [
        ("if TYPE_CHECKING:\n    from pkg.a import A\n", TYPE_ONLY),
        ("import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n", TYPE_ONLY),
        ("def f():\n    from pkg.a import A\n    return A\n", LOCAL),
        ("class C:\n    def m(self):\n        from . import a\n", LOCAL),
        ("import importlib\ndef f():\n    return importlib.import_module('pkg.a')\n", f"{LOCAL}, {BY_NAME}"),
        ("from .a import A\n", TOP),
    ],
)
def test_the_cycle_check_sees_every_kind_of_import(tmp_path: Path, importer: str, how: str) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import B\nA = 1\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\n" + importer + "B = 2\n",
            "pkg/c.py": "from pkg import a, b\n",  # not on the cycle
        },
    )
    graph = module_graph(package)
    assert graph["pkg.b"]["pkg.a"].how == how
    cycles = find_cycles({m: set(t) for m, t in graph.items()})
    assert cycles == [["pkg.a", "pkg.b", "pkg.a"]]
    assert render_cycle(cycles[0], graph).splitlines()[0] == "pkg.a -> pkg.b -> pkg.a"
    assert f"pkg.b imports pkg.a {how}" in render_cycle(cycles[0], graph)


def test_find_cycles_names_each_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}, "e": {"f"}, "f": set()}
    assert find_cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"], ["d", "d"]]
    assert find_cycles({"e": {"f"}, "f": {"g"}}) == []
    assert find_cycles({"p": {"q"}, "q": {"p"}}) == [["p", "q", "p"]]  # package graphs too


_TABLE = """## The packages, and what each may import

| package | holds | may import |
|---|---|---|
| `low`, `other` | things | torch only |
| `mid/` | more | `low` (why) |
| `top/` | the rest | everything above, `lightning` |

## Next
"""


def test_table_differences_are_named() -> None:
    allowed = {"low": set(), "other": set(), "mid": {"low"}, "top": {"low", "other", "mid"}}
    assert table_differences(_TABLE, allowed) == []
    assert table_differences(_TABLE, {**allowed, "mid": {"low", "other"}}) == [
        "mid: ALLOWED allows ['other'], the table does not"
    ]
    assert table_differences(_TABLE, {**allowed, "top": {"low"}}) == [
        "top: the table allows ['mid', 'other'], ALLOWED does not"
    ]
    assert table_differences(_TABLE, {**allowed, "new": set()}) == ["new: in ALLOWED, not in the table"]
    upward = _TABLE.replace("| `low`, `other` | things | torch only |", "| `low`, `other` | things | `mid` |")
    assert table_differences(upward, {**allowed, "low": {"mid"}, "other": {"mid"}}) == [
        "low: the table lets it import ['mid'], not in a row above it",
        "other: the table lets it import ['mid'], not in a row above it",
    ]


def test_size_offenders_are_named() -> None:
    doc = "## Modules over 400 lines\n\n- `p/big.py`: it holds one concept that does not split well.\n"
    reasons = oversize_reasons(doc)
    assert reasons == {"p/big.py": "it holds one concept that does not split well."}
    assert size_offenders({"p/big.py": 500, "p/small.py": 10}, reasons, 400) == []
    assert size_offenders({"p/big.py": 500, "p/huge.py": 401}, reasons, 400) == [
        "p/huge.py: 401 lines (limit 400); docs/architecture.md does not say why"
    ]
    assert size_offenders({"p/big.py": 500}, {"p/big.py": "because."}, 400) == [
        "p/big.py: 500 lines; its reason in docs/architecture.md is not a sentence"
    ]
    listed = "p/big.py: listed in docs/architecture.md's 'Modules over 400 lines' but has 300 lines"
    assert size_offenders({"p/big.py": 300}, reasons, 400) == [f"{listed}: take it off the list"]
    assert _sizes(PACKAGE)  # the real tree is measured


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
    "context",
    "execution",
    "experts",
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
