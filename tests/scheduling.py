"""The order in which the test command's two pytest-xdist workers take the test files: the longest
first (``python -m pytest -q -n 2 --dist loadfile``; used by ``tests/conftest.py``).

``--dist loadfile`` hands a worker the next whole file whenever it runs low. By default xdist
queues the files by their number of tests, most first, which puts the files of a few long tests
(the torchrun launches of ``test_nodes.py``, ``test_compile.py``'s compiled cases,
``test_engine_runtime.py``) at the end of the queue: one of them drawn last keeps one worker busy
while the other has nothing left to do. Longest first, the files left at the end are the short
ones, and the two workers finish within seconds of each other.

:data:`LONGEST_FIRST` is measured, not exact: the files over about 8 s in a whole run of the test
command on two cores (``--durations=0``, each file's setup, call and teardown times added up),
longest first.
Files not in it (new or short) follow it, most tests first, as xdist would have ordered them.
A new long file belongs in the list: the order only changes how soon the suite ends, never what
a test checks (each file's tests still run on one worker, in their own order).
"""

from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath

import pytest

LONGEST_FIRST: tuple[str, ...] = (
    "test_nodes.py",
    "test_huggingface_families.py",
    "test_skip_connections.py",
    "test_example_cli.py",
    "test_parameter_gather.py",
    "test_compile.py",
    "test_fully_sharded.py",
    "test_sequence_parallel.py",
    "test_host_syncs.py",
    "test_checkpoints.py",
    "test_lost_ranks.py",
    "test_signals.py",
    "test_architecture.py",
    "test_huggingface_lightning.py",
    "test_engine_runtime.py",
    "test_peft.py",
    "test_huggingface_experts.py",
    "test_context_parallel_axis.py",
    "test_meta_construction.py",
    "test_fault_messages.py",
    "test_optimizer_sharding.py",
    "test_interleaved_schedule.py",
    "test_strategy_fit.py",
    "test_huggingface_expert_runs.py",
    "test_engine_equivalence.py",
    "test_gpu_check.py",
    "test_huggingface_balancing.py",
    "test_schedule_fit.py",
    "test_timeline.py",
    "test_tensor_parallel_reuse.py",
    "test_tensor_parallel_fit.py",
    "test_batches.py",
    "test_pretrained.py",
    "test_checkpoint_format.py",
    "test_batchnorm.py",
)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place, file by file: the files of :data:`LONGEST_FIRST` in its order,
    then the others, most tests first; within a file, its tests keep their order."""
    tests = Counter(_file(item) for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> tuple[int, int]:
        path = _file(item)
        listed = rank.get(PurePosixPath(path).name)
        return (listed, 0) if listed is not None else (len(rank), -tests[path])

    items.sort(key=key)  # stable: a file's tests, and files of equal key, keep their order


def keep_the_collection_order(config: pytest.Config) -> None:
    """Tell xdist to queue the files in the collection's order (``--no-loadscope-reorder``)
    instead of re-sorting them by their number of tests; without xdist, nothing to do."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
