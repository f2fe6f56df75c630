"""The docs are true: the generated parts match the code, and every shell and Python block in README.md and
docs/*.md runs as written.

Blocks run in document order, each document in a fresh folder of its own (with `examples/` linked in), with
`cbq` on PATH, CBQ_REDIS_URL pointing at this session's private redis-server (flushed first) and a live
`cbq worker --model tiny-llama` on CBQ_QUEUE, as the docs assume a worker is running. A block that
cannot run here (it needs a GPU, a downloaded checkpoint or a Docker daemon) is preceded by an HTML comment
`<!-- not run: REASON -->`, so a reader sees which ones are not checked and why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(<!-- not run: (?P<reason>[^>]*?) -->\s*\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S
)
BLOCK_SECONDS = 180


def blocks(path: Path) -> list[tuple[str, str, str | None]]:
    """(language, code, reason it is not run or None) for each bash and python block of a document."""
    return [(m["lang"], m["code"], m["reason"]) for m in BLOCK.finditer(path.read_text())]


def test_generated_docs_are_current():
    # A fresh interpreter: click caches a command's help option on first use, so a command another test
    # invoked on its own (without the root's `-h`) would print its help differently in this process.
    check = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, f"run `python docs/generate.py` and commit the result:\n{check.stderr}"


def test_every_block_not_run_says_why():
    for path in DOCUMENTS:
        for lang, _code, reason in blocks(path):
            assert reason is None or reason.strip(), (
                f"{path.name}: a {lang} block is skipped without a reason"
            )


@pytest.mark.redis_server
@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_the_blocks_of_a_document_run_as_written(path, private_redis_url, tmp_path):
    runnable = [(lang, code) for lang, code, reason in blocks(path) if reason is None]
    if not runnable:
        pytest.skip(f"{path.name} has no block to run")
    redis.Redis.from_url(private_redis_url).flushdb()
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "CBQ_REDIS_URL": private_redis_url,
        "CBQ_QUEUE": f"docs-{uuid.uuid4().hex[:8]}",
    }
    worker_log = open(tmp_path / "worker.log", "w")  # noqa: SIM115
    worker = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "worker", "--model", "tiny-llama", "--log-level", "WARNING"],
        cwd=ROOT,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sessions = [worker.pid]  # process groups to end once the document is done (blocks may start servers)
    try:
        _run_blocks(path, runnable, tmp_path, env, sessions)
    finally:
        for pgid in sessions:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.wait()
        worker_log.close()


def _run_blocks(
    path: Path, runnable: list[tuple[str, str]], cwd: Path, env: dict[str, str], sessions: list[int]
):
    """Run each block to its end; what it starts in the background runs on until the document is done."""
    for i, (lang, code) in enumerate(runnable):
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        log_path = cwd / f"block{i + 1}.log"
        with open(log_path, "w") as log:  # a file, not a pipe: a background process must not hold it open
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        sessions.append(proc.pid)
        try:
            proc.wait(timeout=BLOCK_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        output = log_path.read_text()
        assert proc.returncode == 0, (
            f"{path.name}, {lang} block {i + 1} failed:\n{code}\n--- output ---\n{output[-3000:]}"
        )


def test_the_readme_says_what_a_new_user_needs_before_each_step():
    """What a fresh clone trips on: bare `cbq` after a venv install, a client that waits for no worker, `cbq
    serve` without its extra, and a torch pin that reads as a requirement."""
    text = (ROOT / "README.md").read_text()
    sections = {
        title: " ".join(body.split()) for title, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    }
    two_commands = sections["Two commands"]
    assert "source .venv/bin/activate" in two_commands and ".venv/bin/cbq" in two_commands
    assert "CPU development machines" in two_commands and "it is not a requirement" in two_commands
    assert "random-weight `tiny-llama` demo preset and says so" in two_commands
    client = sections["Python client"]
    assert "running worker" in client.split("```")[0]  # said before the snippet
    assert "pip install -e '.[server]'" in sections["OpenAI-compatible Batch API"]
