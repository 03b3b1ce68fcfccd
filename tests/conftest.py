"""Keeps ``pytest -m "not distributed"`` single-process: each test runs inside
:func:`tests.distributed.running_test`, so that :func:`tests.distributed.run_distributed` (and
``run_distributed_outcomes``) refuse to start processes for a test that does not carry
``@pytest.mark.distributed`` (a module-scoped fixture that starts them counts for the test that
first asks for it). Tests that start processes otherwise (torchrun, a script with ``devices=2``)
carry the mark by hand.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.distributed import running_test
from tests.scheduling import keep_the_collection_order, longest_files_first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with running_test(item.nodeid, item.get_closest_marker("distributed") is not None):
        yield


# --- The order of the test files (tests/scheduling.py): the longest first. -----------------------


def pytest_configure(config: pytest.Config) -> None:
    keep_the_collection_order(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_files_first(items)
