"""The arrows run one way: `worker` imports `producer`, `producer` never imports (or names) `worker`."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from producer import lazy_group
from producer.cli import main

PRODUCER = Path(__file__).resolve().parents[2] / "producer"


def _worker_references(path: Path) -> list[str]:
    """Imports of `worker` and strings that name a worker module ("worker.x" or "worker:x")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "worker"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "worker":
            found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(("worker.", "worker:")):
                found.append(node.value)
    return found


def test_producer_source_names_no_worker_module():
    offenders = {
        str(p.relative_to(PRODUCER)): refs for p in PRODUCER.rglob("*.py") if (refs := _worker_references(p))
    }
    assert not offenders, offenders


def _modules_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running `code`."""
    code += "; import sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_importing_every_producer_module_imports_nothing_of_worker():
    modules = _modules_after(
        "import importlib, pkgutil, producer; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(producer.__path__, 'producer.')]"
    )
    assert "worker" not in modules and "torch" not in modules


def test_cbq_submit_help_imports_no_plugin_and_cbq_help_no_torch():
    invoke = (
        "from click.testing import CliRunner; from producer.cli import main; CliRunner().invoke(main, {})"
    )
    assert "worker" not in _modules_after(invoke.format("['submit', '--help']"))
    assert "torch" not in _modules_after(invoke.format("['--help']"))


def test_plugin_commands_come_from_entry_points():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("submit", "stats", "worker", "run", "bench"):
        assert name in result.output


def test_a_missing_entry_point_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(lazy_group, "entry_points", lambda group: [])
    result = CliRunner().invoke(lazy_group.PluginGroup("cbq"), ["worker", "--help"])
    assert result.exit_code == 2
    assert "No such command 'worker'" in result.output
    assert (
        "'cbq.commands' entry points are registered" in result.output and "pip install -e ." in result.output
    )


def test_a_plugin_that_fails_to_import_is_listed_and_explains_itself():
    group = lazy_group.PluginGroup("cbq", lazy_commands={"broken": "no_such_module_xyz:cmd"})
    help_text = CliRunner().invoke(group, ["--help"]).output
    assert "broken" in help_text and "unavailable" in help_text
    result = CliRunner().invoke(group, ["broken", "--anything"])
    assert result.exit_code == 1 and "importing no_such_module_xyz failed" in result.output
