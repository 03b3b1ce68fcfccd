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


def check_count(name: str, value: object, minimum: int = 1, also: str = "", hint: str = "") -> None:
    """Raise unless ``value`` is an integer ``>= minimum`` (``True`` is not a count): one
    sentence naming the option, the value and what is allowed (``also``: other accepted values,
    e.g. ``"'auto'"``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return
    allowed = f"an integer >= {minimum}" + (f" or {also}" if also else "")
    raise ValueError(f"{name} must be {allowed}, got {value!r}.{' ' + hint if hint else ''}")


def check_flag(name: str, value: object) -> None:
    """Raise unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")


def check_positive(name: str, value: object, unit: str = "") -> None:
    """Raise unless ``value`` is a number > 0 (``unit``: what it counts, for the message)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == value and value > 0:
        return
    raise ValueError(f"{name} must be a number > 0{' (' + unit + ')' if unit else ''}, got {value!r}.")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the sizes an error message offers instead."""
    return [d for d in range(1, n + 1) if n % d == 0]
