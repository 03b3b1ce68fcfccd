"""The release's version is written once: ``lightning_pipe.__version__``, which pyproject.toml
reads (setuptools' dynamic version) and the CHANGELOG's latest release names.
``scripts/wheel_check.sh`` (run by ``.ci/run``) builds, installs and imports the package itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_pipe

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_changelogs_latest_release() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", changelog, re.MULTILINE)
    assert headings[0] == ("Unreleased", ""), "CHANGELOG.md starts with ## [Unreleased]"
    release, date = headings[1]
    assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", date), f"## [{release}]{date}: a release has its date"
    assert lightning_pipe.__version__ == release


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "the version is written once, in lightning_pipe/__init__.py"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_pipe.__version__"}
