"""Slow-body clients against a `cbq serve` of the soak (`tests/reliability/soak.py`): a few clients at a time, each
sending a POST's headers and then its body a byte at a time, as a slow-loris attack or a stalled upload does.
The server must end each of them by its `--body-timeout` (a 408, or the connection closed), while it keeps
answering everyone else; `probe_health` is that everyone else."""

from __future__ import annotations

import select
import threading
import time

from tests.producer.server.serving import ServeProcess, read_response, request_head

ANSWER_SLACK_SECONDS = 5.0  # past the body deadline, for a loaded 2-core box
HEALTH_TIMEOUT_SECONDS = 5.0


class SlowBodyClients:
    """`concurrency` slow-body clients at a time against `server`, from `start()` to `stop()`; counts those the
    server ended in time (`ended`) and describes every other outcome in `failures`."""

    def __init__(self, server: ServeProcess, concurrency: int, body_timeout_s: float, trickle_seconds: float = 0.5):
        self.server = server
        self.body_timeout_s = body_timeout_s
        self.trickle_seconds = trickle_seconds
        self.ended = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._keep_one_going, daemon=True) for _ in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(self.body_timeout_s + 2 * ANSWER_SLACK_SECONDS)

    def _keep_one_going(self) -> None:
        while not self._stopping.is_set():
            outcome = self._one()
            with self._lock:
                if outcome is None:
                    self.ended += 1
                else:
                    self.failures.append(outcome)

    def _one(self) -> str | None:
        """One client, start to end: None when the server ended it in time, else what went wrong."""
        deadline = self.body_timeout_s + ANSWER_SLACK_SECONDS
        started = time.monotonic()
        try:
            sock = self.server.connect()
        except OSError as exc:
            return f"could not connect: {exc!r}"
        with sock:
            head = request_head("POST", "/v1/batches", None, content_type="application/json", content_length="4096")
            try:
                sock.sendall(head + b'{"input_file_id": ')
                while time.monotonic() - started < deadline:
                    readable, _, _ = select.select([sock], [], [], self.trickle_seconds)
                    if readable:
                        break
                    sock.sendall(b" ")
                status = read_response(sock, timeout_s=max(0.1, deadline - (time.monotonic() - started))).status
            except (BrokenPipeError, ConnectionResetError):
                status = None  # closed on it: an end too, if in time
            except (AssertionError, TimeoutError) as exc:
                return f"no answer within {deadline:.0f} s: {exc}"
        elapsed = time.monotonic() - started
        if status not in (None, 408):
            return f"answered {status} instead of 408 after {elapsed:.1f} s"
        if elapsed > deadline:
            return f"ended after {elapsed:.1f} s, past the {self.body_timeout_s:g} s body timeout"
        return None


def probe_health(server: ServeProcess) -> str | None:
    """GET /health on a fresh connection: None when it answers 200 or 503 (Redis down) in time, else what
    happened."""
    try:
        with server.connect() as sock:
            sock.sendall(request_head("GET", "/health", None, content_length="0"))
            status = read_response(sock, timeout_s=HEALTH_TIMEOUT_SECONDS).status
    except (OSError, AssertionError) as exc:
        return f"GET /health: {exc!r}"[:300]
    return None if status in (200, 503) else f"GET /health answered {status}"

