"""Check that the built documentation site's API reference documents every public name.

Usage: ``python scripts/check_api_reference.py SITE_DIR`` after ``mkdocs build --site-dir SITE_DIR``
(``.ci/run`` does both). The public names are ``__all__`` of ``lightning_pipe`` and of each of its
modules and subpackages that declares one at its top (``lightning_pipe.runtime``, ``.mesh``, ...);
a name counts as documented when an API page holds an anchor for it (mkdocstrings gives each
documented object the id of its dotted path: ``lightning_pipe.strategy.PipeTPStrategy``), under
whichever of the package's modules it is shown. Exits 1 naming what is missing.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

import lightning_pipe


def public_faces() -> dict[str, list[str]]:
    """``{module: its __all__}`` for the package and each direct module or subpackage with one."""
    faces = {"lightning_pipe": list(lightning_pipe.__all__)}
    for info in pkgutil.iter_modules(lightning_pipe.__path__):
        if info.name.startswith("_"):
            continue
        name = f"lightning_pipe.{info.name}"
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        if names and (info.ispkg or not hasattr(module, "main")):  # a command's module has no face
            faces[name] = list(names)
    return faces


def documented(site: Path) -> set[str]:
    """The short names that an API page anchors under ``lightning_pipe``."""
    ids: set[str] = set()
    for page in (site / "api").rglob("*.html"):
        ids |= set(re.findall(r'id="lightning_pipe(?:\.\w+)*\.(\w+)"', page.read_text(encoding="utf-8")))
    return ids


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "api").is_dir():
        print("usage: python scripts/check_api_reference.py SITE_DIR (a built site with api/ pages)")
        return 2
    anchors = documented(Path(argv[0]))
    missing = {face: [n for n in names if n not in anchors] for face, names in public_faces().items()}
    missing = {face: names for face, names in missing.items() if names}
    total = sum(len(names) for names in public_faces().values())
    if missing:
        for face, names in missing.items():
            print(f"{face}: not in the API reference: {', '.join(names)} (add them to docs/api/*.md)")
        return 1
    print(f"API reference: all {total} public names of {len(public_faces())} modules documented")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
