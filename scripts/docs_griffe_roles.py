"""Griffe extension for the API reference: reStructuredText roles in docstrings as Markdown code.

The package's docstrings name other objects Sphinx's way (``:class:`~lightning_pipe.runtime.X```,
``:mod:`.options```, ``:attr:`y```), which Markdown would print as written. mkdocstrings renders
docstrings as Markdown, so each role becomes inline code of its target (``~`` keeps the last
name, as in Sphinx), and reStructuredText's double back-quotes stay code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:mod|class|func|data|meth|attr|obj|exc):`(~?)([^`]+)`")


def as_code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class RstRoles(griffe.Extension):
    """Rewrite each docstring's roles once its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(as_code, obj.docstring.value)
