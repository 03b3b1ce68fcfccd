"""Parse a user-facing option name into the engine's enum, with one error format everywhere.

Strings belong at the edges (strategy arguments, YAML configs); inside the engine options are
enums. Every option goes through :func:`parse_option`, so a typo always reads the same:
``Unknown <what> '<value>': expected one of '<a>', '<b>'.`` plus any hint.
"""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def parse_option(cls: type[E], value: E | str, what: str, context: str = "", hint: str = "") -> E:
    """``value`` as a member of ``cls`` (by value, case-insensitive), or a ``ValueError`` listing them."""
    if isinstance(value, cls):
        return value
    for member in cls:
        if isinstance(value, str) and value.lower() == str(member.value).lower():
            return member
    valid = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"Unknown {what} {value!r}{context}: expected one of {valid}{hint}.")
