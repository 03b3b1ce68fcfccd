"""Every Python code block in the documentation runs (issue 43): README.md and docs/**/*.md.

The pages are found when the tests are collected; each ```` ```python ```` block (also ``py``,
``python3``; fenced with backticks or tildes, indented inside a list or not) is one test,
``README.md:L123`` by the line of its opening fence. What a block's test does is set by the line
immediately above its opening fence (no blank line between), which may be an HTML comment:

* no marker: the block runs as it is, as a script (``__name__ == "__main__"``, in a new empty
  folder as its working directory), in one process with no torchrun environment;
* ``<!-- test: skip — <reason> -->``: not run; the test is reported skipped with the reason. The
  reason is required (``—``, ``–``, ``-`` or ``:`` may separate it);
* ``<!-- test: continues -->``: runs after the page's previous block that runs, as one program
  (the names it defined are there), and so on back to a block without this marker, whose process
  count the chain keeps; skipped blocks in between are not part of the program;
* ``<!-- test: ranks=N -->`` (N from 2 to 4): runs on N gloo processes with the torchrun
  environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so that
  a ``Trainer(devices=N)`` or ``init_process_group("gloo")`` in the block joins them instead of
  starting processes of its own; every rank has the same working directory.

Any other ``<!-- test: ... -->`` comment, a skip without a reason, a marker that is not right
above a Python block, or ``continues`` with no earlier block to continue, fails (the page's
marker test, and the fast loop's :func:`test_the_pages_markers_parse`) naming the file and line.

A block does not start a ``python`` interpreter of its own (importing Lightning alone costs about
9 s): it runs in a process forked from the tests' preloaded fork server
(:func:`tests.distributed.run_distributed`, ``init_group=False``), each part of a chain compiled
with its page's path and line numbers, so that a failing block's traceback names the page and the
line. Each run has a deadline (:data:`BLOCK_TIMEOUT`).
"""

from __future__ import annotations

import os
import re
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TIMEOUT = 180.0
"""Seconds a block's program may run (a hang ends there, with the ranks still alive named)."""
PYTHON_LANGUAGES = ("python", "py", "python3")
MIN_RANKS, MAX_RANKS = 2, 4  # the tests' world sizes: the CI machine has two cores
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^<!--\s*test\s*:(?P<value>.*?)-->$")
_SKIP = re.compile(r"^skip(?:\s*[—–:-]\s*(?P<reason>.*))?$", re.DOTALL)
_RANKS = re.compile(r"^ranks\s*=\s*(?P<n>\S+)$")
_SYNTAX = "`<!-- test: skip — <reason> -->`, `<!-- test: continues -->` or `<!-- test: ranks=N -->`"


class MarkerError(ValueError):
    """A page's ``<!-- test: ... -->`` marker that cannot be followed; the message names the page
    and the line."""


class Kind(Enum):
    RUN = "run"
    SKIP = "skip"
    CONTINUES = "continues"
    RANKS = "ranks"


@dataclass(frozen=True)
class Block:
    """One Python code block of a page, and its marker."""

    page: str  # as the test ids name it, e.g. "docs/quickstart.md"
    path: Path  # the file, for tracebacks
    line: int  # the opening fence's line (1-based)
    code: str  # without the fence's indentation
    kind: Kind = Kind.RUN
    reason: str = ""
    ranks: int = 0  # 0: one process without the torchrun environment

    @property
    def name(self) -> str:
        return f"{self.page}:L{self.line}"


@dataclass(frozen=True)
class Program:
    """What one block's test does: run ``parts`` (the block last, after the blocks it continues)
    on ``ranks`` processes, or skip with ``skip``, or fail with ``error`` (a bad marker)."""

    name: str
    parts: tuple[Block, ...] = ()
    ranks: int = 0
    skip: str = ""
    error: str = ""
    sources: list[tuple[str, int, str]] = field(default_factory=list)


