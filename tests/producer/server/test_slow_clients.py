"""Slow clients cannot hold `cbq serve` (issue 44, item 3): a body trickled a byte at a time is cut at one
deadline for the whole body (the timeout used to restart with every piece), one client address gets only its
share of the connection cap, and a client dropped so costs the log one line, never a traceback. Raw sockets
against a `cbq serve` process with a small cap and a short deadline."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from tests.producer.server.serving import ServeProcess, is_closed_within, read_response, request, request_head

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.redis_server

KEY = "slow-key"
BODY_TIMEOUT_S = 1.5
SHARE = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_redis_url):
    args = ["--max-connections", "8", "--max-connections-per-client", str(SHARE)]
    args += ["--body-timeout", str(BODY_TIMEOUT_S), "--header-timeout", "3", "--log-level", "info"]
    proc = ServeProcess(private_redis_url, tmp_path_factory.mktemp("slow"), *args, api_keys=KEY)
    yield proc
    proc.stop()


def _connect_from(server: ServeProcess, source_ip: str) -> socket.socket:
    """A connection from another loopback address (Linux routes all of 127.0.0.0/8 to lo)."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source_ip, 0))
    sock.connect(("127.0.0.1", server.port))
    return sock


def test_a_trickled_body_is_cut_at_one_deadline(server):
    with server.connect() as sock:
        sock.sendall(request_head("POST", "/v1/batches", KEY, content_type="application/json", content_length="1000"))
        start = time.monotonic()
        sock.setblocking(False)
        while time.monotonic() - start < BODY_TIMEOUT_S + 5:  # a byte every 0.2 s: each piece well in time
            try:
                sock.send(b" ")
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # the server answered
            except BlockingIOError:
                pass
            time.sleep(0.2)
        sock.setblocking(True)
        response = read_response(sock, timeout_s=2)
        response.assert_openai_error(408, "request_timeout")
        assert time.monotonic() - start < BODY_TIMEOUT_S + 2, "the deadline restarted with each piece"
        assert is_closed_within(sock, 2)
    time.sleep(0.3)
    log = server.log()
    assert "Traceback" not in log, log
    assert request(server, "GET", "/v1/batches", KEY).status == 200


def test_one_client_gets_only_its_share_of_the_connections(server):
    held = [_connect_from(server, "127.0.0.2") for _ in range(SHARE)]
    try:
        for sock in held:  # each half-sends a request, as a slow client holding connections does
            sock.sendall(request_head("POST", "/v1/batches", KEY, content_length="1000")[:-10])
        time.sleep(0.2)
        with _connect_from(server, "127.0.0.2") as extra:
            response = read_response(extra)
            error = response.assert_openai_error(503, "too_many_connections")
            assert "this client" in error["message"].lower() and response.headers.get("retry-after") == "1"
        with _connect_from(server, "127.0.0.3") as other:  # another client is served meanwhile
            other.sendall(request_head("GET", "/v1/batches", KEY))
            assert read_response(other).status == 200
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    with _connect_from(server, "127.0.0.2") as again:  # the share is given back as connections close
        again.sendall(request_head("GET", "/v1/batches", KEY))
        assert read_response(again).status == 200
    log = server.log()
    assert "Traceback" not in log and "127.0.0.2 has 3 open already" in log, log


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/files"])
def test_a_client_that_goes_away_mid_body_costs_one_log_line(server, path):
    content_type = "application/json" if path == "/v1/batches" else "multipart/form-data; boundary=b"
    with server.connect() as sock:
        sock.sendall(request_head("POST", path, KEY, content_type=content_type, content_length="100000") + b"--b\r\n")
        time.sleep(0.3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    time.sleep(0.5)
    log = server.log()
    assert "Traceback" not in log, log
    assert f"POST {path}: the client went away before its body arrived" in log, log
