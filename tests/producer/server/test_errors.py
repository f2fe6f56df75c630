"""Every error of `cbq serve` has OpenAI's shape, Redis outages answer 503 with Retry-After, and input files that are
not UTF-8 fail their batch line by line instead of leaving it `validating`. Driven with the `openai` SDK where it
applies, against a server and a redis-server of the test's own."""

from __future__ import annotations

import json
import signal
import time

import pytest
import redis

from tests.producer.server.serving import ServeProcess, request
from tests.reliability.harness import RedisServer

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.redis_server

KEY = "errors-key"
TTL_SECONDS = 2 * 86400


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_redis_url):
    proc = ServeProcess(
        private_redis_url, tmp_path_factory.mktemp("errors"), "--ttl", str(TTL_SECONDS), api_keys=KEY
    )
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=10)


def _line(i: int) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(n: int) -> str:
    return "".join(json.dumps(_line(i)) + "\n" for i in range(n))


def _settle(client, batch_id: str, timeout_s: float = 10.0):
    """The batch once it has left `validating` (no worker runs here: a valid one stays in_progress)."""
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status == "validating":
        assert time.monotonic() < deadline, f"{batch_id} still validating after {timeout_s} s"
        time.sleep(0.05)
    return batch


def _create(client, data: bytes):
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


# --- input files that are not UTF-8 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "bad_lines"),
    [
        (_jsonl(2).encode("utf-16"), None),  # UTF-16 with its byte order mark: one error for the file
        (_jsonl(2).encode("utf-16-le"), None),  # without one: every line is full of NULs
        (_jsonl(1).encode() + '{"custom_id": "é"}\n'.encode("latin-1") + json.dumps(_line(3)).encode(), [2]),
        (bytes(range(256)) * 40, None),  # binary
    ],
    ids=["utf16-bom", "utf16le", "latin1-line", "binary"],
)
def test_a_file_that_is_not_utf8_fails_its_batch_line_by_line(client, data, bad_lines):
    batch = _settle(client, _create(client, data).id)
    assert batch.status == "failed" and batch.failed_at, batch
    errors = batch.errors.data
    assert errors and all(e.line and e.message for e in errors), errors
    if bad_lines is not None:
        assert [(e.line, e.code) for e in errors] == [(line, "invalid_encoding") for line in bad_lines], (
            errors
        )
        assert "UTF-8" in errors[0].message


def test_a_utf16_file_is_named_as_such(client):
    batch = _settle(client, _create(client, _jsonl(3).encode("utf-16")).id)
    assert [(e.line, e.code) for e in batch.errors.data] == [(1, "invalid_encoding")]
    assert "UTF-16" in batch.errors.data[0].message


def test_a_leading_utf8_bom_is_accepted(client):
    batch = _settle(client, _create(client, b"\xef\xbb\xbf" + _jsonl(2).encode()).id)
    assert batch.status == "in_progress" and batch.request_counts.total == 2, batch.errors


# --- bodies and parameters --------------------------------------------------------------------------------------


def test_completion_window_is_bounded_by_the_result_ttl(client):
    uploaded = client.files.create(file=("in.jsonl", _jsonl(1).encode()), purpose="batch")
    for window in ("9999999d", "3d", f"{TTL_SECONDS + 1}s"):
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window
            )
        assert info.value.body["param"] == "completion_window" and "ttl" in info.value.body["message"].lower()
    ok = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="2d"
    )
    assert ok.completion_window == "2d" and ok.expires_at - ok.created_at == TTL_SECONDS


def test_a_deeply_nested_body_is_a_400(server):
    body = b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = request(
        server, "POST", "/v1/batches", KEY, body, content_type="application/json"
    ).assert_openai_error(400)
    assert "nested" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/nothing-here", b"", 404),
        ("GET", "/v1/batches/batch_unknown", b"", 404),
        ("GET", "/v1/files/file-0123456789abcdef01234567/content", b"", 404),
        ("PUT", "/v1/batches", b"", 405),
        ("DELETE", "/v1/batches/batch_x/cancel", b"", 405),
        ("POST", "/v1/batches", b"[1, 2]", 400),
        ("POST", "/v1/batches", b"\xff\xfe", 400),
        ("POST", "/v1/batches", b'{"input_file_id": 3}', 400),
        ("POST", "/v1/files", b"not a form", 400),
    ],
)
def test_errors_have_openai_shape(server, method, path, body, status):
    response = request(server, method, path, KEY, body, content_type="application/json")
    error = response.assert_openai_error(status)
    assert error["type"] == "invalid_request_error"
    if status == 405:
        assert "allow" in response.headers