def _marker(page: str, number: int, value: str) -> tuple[Kind, str, int]:
    value = value.strip()
    if skip := _SKIP.match(value):
        reason = (skip["reason"] or "").strip()
        if not reason:
            raise MarkerError(
                f"{page}:{number}: a skip needs a reason: `<!-- test: skip — why it cannot run -->`"
            )
        return Kind.SKIP, reason, 0
    if value == "continues":
        return Kind.CONTINUES, "", 0
    if ranks := _RANKS.match(value):
        n = ranks["n"]
        if not n.isdigit() or not MIN_RANKS <= int(n) <= MAX_RANKS:
            raise MarkerError(
                f"{page}:{number}: `ranks={n}`: a block runs on {MIN_RANKS} to {MAX_RANKS} processes "
                "(the tests' world sizes); mark a larger layout `skip — <reason>` or shrink it"
            )
        return Kind.RANKS, "", int(n)
    shown = f"<!-- test: {value} -->" if value else "<!-- test: -->"
    raise MarkerError(f"{page}:{number}: unknown marker `{shown}`; expected {_SYNTAX}")


def parse_page(page: str, path: Path, text: str) -> list[Block]:
    """The Python blocks of a page, in order, with their markers; :class:`MarkerError` for a bad
    or misplaced marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    markers: dict[int, tuple[Kind, str, int]] = {}  # the line's index -> its marker
    i = 0
    while i < len(lines):
        line = lines[i]
        if marker := _MARKER.match(line.strip()):
            markers[i] = _marker(page, i + 1, marker["value"])
        opening = _FENCE.match(line)
        if opening is None or ("`" in opening["info"] and opening["fence"][0] == "`"):
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        words = opening["info"].strip().split()
        language = words[0].lower().lstrip("{.").rstrip("}") if words else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if language in PYTHON_LANGUAGES:
            body = [_dedent(text_line, indent) for text_line in lines[i + 1 : end]]
            kind, reason, ranks = markers.pop(i - 1, (Kind.RUN, "", 0))
            blocks.append(Block(page, path, i + 1, "\n".join(body) + "\n", kind, reason, ranks))
        i = end + 1  # a fence left open runs to the end of the page, as Markdown reads it
    if markers:
        number = min(markers) + 1
        raise MarkerError(
            f"{page}:{number}: a `<!-- test: ... -->` marker must be the line right above a "
            "```python block's opening fence (no blank line between)"
        )
    return blocks


def _dedent(line: str, indent: int) -> str:
    """The line without up to ``indent`` leading spaces (a fence indented in a list)."""
    stripped = len(line) - len(line.lstrip(" "))
    return line[min(indent, stripped) :]


def programs(blocks: list[Block]) -> list[Program]:
    """One :class:`Program` per block of one page: its chain (``continues``) resolved."""
    result: list[Program] = []
    chain: list[Block] = []
    for block in blocks:
        if block.kind is Kind.SKIP:
            result.append(Program(block.name, (block,), skip=block.reason))
            continue
        if block.kind is Kind.CONTINUES:
            if not chain:
                raise MarkerError(
                    f"{block.page}:{block.line - 1}: `continues`, but no earlier block on this page "
                    "runs: remove the marker, or unskip the block it continues"
                )
            chain.append(block)
        else:
            chain = [block]
        sources = [(str(part.path), part.line + 1, part.code) for part in chain]
        result.append(Program(block.name, tuple(chain), chain[0].ranks, sources=sources))
    return result


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, as they are now."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    return found + sorted((root / "docs").rglob("*.md"))


def collect(root: Path = ROOT) -> list[Program]:
    """Every block's program; a page with a bad marker gives one program that fails with it."""
    result: list[Program] = []
    for path in pages(root):
        page = path.relative_to(root).as_posix()
        try:
            result += programs(parse_page(page, path, path.read_text(encoding="utf-8")))
        except MarkerError as error:
            result.append(Program(f"{page}:markers", error=str(error)))
    return result


def _run_program(sources: list[tuple[str, int, str]], cwd: str, torchrun: bool) -> None:
    """Inside the forked rank: run the chain's parts as one ``__main__`` script in ``cwd``."""
    if not torchrun:  # a plain `python script.py`: Lightning must not think a launcher started it
        for variable in TORCHRUN_VARIABLES:
            os.environ.pop(variable, None)
    os.chdir(cwd)
    sys.argv = [sources[-1][0]]
    main = types.ModuleType("__main__")  # classes the block defines pickle as a script's would
    sys.modules["__main__"] = main
    for filename, first_line, code in sources:
        # Padded so that the traceback's line numbers are the page's.
        exec(compile("\n" * (first_line - 1) + code, filename, "exec"), main.__dict__)


