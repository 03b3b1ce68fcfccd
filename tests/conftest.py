"""Keeps ``pytest -m "not distributed"`` single-process: each test runs inside
:func:`tests.distributed.running_test`, so that :func:`tests.distributed.run_distributed` (and
``run_distributed_outcomes``) refuse to start processes for a test that does not carry
``@pytest.mark.distributed`` (a module-scoped fixture that starts them counts for the test that
first asks for it). Tests that start processes otherwise (torchrun, a script with ``devices=2``)
carry the mark by hand.

Each test must also leave this thread's torch mode stacks as it found them: a
``TorchFunctionMode`` left on the stack (ZeRO-1's read guard, say) would see every torch call of
every later test in the same worker process, and a test that looks at the call stack (where a
host synchronisation is made) would then fail for a reason that is not its own. The leaking test
fails instead, naming the modes, and the stacks are emptied for the next one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch._C import _len_torch_function_stack
from torch.overrides import _pop_mode as _pop_function_mode
from torch.utils._python_dispatch import _len_torch_dispatch_stack
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode

from tests.distributed import running_test
from tests.scheduling import keep_the_collection_order, longest_files_first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with running_test(item.nodeid, item.get_closest_marker("distributed") is not None):
        yield


@pytest.fixture(autouse=True)
def _torch_mode_stacks_left_as_found() -> Iterator[None]:
    before = (_len_torch_function_stack(), _len_torch_dispatch_stack())
    yield
    left = []
    while _len_torch_function_stack() > before[0]:
        left.append(type(_pop_function_mode()).__qualname__)
    while _len_torch_dispatch_stack() > before[1]:
        left.append(type(_pop_dispatch_mode()).__qualname__)
    if left:
        pytest.fail(
            f"the test left torch mode(s) {left} on this thread's mode stacks; they would see every "
            "torch call of the later tests in this process (they were popped)"
        )


# --- The order of the test files (tests/scheduling.py): the longest first. -----------------------


def pytest_configure(config: pytest.Config) -> None:
    keep_the_collection_order(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_files_first(items)
