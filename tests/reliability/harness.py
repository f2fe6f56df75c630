"""Fault-injection harness, for tests/reliability and benchmarks/reliability.py: a private redis-server with an
fsynced append-only file (so kill -9 and a restart keep every acknowledged write), and `cbq worker` processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], bool],
    timeout: float = 20.0,
    interval: float = 0.05,
    context: Callable[[], str] | None = None,
) -> float:
    """Poll until `predicate()` is true; returns the seconds it took. Fails the test on timeout, with what
    `context()` returns (a worker's log, say) in the message."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            detail = f"\n{context()}" if context is not None else ""
            raise AssertionError(f"condition not met within {timeout} s{detail}")
        time.sleep(interval)
    return time.monotonic() - start


class RedisServer:
    """A redis-server of the test's own on a free port. `durable` (the default): an append-only file with
    fsync on every write, so kill -9 and a restart keep every acknowledged write; otherwise memory only."""

    def __init__(self, data_dir: Path, durable: bool = True):
        self.data_dir = data_dir
        self.durable = durable
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
                *(("--appendonly", "yes", "--appendfsync", "always") if self.durable else ("--appendonly", "no")),
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
