"""The import structure of worker/engine: its modules and packages form layers (no import runs back up).

A "room" is a top-level module of worker/engine or one of its packages taken whole (models/, quant/, ...). Every
import of a worker.engine module counts, function-local and TYPE_CHECKING ones included, so a cycle cannot hide
inside a function. Read with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[3] / "worker" / "engine"
PACKAGE = "worker.engine"

# parallel/ holds only the process group, the per-step messages and the memory arithmetic.
PARALLEL_MODULES = {"__init__.py", "group.py", "messages.py", "memory.py"}


def module_names() -> dict[str, Path]:
    names = {}
    for path in ENGINE.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ENGINE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imported(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
        return
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base) + (f".{node.module}" if node.module else "")
    else:
        target = node.module or ""
    submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
    yield from submodules
    if len(submodules) < len(node.names) and target in known:
        yield target


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """module -> the worker.engine modules it imports; and the (module, import) pairs made inside a function."""
    known = module_names()
    graph: dict[str, set[str]] = {name: set() for name in known}
    local: list[tuple[str, str]] = []

    def visit(module: str, path: Path, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, path, child, known):
                    if target != module:
                        graph[module].add(target)
                        if in_function:
                            local.append((module, target))
            visit(
                module, path, child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            )

    for module, path in known.items():
        visit(module, path, ast.parse(path.read_text()), False)
    return graph, local


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 3:
        return "__init__"
    return f"{parts[2]}/" if (ENGINE / parts[2]).is_dir() else parts[2]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = room_of(module)
        rooms.setdefault(here, set())
        for target in targets:
            if room_of(target) != here and room_of(target) != "__init__":
                rooms[here].add(room_of(target))
    return rooms


def test_modules_import_no_circle() -> None:
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_rooms_form_layers() -> None:
    """No package or top-level module imports one that imports it back, directly or around a circle."""
    graph, _ = import_graph()
    rooms = room_graph(graph)
    found = cycles(rooms)
    detail = [
        f"{a} -> {b}: "
        + ", ".join(
            sorted(f"{m} -> {t}" for m in graph for t in graph[m] if room_of(m) == a and room_of(t) == b)
        )
        for component in found
        for a in component
        for b in sorted(rooms[a] & set(component))
    ]
    assert found == [], "\n".join(detail)


def test_parallel_holds_only_ranks_messages_and_memory() -> None:
    held = {path.name for path in (ENGINE / "parallel").glob("*.py")}
    assert held <= PARALLEL_MODULES, sorted(held - PARALLEL_MODULES)


def test_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_rank_runs_the_one_model_runner() -> None:
    """A tensor-parallel rank differs from one process by data (its TensorParallel and Replica), not a subclass."""
    subclasses = [
        f"{path.relative_to(ENGINE)}:{node.name}"
        for path in ENGINE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(isinstance(base, ast.Name | ast.Attribute) and ast.unparse(base).endswith("ModelRunner") for base in node.bases)
    ]
    assert subclasses == []


COLLECTIVES = {"reduce", "all_reduce", "all_gather", "gather_to_first", "gather_logits", "sum_in_rank_order"}


def _code_names(path: Path) -> set[str]:
    """Every name the code of `path` uses (variables, attributes, imports, arguments, definitions), not its text."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_decoder_names_no_precision_and_no_collective() -> None:
    """The owned decoder runs each linear through its ops and its shard: what precision a weight has and which
    collective completes a projection are the layer ops' and the shard's (layer_ops.py, layers/tensor_parallel.py)."""
    names = _code_names(ENGINE / "decoder.py")
    assert sorted(n for n in names if "fp8" in n.lower()) == []
    assert sorted(names & COLLECTIVES) == []
