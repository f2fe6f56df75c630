"""`.ci/run`, with every tool it calls replaced by a stub that records its arguments: pytest runs over one
xdist worker per core with the 20 slowest tests listed, beside mypy; pytest's exit 5 (no tests ran) fails CI, and
so does either tool's failure; nothing installs a container engine. Also `tests/conftest.py`'s share of the cores
for each xdist worker."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import _share_the_cores_between_xdist_workers

ROOT = Path(__file__).resolve().parents[1]


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_ci(tmp_path: Path, pytest_status: int = 0, mypy_status: int = 0, workers: str | None = None):
    """Run a copy of .ci/run in `tmp_path`; returns (completed process, pytest's arguments, the tools called)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    venv_bin, tools = tmp_path / ".venv" / "bin", tmp_path / "tools"
    venv_bin.mkdir(parents=True)
    tools.mkdir()
    calls = tmp_path / "calls"
    for name in ("pip", "python"):
        _stub(venv_bin / name, f'echo "{name} $*" >> {calls}')
    (venv_bin / "activate").write_text(f'export PATH="{tools}:$PATH"\n')
    _stub(
        tools / "python",
        f'echo "python $*" >> {calls}; echo "$*" > {tmp_path}/pytest_args; exit {pytest_status}',
    )
    _stub(tools / "mypy", f'echo mypy >> {calls}; echo "mypy says hello"; exit {mypy_status}')
    _stub(tools / "ruff", f'echo "ruff $*" >> {calls}')
    for name in ("redis-server", "apt-get", "docker-compose"):  # present, so nothing is installed
        _stub(tools / name, f'echo "{name} $*" >> {calls}')
    env = {"PATH": f"{tools}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    if workers is not None:
        env["CBQ_TEST_WORKERS"] = workers
    proc = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60
    )
    args = (tmp_path / "pytest_args").read_text().split() if (tmp_path / "pytest_args").exists() else []
    return proc, args, calls.read_text().splitlines()


def test_ci_runs_pytest_on_one_worker_per_core_with_the_slowest_tests_listed_beside_mypy(tmp_path):
    proc, args, calls = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert args == [
        "-m",
        "pytest",
        "-q",
        "-n",
        str(len(os.sched_getaffinity(0))),
        "--dist",
        "worksteal",
        "--durations=20",
    ]
    assert "ruff check ." in calls and "mypy" in calls
    assert "mypy says hello" in proc.stdout
    assert not [c for c in calls if c.startswith(("apt-get", "docker-compose"))], calls


def test_ci_takes_the_number_of_workers_from_the_environment(tmp_path):
    _, args, _ = run_ci(tmp_path, workers="0")
    assert args[args.index("-n") + 1] == "0"


@pytest.mark.parametrize(
    "pytest_status, mypy_status, message",
    [(5, 0, "pytest collected no tests"), (1, 0, ""), (0, 1, "mypy failed"), (2, 1, "mypy failed")],
)
def test_ci_fails_when_no_test_ran_or_either_tool_failed(tmp_path, pytest_status, mypy_status, message):
    proc, _, _ = run_ci(tmp_path, pytest_status=pytest_status, mypy_status=mypy_status)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert message in proc.stderr


def test_each_xdist_worker_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    threads = torch.get_num_threads()
    try:
        _share_the_cores_between_xdist_workers()
        assert os.environ["OMP_NUM_THREADS"] == str(share)  # for the processes tests start
        assert torch.get_num_threads() == share
        monkeypatch.setenv("OMP_NUM_THREADS", "7")  # set by hand: left alone
        _share_the_cores_between_xdist_workers()
        assert os.environ["OMP_NUM_THREADS"] == "7" and torch.get_num_threads() == share
    finally:
        torch.set_num_threads(threads)
