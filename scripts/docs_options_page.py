"""MkDocs hook: the options page (``options.md``), generated at build time.

``PipeTPStrategy``'s options are documented once, by the docstrings under the fields of
``RuntimeOptions`` (the engine's) and ``StrategyOptions`` (the strategy's own); the constructor's
``Args:`` (what LightningCLI prints for ``--help``) are assembled from them by
``lightning_pipe.strategy.options.option_descriptions``. This hook writes the page from that same
function, one section per constructor option, in the constructor's order, so the page cannot
drift from ``--help``. ``python scripts/docs_options_page.py`` prints the page.
"""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from typing import Any

ROLE = re.compile(r":(?:mod|class|func|data|meth|attr):`~?([^`]+)`")


def markdown(text: str) -> str:
    """A field docstring (reStructuredText roles, double back-quotes) as Markdown."""
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def default_of(value: Any) -> str:
    if isinstance(value, timedelta):
        return f"`timedelta(seconds={value.total_seconds():g})`"
    return f"`{value!r}`"


def first_sentence(text: str, limit: int = 110) -> str:
    """The description's first sentence, shortened at a word to about ``limit`` characters (the
    summary table's cell; the whole text follows in the option's own section)."""
    sentence = re.split(r"(?<=[.])\s", text, maxsplit=1)[0]
    if len(sentence) <= limit:
        return sentence
    cut = sentence[:limit].rsplit(" ", 1)[0]
    if cut.count("`") % 2:  # never end inside a code span
        cut = cut[: cut.rindex("`")].rstrip()
    return cut.rstrip(" ,;:(") + " …"


def options_page() -> str:
    from lightning_pipe import PipeTPStrategy
    from lightning_pipe.runtime import RuntimeOptions
    from lightning_pipe.strategy.options import (
        LIGHTNING_PLUGINS,
        SHARED_FIELDS,
        StrategyOptions,
        option_descriptions,
    )

    descriptions = option_descriptions()
    engine = {f.name for f in RuntimeOptions.__dataclass_fields__.values()}
    own = {f.name for f in StrategyOptions.__dataclass_fields__.values()}
    parameters = [
        p
        for p in inspect.signature(PipeTPStrategy.__init__).parameters.values()
        if p.name != "self" and p.name not in LIGHTNING_PLUGINS
    ]
    lines = [
        "# Options",
        "",
        "<!-- Generated at build time by scripts/docs_options_page.py from the options' docstrings. -->",
        "",
        f"`PipeTPStrategy` takes {len(parameters)} options (plus Lightning's own plugins: "
        + ", ".join(f"`{n}`" for n in LIGHTNING_PLUGINS)
        + "). This page is generated from the docstrings under the fields of "
        "[`RuntimeOptions`][lightning_pipe.runtime.RuntimeOptions] (the engine's options, also used "
        "[without Lightning](engine.md)) and `StrategyOptions` (the strategy's own): the same text "
        "LightningCLI prints for `--help`. Every option is checked when the strategy is built, each "
        "bad value refused with one sentence naming the option, the value and what is allowed; a "
        "layout that cannot fit the devices is refused when the `Trainer` is built.",
        "",
        "| option | default | in short |",
        "|---|---|---|",
    ]
    for p in parameters:
        text = markdown(" ".join(descriptions[p.name].split()))
        lines.append(f"| [`{p.name}`](#{p.name}) | {default_of(p.default)} | {first_sentence(text)} |")
    lines.append("")
    for p in parameters:
        annotation = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
        if p.name in SHARED_FIELDS:
            where = (
                "`RuntimeOptions` (the engine's description) and `StrategyOptions` (what the strategy adds)"
            )
        else:
            where = "`StrategyOptions`" if p.name in own else "`RuntimeOptions`" if p.name in engine else "?"
        lines += [
            f"## `{p.name}` {{#{p.name}}}",
            "",
            f"`{p.name}: {annotation} = {p.default!r}`",
            "",
            markdown(" ".join(descriptions[p.name].split())),
            "",
            f"<small>Documented in {where}.</small>",
            "",
        ]
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs event: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "options.md", content=options_page()))
    return files


if __name__ == "__main__":
    print(options_page())
