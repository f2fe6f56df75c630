"""Helpers for the server tests: a `cbq serve` process of the test's own, and raw HTTP over a socket (for chunked
bodies, half-sent requests and idle connections, which an HTTP client library would not send)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.reliability.harness import REPO_ROOT, free_port, wait_until


class ServeProcess:
    """`python -m producer.cli serve` on a free port, logging to a file; `stop()` ends it."""

    def __init__(self, redis_url: str, tmp: Path, *args: str, api_keys: str = ""):
        self.port = free_port()
        self.redis_url = redis_url
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.files_dir = tmp / "files"
        self.log_path = tmp / "serve.log"
        env = {**os.environ, "CBQ_API_KEYS": api_keys, "CBQ_REDIS_URL": redis_url}
        env.pop("CBQ_QUEUE", None)
        cmd = [sys.executable, "-m", "producer.cli", "serve", "--port", str(self.port)]
        cmd += ["--files-dir", str(self.files_dir), "--log-level", "warning", *args]
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._answers, timeout=30, context=self.log)

    def _answers(self) -> bool:
        assert self.proc.poll() is None, f"cbq serve exited with {self.proc.returncode}:\n{self.log()}"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                return read_response(sock, timeout_s=2).status in (200, 503)
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def assert_openai_error(self, status: int, code: str | None = None) -> dict:
        """The response is OpenAI's error shape with this status; returns its `error` object."""
        assert self.status == status, (self.status, self.body[:500])
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        error = self.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert code is None or error["code"] == code, error
        return error


def read_response(sock: socket.socket, timeout_s: float = 5.0) -> Response:
    """One HTTP/1.1 response with a Content-Length (all cbq's are) from `sock`."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, deadline)
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        body += _recv(sock, deadline)
    return Response(int(status_line.split()[1]), headers, body[:length])


def _recv(sock: socket.socket, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    assert remaining > 0, "no complete response in time"
    sock.settimeout(remaining)
    piece = sock.recv(65536)
    assert piece, "the server closed the connection without a complete response"
    return piece


def is_closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """True once the server closes `sock` (EOF or reset) within `timeout_s`; what it sent before is ignored."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def send_until_answered(sock: socket.socket, pieces, max_bytes: int) -> tuple[int, Response | None]:
    """Send `pieces` (an iterable of bytes) until the server answers, closes, or `max_bytes` went out.
    Returns the bytes sent and the response, if one came."""
    num_sent = 0
    for piece in pieces:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable or num_sent >= max_bytes:
            break
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        num_sent += len(piece)
    try:
        return num_sent, read_response(sock, timeout_s=10)
    except (AssertionError, ConnectionResetError):
        return num_sent, None


def chunked(data_pieces):
    """HTTP/1.1 chunked transfer coding of `data_pieces`, ending with the last chunk."""
    for piece in data_pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def request_head(method: str, path: str, api_key: str | None, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if api_key is not None:
        lines.append(f"Authorization: Bearer {api_key}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def request(
    server: ServeProcess, method: str, path: str, api_key: str | None, body: bytes = b"", **headers: str
):
    """One request on a fresh connection (closed after), and its response."""
    with server.connect() as sock:
        sock.sendall(request_head(method, path, api_key, content_length=str(len(body)), **headers) + body)
        return read_response(sock)