def run_program(program: Program, cwd: Path) -> None:
    """Run ``program`` in forked processes; a failure fails the test with the page, the line and
    the block's traceback."""
    failure = ""
    try:
        run_distributed(
            _run_program,
            program.ranks or 1,
            program.sources,
            str(cwd),
            program.ranks > 0,
            timeout=BLOCK_TIMEOUT,
            init_group=False,
        )
    except (RuntimeError, TimeoutError) as error:
        failure = str(error)
    if failure:  # failed outside the except clause: the report is the block's traceback, once
        chain = " after " + ", ".join(p.name for p in program.parts[:-1]) if len(program.parts) > 1 else ""
        pytest.fail(f"{program.name}{chain}: the block failed:\n{failure}", pytrace=False)


PROGRAMS = collect()


@pytest.mark.distributed
@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_the_docs_code_blocks_run(program: Program, tmp_path: Path) -> None:
    if program.error:
        pytest.fail(program.error, pytrace=False)
    if program.skip:
        pytest.skip(f"{program.name}: {program.skip}")
    run_program(program, tmp_path)


# The parser, in this process (nothing is launched).

SAMPLE = """\
# A page

```python
first = 1
```

<!-- test: skip — needs a GPU -->
```python
raise SystemExit("not run")
```

<!-- test: continues -->
```py
second = first + 1
```

1. In a list:

   <!-- test: ranks=2 -->
   ```python
   import os
   world = int(os.environ["WORLD_SIZE"])
   ```

````markdown
<!-- test: bogus -->
```python
shown, not run
```
````

~~~python
<!-- test: continues -->
after = world
~~~
"""


def test_blocks_markers_and_chains() -> None:
    blocks = parse_page("page.md", Path("/docs/page.md"), SAMPLE)
    assert [(b.line, b.kind, b.reason, b.ranks) for b in blocks] == [
        (3, Kind.RUN, "", 0),
        (8, Kind.SKIP, "needs a GPU", 0),
        (13, Kind.CONTINUES, "", 0),
        (20, Kind.RANKS, "", 2),
        (32, Kind.RUN, "", 0),  # a marker inside the fence is code, not a marker
    ]
    assert blocks[3].code == 'import os\nworld = int(os.environ["WORLD_SIZE"])\n'  # the list's indent gone
    result = programs(blocks)
    assert [p.name for p in result] == [f"page.md:L{n}" for n in (3, 8, 13, 20, 32)]
    assert [[b.line for b in p.parts] for p in result] == [[3], [8], [3, 13], [20], [32]]
    assert [(p.ranks, p.skip) for p in result] == [(0, ""), (0, "needs a GPU"), (0, ""), (2, ""), (0, "")]
    # Each part keeps its page's line numbers (the first code line), for tracebacks.
    assert result[2].sources == [
        ("/docs/page.md", 4, "first = 1\n"),
        ("/docs/page.md", 14, "second = first + 1\n"),
    ]


