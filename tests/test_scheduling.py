"""The test files' order for the two xdist workers (``tests/scheduling.py``): the listed longest
files exist, go first, and each file's tests stay together in their order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduling import LONGEST_FIRST, longest_files_first

TESTS = Path(__file__).resolve().parent


def test_every_listed_file_exists_once() -> None:
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"tests/scheduling.py lists files that are gone (renamed?): {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_listed_files_go_first_then_the_others_most_tests_first() -> None:
    first, second = LONGEST_FIRST[0], LONGEST_FIRST[1]
    ids = [
        "tests/test_a.py::one",
        f"tests/{second}::x",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        f"tests/{second}::y",
        f"tests/{first}::z",
    ]
    items: list = [_Item(i) for i in ids]
    longest_files_first(items)
    assert [i.nodeid for i in items] == [
        f"tests/{first}::z",
        f"tests/{second}::x",
        f"tests/{second}::y",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        "tests/test_a.py::one",
    ]


def test_xdist_keeps_the_collection_order(pytestconfig: pytest.Config) -> None:
    """Without this, xdist re-sorts the files by their number of tests (its default)."""
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False
