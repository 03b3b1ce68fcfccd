"""Each option of the strategy is documented once and checked once, and ``"pipe_tp"`` is registered
once (one process, no launch).

The engine's options are documented by the docstrings under ``RuntimeOptions``' fields, the
strategy's own under ``StrategyOptions``'; ``PipeTPStrategy.__doc__``'s ``Args:`` (what
LightningCLI prints for ``--help``) is assembled from them, so no description is written twice.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from datetime import timedelta
from pathlib import Path

import docstring_parser
import pytest

from lightning_pipe import PipeTPStrategy
from lightning_pipe.runtime import RuntimeOptions
from lightning_pipe.strategy.options import LIGHTNING_PLUGINS, SHARED_FIELDS, StrategyOptions, field_docs

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"


def _flat(text: str) -> str:
    return " ".join(text.split())


def _constructor_options() -> list[str]:
    names = list(inspect.signature(PipeTPStrategy.__init__).parameters)
    return [n for n in names if n != "self" and n not in LIGHTNING_PLUGINS]


def _documented_args() -> dict[str, str]:
    """The ``Args:`` of ``PipeTPStrategy.__doc__``, parsed as jsonargparse parses it."""
    parsed = docstring_parser.parse(PipeTPStrategy.__doc__ or "")
    return {p.arg_name: _flat(p.description or "") for p in parsed.params}


def test_every_constructor_option_is_in_the_docstrings_args() -> None:
    args = _documented_args()
    missing = [n for n in _constructor_options() if not args.get(n)]
    assert missing == [], f"options without a description in PipeTPStrategy.__doc__'s Args: {missing}"
    assert set(args) == set(_constructor_options()), sorted(set(args) ^ set(_constructor_options()))


def test_every_option_has_one_description_and_the_constructor_shows_it() -> None:
    engine, own = field_docs(RuntimeOptions), field_docs(StrategyOptions)
    undocumented = [f.name for f in dataclasses.fields(RuntimeOptions) if not engine.get(f.name)]
    undocumented += [f.name for f in dataclasses.fields(StrategyOptions) if not own.get(f.name)]
    assert undocumented == []
    # Every constructor option is one of the two dataclasses' fields (the strategy's own first).
    args = _documented_args()
    for name in _constructor_options():
        source = own.get(name) or engine.get(name)
        assert source is not None, f"{name} is neither a StrategyOptions nor a RuntimeOptions field"
        assert _flat(source) in args[name], f"{name}: the Args text is not the field's own description"


def test_no_description_is_written_twice_in_the_source() -> None:
    sources = {p: _flat(p.read_text()) for p in PACKAGE.rglob("*.py")}
    descriptions = {**field_docs(RuntimeOptions), **field_docs(StrategyOptions)}
    twice = []
    for name, text in descriptions.items():
        # Each sentence long enough to be a description (not a shared phrase such as a default).
        for sentence in re.split(r"(?<=[.:;])\s+", _flat(text)):
            if len(sentence) < 40:
                continue
            where = [
                str(p.relative_to(PACKAGE)) for p, s in sources.items() for _ in range(s.count(sentence))
            ]
            if len(where) != 1:
                twice.append(f"{name}: {sentence!r} in {where}")
    assert twice == [], "\n".join(twice)


def test_an_option_of_both_dataclasses_is_described_by_the_engine_and_extended_by_the_strategy() -> None:
    """``timeout`` and ``tensor_parallel_plan`` are fields of both dataclasses (the strategy fills
    the engine's at setup). Their descriptions had drifted apart, two wordings of one option; now
    the engine's field describes it, the strategy's says only what it adds, and the constructor's
    Args show both, the engine's first."""
    engine, own, args = field_docs(RuntimeOptions), field_docs(StrategyOptions), _documented_args()
    both = {f.name for f in dataclasses.fields(RuntimeOptions)} & {
        f.name for f in dataclasses.fields(StrategyOptions)
    }
    assert both == set(SHARED_FIELDS)
    for name in SHARED_FIELDS:
        engine_text, own_text = _flat(engine[name]), _flat(own[name])
        assert args[name].startswith(engine_text), (
            f"{name}: the Args do not start with the engine's description"
        )
        assert args[name].endswith(own_text), f"{name}: the Args do not end with the strategy's addition"
        assert engine_text not in own_text and own_text not in engine_text


def test_the_constructors_defaults_are_the_options_defaults() -> None:
    """One default per option: the constructor's signature (what LightningCLI shows) agrees with
    the dataclass that documents the option (``virtual_stages``: the strategy's ``None`` is
    resolved by schedule, see its description)."""
    both = (*dataclasses.fields(RuntimeOptions), *dataclasses.fields(StrategyOptions))
    fields = {f.name: getattr(f.default, "value", f.default) for f in both}  # an enum as its string
    signature = inspect.signature(PipeTPStrategy.__init__).parameters
    differ = [
        f"{name}: {signature[name].default!r} != {fields[name]!r}"
        for name in _constructor_options()
        if name != "virtual_stages" and signature[name].default != fields[name]
    ]
    assert differ == []
    assert signature["virtual_stages"].default is None


def test_the_timeout_is_checked_by_one_function_with_each_sentence_kept() -> None:
    """The strategy's form (a number of seconds too) and the engine's (a ``timedelta``) keep
    their sentences; both are the one check in ``runtime/options.py``."""
    with pytest.raises(
        ValueError, match=r"^timeout must be a positive datetime\.timedelta or None, got -1\.$"
    ):
        RuntimeOptions(timeout=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^timeout must be a positive .* seconds, got 0; e\.g\. PipeTP"):
        PipeTPStrategy(timeout=0)
    assert PipeTPStrategy(timeout=30)._timeout == timedelta(seconds=30)
    assert PipeTPStrategy(timeout=None)._timeout is None
    checks = [p for p in PACKAGE.rglob("*.py") if "must be a positive datetime.timedelta" in p.read_text()]
    assert [p.relative_to(PACKAGE).as_posix() for p in checks] == ["runtime/options.py"]


def test_pipe_tp_is_registered_once_by_the_package() -> None:
    """``import lightning_pipe`` registers a factory; importing the adapter registers nothing more
    (it used to register the class again with ``override=True``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_pipe._registration as registration
    import lightning_pipe.strategy  # noqa: F401  (the adapter, imported)

    assert StrategyRegistry["pipe_tp"]["strategy"] is registration._make_strategy
    registering = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if re.search(r"\bregister\(\s*NAME\b|StrategyRegistry\.register\(", p.read_text())
    ]
    assert registering == ["_registration.py"], registering
