"""The package's structure read from its source, without importing it: which module imports which
(at the top, inside a function, under ``if TYPE_CHECKING:`` or by name through
``importlib.import_module``), the cycles in such a graph, module sizes, and the two lists that
``docs/architecture.md`` keeps for ``tests/test_architecture.py`` (the table of allowed package
dependencies and the modules allowed over the size limit).

Everything here is a pure function of files or of the graphs it is given, so that
``tests/test_architecture.py`` can check the checks on synthetic packages and graphs.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TOP = "at the top"
LOCAL = "inside a function"
TYPE_ONLY = "under TYPE_CHECKING"
BY_NAME = "by name (importlib.import_module)"


@dataclass(frozen=True)
class Edge:
    """One module importing another: how (:data:`TOP`, :data:`LOCAL`, :data:`TYPE_ONLY`,
    :data:`BY_NAME`) and on which line (the first such import of that module)."""

    how: str
    line: int


Graph = dict[str, dict[str, Edge]]
"""A module's dotted name -> the package's modules it imports -> how."""


def module_name(path: Path, package: Path) -> str:
    """``lightning_pipe/huggingface/check.py`` -> ``lightning_pipe.huggingface.check`` (a
    package's ``__init__.py`` is the package)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.AST, module: str, is_package: bool, modules: Iterable[str]) -> list[str]:
    """The package's modules that ``node`` imports, if it is an import (``from pkg import sub``
    imports ``pkg.sub``; ``from pkg import name`` imports ``pkg``; a package's own ``__init__``,
    run first by any import of its modules, is not counted: cycles through it show between
    packages, see :func:`package_graph`)."""
    known = set(modules)

    def longest_known(dotted: str) -> list[str]:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                return [".".join(parts[:end])]
        return []

    if isinstance(node, ast.Import):
        return [m for alias in node.names for m in longest_known(alias.name)]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's own package upwards
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join([*here, base] if base else here)
        found = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found += [sub] if sub in known else longest_known(base)
        return found
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return longest_known(node.args[0].value)
    return []


def module_graph(package: Path) -> Graph:
    """Every module of ``package`` (a directory) -> the modules of the package it imports, by any
    of the four ways (see :class:`Edge`); a module importing itself is left out."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    return {
        name: _edges(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", set(paths))
        for name, path in paths.items()
    }


def _edges(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> dict[str, Edge]:
    edges: dict[str, Edge] = {}

    def add(node: ast.AST, how: str) -> None:
        targets = _imported(node, name, is_package, modules)
        if isinstance(node, ast.Call):
            how = BY_NAME if how == TOP else f"{how}, {BY_NAME}"
        line = getattr(node, "lineno", 0)
        for target in targets:
            if target != name and (target not in edges or edges[target].line > line):
                edges[target] = Edge(how, line)

    def walk(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for inner in child.body:
                    add(inner, TYPE_ONLY)
                    walk(inner, TYPE_ONLY)
                for inner in child.orelse:
                    add(inner, how)
                    walk(inner, how)
                continue
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            inner_how = LOCAL if how == TOP and function else how
            add(child, inner_how)
            walk(child, inner_how)

    walk(tree, TOP)
    return edges


def package_of(module: str) -> str:
    """``lightning_pipe.huggingface.check`` -> ``huggingface``; ``lightning_pipe.mesh`` ->
    ``mesh``; the top level ``lightning_pipe`` -> itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: Graph) -> dict[str, dict[str, str]]:
    """Each package -> the other packages its modules import -> the first such import, described
    (``"lightning_pipe.consolidate imports lightning_pipe.huggingface.export inside a function,
    line 66"``)."""
    packages: dict[str, dict[str, str]] = {}
    for module in sorted(graph):
        own = package_of(module)
        packages.setdefault(own, {})
        for target, edge in sorted(graph[module].items()):
            other = package_of(target)
            if other != own and other not in packages[own]:
                packages[own][other] = describe(module, target, edge)
    return packages


