"""Fault injection: a private redis-server (AOF on, so kill -9 and restart keep its data), real `cbq worker`
processes that get SIGKILLed, and helpers that check exactly-once completion.

Nothing here touches the shared Redis on 6379: each test starts its own server on a free port under tmp_path.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from producer import store
from producer.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
# Short enough that a dead worker's chunks come back within seconds, long enough for a loaded 2-core box.
FAST_RECOVERY_FLAGS = ("--heartbeat-interval", "1", "--stale-after", "4", "--maintenance-interval", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> float:
    """Poll until `predicate()` is true; returns the seconds it took. Fails the test on timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


class RedisServer:
    """A redis-server of the test's own: append-only file with fsync on every write, on a free port."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.data_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self.answers, timeout=10)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.2).ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False

    def kill(self) -> None:
        """kill -9: no shutdown save; what survives is what the append-only file has."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def connect(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path):
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


class WorkerProcess:
    """`python -m producer.cli worker --fake-engine ...` in a process of its own, logging to a file."""

    def __init__(self, url: str, log_path: Path, *args: str, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [
            sys.executable,
            "-m",
            "producer.cli",
            "worker",
            "--redis-url",
            url,
            "--log-level",
            "INFO",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()


@pytest.fixture
def start_worker(redis_server, tmp_path):
    """start_worker(*flags) -> a running WorkerProcess on the test's server; all are SIGKILLed at teardown."""
    workers: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        w = WorkerProcess(redis_server.url, tmp_path / f"worker{len(workers)}.log", *args, env=env)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.kill()
        w.wait()


@pytest.fixture
def cbq(redis_server):
    """Run `cbq ARGS...` in this process against the test's server; returns click's Result."""
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(main, [*map(str, args), "--redis-url", redis_server.url], input=input)

    return invoke


def submit_prompts(cbq, tmp_path: Path, n: int, *args) -> str:
    path = tmp_path / f"in{n}.jsonl"
    path.write_text(
        "".join(json.dumps({"custom_id": f"r{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(n))
    )
    out = cbq("submit", path, "--json", *args)
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout.strip().splitlines()[-1])["batch_id"]


def assert_exactly_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    """Every request has exactly one result line, every one completed, and the counters agree with the lines."""
    lines = [line.model_dump() for line in store.iter_results(conn, batch_id)]
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(n)]
    bad = [line for line in lines if line["finish_reason"] not in ("stop", "length")]
    assert not bad, bad[:3]
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_failed, status.num_cancelled, status.num_running) == (n, 0, 0, 0)
    assert status.completion_tokens == sum(line["usage"]["completion_tokens"] for line in lines)