def test_a_chain_keeps_its_heads_process_count() -> None:
    text = "<!-- test: ranks=3 -->\n```python\na = 1\n```\n<!-- test: continues -->\n```python\nb = a\n```\n"
    result = programs(parse_page("p.md", Path("p.md"), text))
    assert [(p.ranks, len(p.parts)) for p in result] == [(3, 1), (3, 2)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- test: skip -->\n```python\nx\n```\n", r"p\.md:1: a skip needs a reason"),
        ("<!-- test: skip —  -->\n```python\nx\n```\n", r"p\.md:1: a skip needs a reason"),
        (
            "a\n<!-- test: skipp — typo -->\n```python\nx\n```\n",
            r"p\.md:2: unknown marker `<!-- test: skipp — typo -->`",
        ),
        ("<!-- test: -->\n```python\nx\n```\n", r"p\.md:1: unknown marker `<!-- test: -->`"),
        ("<!-- test: ranks=8 -->\n```python\nx\n```\n", r"p\.md:1: `ranks=8`: a block runs on 2 to 4"),
        ("<!-- test: ranks=two -->\n```python\nx\n```\n", r"p\.md:1: `ranks=two`"),
        (
            "<!-- test: skip — why -->\n\n```python\nx\n```\n",
            r"p\.md:1: a `<!-- test: \.\.\. -->` marker must be",
        ),
        (
            "<!-- test: continues -->\n```bash\nls\n```\n",
            r"p\.md:1: a `<!-- test: \.\.\. -->` marker must be",
        ),
        ("```python\nx\n```\n<!-- test: ranks=2 -->\n", r"p\.md:4: a `<!-- test"),
    ],
    ids=[
        "skip-without-reason",
        "skip-with-an-empty-reason",
        "unknown",
        "empty",
        "too-many-ranks",
        "ranks-not-a-number",
        "a-blank-line-between",
        "above-a-bash-block",
        "above-nothing",
    ],
)
def test_bad_markers_name_the_page_and_line(text: str, message: str) -> None:
    with pytest.raises(MarkerError, match=message):
        parse_page("p.md", Path("p.md"), text)


@pytest.mark.parametrize(
    "text",
    [
        "<!-- test: continues -->\n```python\nx = 1\n```\n",
        "<!-- test: skip — later -->\n```python\nx = 1\n```\n"
        "<!-- test: continues -->\n```python\ny = x\n```\n",
    ],
    ids=["the-first-block", "after-a-skipped-block"],
)
def test_continues_needs_an_earlier_block_that_runs(text: str) -> None:
    with pytest.raises(MarkerError, match=r"p\.md:\d+: `continues`, but no earlier block on this page runs"):
        programs(parse_page("p.md", Path("p.md"), text))


def test_a_page_with_a_bad_marker_becomes_a_failing_test(tmp_path: Path) -> None:
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "README.md").write_text("```python\nx = 1\n```\n")
    (tmp_path / "docs" / "guide" / "a.md").write_text("<!-- test: nope -->\n```python\nx = 1\n```\n")
    found = collect(tmp_path)
    assert [(p.name, bool(p.error)) for p in found] == [
        ("README.md:L1", False),
        ("docs/guide/a.md:markers", True),
    ]
    assert found[1].error.startswith("docs/guide/a.md:1: unknown marker")


def test_the_pages_markers_parse() -> None:
    """The repository's own pages: every marker is valid, every skip has its reason (the fast
    loop's check; the distributed tests run the blocks)."""
    assert PROGRAMS, "no ```python block found in README.md or docs/"
    errors = [p.error for p in PROGRAMS if p.error]
    assert errors == [], "\n".join(errors)


RUNNER_SAMPLE = """\
```python
import os
import pickle

assert __name__ == "__main__"
assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(os.environ)
assert os.listdir(".") == []


class Point:
    pass


pickle.loads(pickle.dumps(Point()))  # found as __main__.Point, as in a script
```

<!-- test: ranks=2 -->
```python
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
```

<!-- test: continues -->
```python
assert total.item() == dist.get_world_size() == 2
```

```python
x = 1
y = x / 0
```
"""


@pytest.mark.distributed
def test_the_runner_on_a_sample_page(tmp_path: Path) -> None:
    page = tmp_path / "sample.md"
    page.write_text(RUNNER_SAMPLE)
    found = programs(parse_page("sample.md", page, RUNNER_SAMPLE))
    assert [(p.name, p.ranks, len(p.parts)) for p in found] == [
        ("sample.md:L1", 0, 1),
        ("sample.md:L18", 2, 1),
        ("sample.md:L28", 2, 2),
        ("sample.md:L32", 0, 1),
    ]
    for number, program in enumerate(found[:3]):
        cwd = tmp_path / f"run{number}"
        cwd.mkdir()
        run_program(program, cwd)
    cwd = tmp_path / "failing"
    cwd.mkdir()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_program(found[3], cwd)
    message = str(failure.value)
    assert message.startswith("sample.md:L32: the block failed:"), message
    assert f'File "{page}", line 34' in message, message  # the page's own line
    assert "y = x / 0" in message and "ZeroDivisionError" in message, message