def describe(module: str, target: str, edge: Edge) -> str:
    return f"{module} imports {target} {edge.how}, line {edge.line}"


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The cycles of ``graph``: in each strongly connected component, a shortest cycle through
    each of its members (each cycle once), as a chain that ends where it starts (``["a", "b",
    "a"]``); ``[]`` when the graph has no cycle."""
    successors = {node: sorted(set(targets)) for node, targets in graph.items()}
    for targets in list(successors.values()):
        for target in targets:
            successors.setdefault(target, [])
    # Tarjan's strongly connected components, iteratively (no recursion limit to meet).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(successors):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for k in range(position, len(successors[node])):
                target = successors[node][k]
                if target not in index:
                    work += [(node, k + 1), (target, 0)]
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    cycles: list[list[str]] = []
    for component in sorted(components):
        if len(component) == 1 and component[0] not in successors[component[0]]:
            continue
        members = set(component)
        for start in component:  # a shortest cycle through each member, each cycle once
            cycle = _shortest_cycle(start, successors, members)
            low_point = cycle.index(min(cycle[:-1]))
            rotated = [*cycle[low_point:-1], *cycle[:low_point], cycle[low_point]]
            if rotated not in cycles:
                cycles.append(rotated)
    return cycles


def _shortest_cycle(start: str, successors: Mapping[str, list[str]], members: set[str]) -> list[str]:
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:  # breadth first: the shortest way back to the start
        node = queue.popleft()
        if start in successors[node]:
            chain = [node]
            while chain[-1] != start:
                chain.append(came_from[chain[-1]])
            return [start, *reversed(chain[:-1]), start]
        for target in successors[node]:
            if target in members and target not in came_from and target != start:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"{start} is on no cycle of its component")


def render_cycle(chain: list[str], graph: Graph | None = None) -> str:
    """``a -> b -> a``, then, given the module graph, how and where each link imports."""
    text = " -> ".join(chain)
    if graph is not None:
        for module, target in itertools.pairwise(chain):
            text += f"\n    {describe(module, target, graph[module][target])}"
    return text


# ----------------------------------------------------------------------------- docs/architecture.md
EXTERNAL = {"torch", "lightning"}
"""Names the table's "may import" column mentions that are not packages of lightning_pipe."""


def table_rows(doc: str) -> list[tuple[list[str], set[str]]]:
    """The rows of the table under "The packages, and what each may import", in order: the
    packages a row names (its first column's names in backticks, a trailing ``/`` dropped) and
    what they may import (the third column's names in backticks but :data:`EXTERNAL` ones; the
    words "everything above" add every package of the rows above)."""
    section = doc.split("## The packages, and what each may import", 1)
    if len(section) < 2:
        raise ValueError("docs/architecture.md has no section 'The packages, and what each may import'")
    rows: list[tuple[list[str], set[str]]] = []
    above: set[str] = set()
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-", " "} or cells[0] == "package":
            continue
        names = [n.rstrip("/") for n in re.findall(r"`([^`]+)`", cells[0])]
        allowed = {n.rstrip("/") for n in re.findall(r"`([^`]+)`", cells[-1])} - EXTERNAL
        if "everything above" in cells[-1]:
            allowed |= above
        rows.append((names, allowed))
        above |= set(names)
    return rows


def table_differences(doc: str, allowed: Mapping[str, set[str]]) -> list[str]:
    """Where the document's table and ``allowed`` (the test's map) disagree, one line each, and
    where a row may import a package that is not in a row above it (the table's promise)."""
    differences = []
    table: dict[str, set[str]] = {}
    above: set[str] = set()
    rows = table_rows(doc)
    every_row = {name for names, _ in rows for name in names}
    for names, may in rows:
        for name in names:
            table[name] = may
            below = sorted((may & every_row) - above)
            if below:
                differences.append(f"{name}: the table lets it import {below}, not in a row above it")
        above |= set(names)
    for name in sorted(set(table) | set(allowed)):
        if name not in table:
            differences.append(f"{name}: in ALLOWED, not in the table")
        elif name not in allowed:
            differences.append(f"{name}: in the table, not in ALLOWED")
        else:
            if table[name] - allowed[name]:
                extra = sorted(table[name] - allowed[name])
                differences.append(f"{name}: the table allows {extra}, ALLOWED does not")
            if allowed[name] - table[name]:
                extra = sorted(allowed[name] - table[name])
                differences.append(f"{name}: ALLOWED allows {extra}, the table does not")
    return differences


OVERSIZE_SECTION = "## Modules over 400 lines"


def oversize_reasons(doc: str) -> dict[str, str]:
    """The section "Modules over 400 lines" of the document: each list item's module path (in
    backticks, first) -> the text after it (its reason)."""
    section = doc.split(OVERSIZE_SECTION, 1)
    if len(section) < 2:
        return {}
    reasons = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        item = re.match(r"\s*[-*]\s+`([^`]+)`\s*[:—-]?\s*(.*)", line)
        if item:
            reasons[item.group(1)] = item.group(2).strip()
    return reasons


def is_reason(text: str) -> bool:
    """A sentence: five words at least, ending with a full stop."""
    return len(text.split()) >= 5 and text.endswith(".")


def size_offenders(sizes: Mapping[str, int], reasons: Mapping[str, str], limit: int) -> list[str]:
    """Modules over ``limit`` lines without a reason in the document, reasons that are not a
    sentence, and reasons for modules that are not (or no longer) over the limit."""
    offenders = []
    for path, lines in sorted(sizes.items()):
        if lines > limit and path not in reasons:
            offenders.append(f"{path}: {lines} lines (limit {limit}); docs/architecture.md does not say why")
        elif lines > limit and not is_reason(reasons[path]):
            offenders.append(f"{path}: {lines} lines; its reason in docs/architecture.md is not a sentence")
    for path in sorted(reasons):
        if sizes.get(path, 0) <= limit:
            offenders.append(
                f"{path}: listed in docs/architecture.md's '{OVERSIZE_SECTION[3:]}' but "
                + (f"has {sizes[path]} lines" if path in sizes else "is not a size-limited module")
                + ": take it off the list"
            )
    return offenders