def test_batch_ids_that_name_internal_keys_are_not_found(client, server):
    """An id with a `:` (the finalize lock's key is the record's key plus `:final`) or one that matches another
    internal key is a clean 404, never a 500 from a Redis type error."""
    batch = _settle(client, _create(client, _jsonl(1).encode()).id)
    assert batch.status == "in_progress", batch
    client.batches.retrieve(batch.id)  # a view of an in-progress batch; then take the lock as finalizing would
    redis.Redis.from_url(server.redis_url).set(f"cbq:api:batch:{batch.id}:final", "1")
    for batch_id in (f"{batch.id}:final", f"{batch.id}:x", "batch_", batch.id.upper(), f"{batch.id}%0A"):
        for method, path in (("GET", f"/v1/batches/{batch_id}"), ("POST", f"/v1/batches/{batch_id}/cancel")):
            request(server, method, path, KEY).assert_openai_error(404, "not_found")
    assert client.batches.retrieve(batch.id).id == batch.id


def test_a_wrong_key_gets_an_openai_401(server):
    request(server, "GET", "/v1/batches", "not-a-key").assert_openai_error(401, "invalid_api_key")


# --- Redis down -------------------------------------------------------------------------------------------------


def _assert_503(call, within_s: float) -> None:
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        call()
    assert time.monotonic() - start < within_s, "a request waited too long on Redis"
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"].isdigit()
    assert info.value.body["code"] == "service_unavailable" and info.value.body["type"] == "server_error"


def test_redis_down_answers_503_with_retry_after(tmp_path):
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis", durable=False)
    redis_server.start()
    proc = ServeProcess(redis_server.url, tmp_path, api_keys=KEY)
    try:
        client = openai.OpenAI(base_url=proc.base_url, api_key=KEY, max_retries=0, timeout=30)
        uploaded = client.files.create(file=("in.jsonl", _jsonl(1).encode()), purpose="batch")
        created = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)  # stalled: the socket timeout bounds the wait
        try:
            _assert_503(lambda: client.batches.retrieve(created.id), within_s=9)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        redis_server.kill()  # gone: refused at once
        for call in (
            lambda: client.batches.list(),
            lambda: client.batches.retrieve(created.id),
            lambda: client.batches.cancel(created.id),
            lambda: client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            _assert_503(call, within_s=3)
        health = request(proc, "GET", "/health", None)
        assert health.status == 503 and "retry-after" in health.headers
        # Files live on disk: they are still served.
        assert client.files.retrieve(uploaded.id).id == uploaded.id
    finally:
        proc.stop()
        redis_server.kill()


# --- an unforeseen exception, in process ------------------------------------------------------------------------


def _asgi_get(app, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    """One GET through the ASGI app, no server: status, headers, body."""
    import asyncio

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def run():
        try:
            await app(scope, receive, send)
        except RuntimeError:
            pass  # Starlette re-raises what it answered with 500, for the server to log

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def test_an_unforeseen_exception_is_an_openai_500(tmp_path, fake_redis):
    from producer.client import Client
    from producer.server.app import create_app
    from producer.server.files import FileStore

    class BrokenFiles(FileStore):
        def list(self, purpose=None, project=None):
            raise RuntimeError("a bug")

    files = BrokenFiles(tmp_path, ttl_seconds=60, max_bytes=100)
    app = create_app(
        Client(connection=fake_redis, queue="q"), files, api_keys={}, ttl_seconds=60, chunk_size=10
    )
    status, headers, body = _asgi_get(app, "/v1/files")
    assert status == 500 and headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]
