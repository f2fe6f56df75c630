"""`cbq serve` bounds what one client costs: body sizes while they stream, header, body and keep-alive timeouts, and
the number of open connections. Raw sockets, since no HTTP library sends half a request on purpose."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.producer.server.serving import (
    ServeProcess,
    chunked,
    is_closed_within,
    read_response,
    request,
    request_head,
    send_until_answered,
)

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.redis_server

KEY = "limits-key"
MAX_FILE_BYTES = 100_000
TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
PIECE = b"x" * 65536


def _kernel_buffer_bytes() -> int:
    """The most a loopback connection can hold in flight: the largest receive plus send buffer (autotuned)."""
    try:
        rmem, wmem = (
            int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
            for name in ("tcp_rmem", "tcp_wmem")
        )
    except (OSError, ValueError, IndexError):
        return 16 << 20
    return rmem + wmem


# What a server that stops reading at the limit lets in at most: the limit and the kernel's buffers. Twice that is
# offered, and a server that read it all (as one spooling the whole body first does) fails the bound.
IN_FLIGHT_BYTES = MAX_FILE_BYTES + _kernel_buffer_bytes() + (1 << 20)


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_redis_url):
    tmp = tmp_path_factory.mktemp("limits")
    args = ["--max-file-bytes", str(MAX_FILE_BYTES), "--max-connections", str(MAX_CONNECTIONS)]
    args += ["--max-connections-per-client", str(MAX_CONNECTIONS)]  # the share: test_slow_clients.py
    args += [
        "--header-timeout",
        str(TIMEOUT_S),
        "--body-timeout",
        str(TIMEOUT_S),
        "--keep-alive-timeout",
        "1",
    ]
    proc = ServeProcess(private_redis_url, tmp, *args, api_keys=KEY)
    yield proc
    proc.stop()


BOUNDARY = "cbqtestboundary"


def _chunked_upload_head(boundary: str) -> bytes:
    content_type = f"multipart/form-data; boundary={boundary}"
    return request_head("POST", "/v1/files", KEY, content_type=content_type, transfer_encoding="chunked")


def _multipart_pieces(boundary: str, num_pieces: int):
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    for _ in range(num_pieces):
        yield PIECE


def test_a_chunked_upload_is_stopped_at_the_limit_not_spooled(server):
    with server.connect() as sock:
        sock.sendall(_chunked_upload_head(BOUNDARY))
        # 64 MiB offered, 640 times the limit; the server must answer long before.
        num_sent, response = send_until_answered(
            sock,
            chunked(_multipart_pieces(BOUNDARY, 2 * IN_FLIGHT_BYTES // len(PIECE))),
            max_bytes=2 * IN_FLIGHT_BYTES,
        )
    assert response is not None, f"no answer after {num_sent} bytes"
    error = response.assert_openai_error(413, "file_too_large")
    assert error["param"] == "file" and str(MAX_FILE_BYTES) in error["message"]
    assert num_sent < IN_FLIGHT_BYTES, f"{num_sent} bytes went in before the 413"
    assert response.headers.get("connection") == "close"
    leftovers = [p for p in os.listdir(server.files_dir) if not p.startswith("file-")]
    assert leftovers == []


def test_a_declared_content_length_over_the_limit_is_refused_before_the_body(server):
    with server.connect() as sock:
        sock.sendall(
            request_head(
                "POST",
                "/v1/files",
                KEY,
                content_type="multipart/form-data; boundary=b",
                content_length="10000000",
            )
        )
        read_response(sock).assert_openai_error(413, "file_too_large")


def test_a_json_body_is_bounded_while_it_is_read(server):
    with server.connect() as sock:
        sock.sendall(
            request_head(
                "POST", "/v1/batches", KEY, content_type="application/json", transfer_encoding="chunked"
            )
        )
        body = (b'{"metadata": {"k": "' + PIECE for _ in range(1))
        filler = (PIECE for _ in range(2 * IN_FLIGHT_BYTES // len(PIECE)))
        pieces = (p for part in (body, filler) for p in part)
        num_sent, response = send_until_answered(sock, chunked(pieces), max_bytes=2 * IN_FLIGHT_BYTES)
    assert response is not None, f"no answer after {num_sent} bytes"
    response.assert_openai_error(413, "request_too_large")
    assert num_sent < IN_FLIGHT_BYTES, num_sent


def test_an_idle_connection_is_closed_after_the_header_timeout(server):
    with server.connect() as sock:
        start = time.monotonic()
        assert is_closed_within(sock, TIMEOUT_S + 3), "an idle connection stayed open"
        assert time.monotonic() - start >= TIMEOUT_S * 0.9


def test_half_sent_headers_are_dropped(server):
    with server.connect() as sock:
        sock.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: test\r\n")
        for _ in range(3):  # trickling header bytes does not keep it open
            time.sleep(TIMEOUT_S / 3)
            sock.sendall(b"X-Slow: 1\r\n")
        assert is_closed_within(sock, TIMEOUT_S + 3), "a connection with half-sent headers stayed open"


def test_a_stalled_body_gets_408_and_the_connection_is_closed(server):
    with server.connect() as sock:
        sock.sendall(
            request_head("POST", "/v1/batches", KEY, content_type="application/json", content_length="1000")
            + b'{"input_file_id": '
        )
        response = read_response(sock, timeout_s=TIMEOUT_S + 4)
        response.assert_openai_error(408, "request_timeout")
        assert is_closed_within(sock, 2)


def test_an_idle_keep_alive_connection_is_closed(server):
    with server.connect() as sock:
        sock.sendall(request_head("GET", "/v1/batches", KEY))
        assert read_response(sock).status == 200
        assert is_closed_within(sock, 4), "an idle keep-alive connection stayed open"


def test_connections_past_the_cap_get_503_and_the_server_recovers(server):
    held = [server.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # accepted by the server's loop
        with server.connect() as extra:
            response = read_response(extra)
            response.assert_openai_error(503, "too_many_connections")
            assert response.headers.get("retry-after") == "1"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert request(server, "GET", "/v1/batches", KEY).status == 200


def test_the_limits_are_per_route_a_small_upload_passes(server):
    line = json.dumps({"custom_id": "a", "prompt": "hi", "max_tokens": 2}).encode() + b"\n"
    boundary = BOUNDARY
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        ).encode()
        + line * 1000
        + f"\r\n--{boundary}--\r\n".encode()
    )
    assert 2 * MAX_FILE_BYTES > len(body) > MAX_FILE_BYTES // 2
    with server.connect() as sock:
        head = _chunked_upload_head(BOUNDARY)
        sock.sendall(head + b"".join(chunked([body[i : i + 8192] for i in range(0, len(body), 8192)])))
        response = read_response(sock)
    assert response.status == 200 and response.json()["bytes"] == len(line) * 1000, response.body


@pytest.mark.parametrize(
    "raw",
    [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000],
    ids=["garbage", "unfinished-headers-over-16KiB"],
)
def test_a_request_that_is_not_http_gets_an_openai_400(server, raw):
    with server.connect() as sock:
        sock.sendall(raw)
        read_response(sock).assert_openai_error(400, "invalid_http_request")


def test_the_openai_sdk_sees_the_413_of_a_file_over_the_limit(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", b"x" * (50 * MAX_FILE_BYTES)), purpose="batch")
    assert info.value.status_code == 413 and info.value.body["code"] == "file_too_large"
