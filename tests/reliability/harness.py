"""Fault-injection harness, for tests/reliability and benchmarks/reliability.py: a private redis-server with an
fsynced append-only file (so kill -9 and a restart keep every acknowledged write), `cbq worker` processes, a
TCP proxy that loses the reply of a transaction the server applied, and one that delays what a server sends
(a replica's replication stream held back, so that a write the primary acknowledged is not on it yet).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
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

    def __init__(self, data_dir: Path, durable: bool = True, extra_args: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.durable = durable
        self.extra_args = extra_args  # e.g. ("--replicaof", host, port)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.has_run = False  # once it has, the port and the URL the tests hold stay

    def start(self) -> None:
        """Start the server (again, after a kill: same port, same data) and wait until it answers. Tests run
        in parallel processes, so another one may bind the free port first: then this server exits at once,
        and on its first start takes another port; a server on the port that is not ours never counts."""
        for _ in range(5):
            proc = self.proc = subprocess.Popen(
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
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_until(lambda proc=proc: proc.poll() is not None or self.answers(), timeout=10)
            if proc.poll() is None:
                self.has_run = True
                return
            if self.has_run:
                raise AssertionError(f"redis-server exited ({proc.returncode}) on restart: port {self.port} taken")
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
        raise AssertionError("redis-server found no free port in 5 tries")

    def answers(self) -> bool:
        """This object's server (not another process's on the same port) answers, and has loaded its data: a
        restarted server answers INFO while it replays the append-only file but refuses every data command with
        LOADING, so a test that read it then would fail on BusyLoadingError."""
        try:
            conn = redis.Redis(port=self.port, socket_connect_timeout=0.2)
            if self.proc is None or conn.info("server")["process_id"] != self.proc.pid:
                return False
            return not int(conn.info("persistence").get("loading", 0))
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


class ReplyDroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of a redis-server that can lose the reply of a transaction after the
    server applied it: `drop_exec_replies(n, containing=b"...")` arms it for the next n EXECs whose MULTI
    carries those bytes. Such an EXEC is forwarded, the server's reply is swallowed, and after `apply_wait`
    seconds both sides of that connection are closed, as when Redis dies between applying and answering.
    Threads are daemons; `close()` stops it (tests call it at teardown)."""

    def __init__(self, upstream_port: int, apply_wait: float = 0.2):
        self.upstream_port = upstream_port
        self.apply_wait = apply_wait
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._lock = threading.Lock()
        self._armed: dict[bytes, int] = {}  # bytes a transaction contains -> how many more replies to drop
        self.num_dropped = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_exec_replies(self, n: int, containing: bytes = b"") -> None:
        with self._lock:
            self._armed[containing] = n

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:  # the server is down: so is the proxied connection
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            dropping = threading.Event()
            threading.Thread(target=self._to_server, args=(client, server, dropping), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, dropping), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, dropping: threading.Event) -> None:
        transaction = b""  # what the client sent since its last MULTI (empty outside a transaction)
        try:
            while data := client.recv(65536):
                if b"MULTI\r\n" in data:
                    transaction = data[data.index(b"MULTI\r\n") :]
                elif transaction:
                    transaction += data
                if b"EXEC\r\n" not in data:
                    server.sendall(data)
                    continue
                drop, transaction = self._take(transaction), b""
                if drop:
                    dropping.set()  # before the EXEC reaches the server: its reply must not get through
                    server.sendall(data)
                    time.sleep(self.apply_wait)
                    break
                server.sendall(data)
        except OSError:
            pass
        _close_both(client, server)

    def _take(self, transaction: bytes) -> bool:
        with self._lock:
            for containing, n in self._armed.items():
                if n > 0 and containing in transaction:
                    self._armed[containing] = n - 1
                    self.num_dropped += 1
                    return True
        return False

    @staticmethod
    def _to_client(server: socket.socket, client: socket.socket, dropping: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if dropping.is_set():
                    continue
                client.sendall(data)
        except OSError:
            pass
        _close_both(client, server)  # the server went away: so does the client's connection, as without a proxy


class DelayingProxy:
    """A TCP proxy on 127.0.0.1 in front of a redis-server that holds back what the server sends by `delay`
    seconds (what the client sends goes through at once). In front of a primary, with a replica connected to
    the proxy, the replica receives each write `delay` seconds after the primary applied it. Threads are
    daemons; `close()` stops it."""

    def __init__(self, upstream_port: int, delay: float):
        self.upstream_port = upstream_port
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            threading.Thread(target=self._forward, args=(client, server), daemon=True).start()
            threading.Thread(target=self._hold, args=(server, held), daemon=True).start()
            threading.Thread(target=self._release, args=(held, client, server), daemon=True).start()

    @staticmethod
    def _forward(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        _close_both(source, target)

    def _hold(self, server: socket.socket, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        try:
            while data := server.recv(65536):
                held.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        held.put((0.0, b""))  # the end: close once what came before it is sent

    @staticmethod
    def _release(held: queue.SimpleQueue[tuple[float, bytes]], client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                due, data = held.get()
                if not data:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                client.sendall(data)
        except OSError:
            pass
        _close_both(client, server)


def _close_both(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
