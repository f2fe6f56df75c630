"""The modules of schemas/ import one another one way: no circle, TYPE_CHECKING and function-local imports
included (a circle hidden behind TYPE_CHECKING still ties the two modules' definitions together). Read with
`ast`: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.worker.engine.test_layering import cycles

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def schemas_import_graph() -> dict[str, set[str]]:
    """schemas module name -> the schemas modules it imports, anywhere in its code."""
    names = {path.stem for path in SCHEMAS.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        for node in ast.walk(ast.parse((SCHEMAS / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("schemas."):
                target = node.module.split(".")[1]
            elif isinstance(node, ast.ImportFrom) and node.module == "schemas":
                graph[name] |= {alias.name for alias in node.names if alias.name in names}
                continue
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name.split(".")[1] for a in node.names if a.name.startswith("schemas.")}
                continue
            else:
                continue
            if target in names and target != name:
                graph[name].add(target)
    return graph


def test_schemas_modules_import_no_circle() -> None:
    assert cycles(schemas_import_graph()) == []


def test_the_response_object_and_result_lines_share_output_parts_below_both() -> None:
    graph = schemas_import_graph()
    assert "result" not in graph["responses_output"] and "output_parts" in graph["responses_output"]
    assert "output_parts" in graph["result"]
    assert graph["output_parts"] == set()
