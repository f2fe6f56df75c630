"""`cbq serve` end to end: a real server and a real worker (tiny-llama on the CPU) on localhost, driven with the
`openai` SDK, against the Redis server in a db of their own (flushed before and after)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.responses import Response  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from producer.cli import main  # noqa: E402

pytestmark = pytest.mark.redis_server

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-2"
STARTUP_S = 120.0  # for the server and the worker to come up
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def _wait_for(what: str, check, procs, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        for proc in procs:
            assert proc.poll() is None, (
                f"{proc.args[3]} exited with {proc.returncode} while waiting for {what}"
            )
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    queue: str
    conn: redis.Redis
    env: dict[str, str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, private_redis_url):
    conn = redis.Redis.from_url(private_redis_url, socket_connect_timeout=0.5)
    conn.flushdb()
    tmp = tmp_path_factory.mktemp("api")
    queue = f"cbq-api-test-{uuid.uuid4().hex[:8]}"
    port, metrics_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "CBQ_API_KEYS": f"test-key-1,{API_KEY}",
        "CBQ_REDIS_URL": private_redis_url,
        "CBQ_QUEUE": queue,
    }
    cli = [sys.executable, "-m", "producer.cli"]
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("server", "worker")}  # noqa: SIM115
    server = subprocess.Popen(
        [*cli, "serve", "--port", str(port), "--files-dir", str(tmp / "files"), "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=logs["server"],
        stderr=subprocess.STDOUT,
    )
    worker = subprocess.Popen(
        [*cli, "worker", "--device", "cpu", "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
        cwd=ROOT,
        env=env,
        stdout=logs["worker"],
        stderr=subprocess.STDOUT,
    )
    try:
        # Starting means importing torch and loading a model: over 30 s on a loaded 2-core machine, with the
        # suite's other worker processes beside it.
        _wait_for("the server", lambda: _get(f"http://127.0.0.1:{port}/health"), [server], timeout=STARTUP_S)
        _wait_for(
            "the worker's metrics",
            lambda: _get(f"http://127.0.0.1:{metrics_port}/metrics"),
            [worker],
            timeout=STARTUP_S,
        )
        yield Stack(
            f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{metrics_port}/metrics", queue, conn, env
        )
    finally:
        for proc in (worker, server):
            proc.send_signal(signal.SIGINT)
        for proc in (worker, server):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name, log in logs.items():
            log.close()
            print(f"--- {name} log ---\n{(tmp / f'{name}.log').read_text()[-3000:]}")
        conn.flushdb()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=20)


def wait_for_batch(client, batch_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in TERMINAL:
            return batch, seen
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout} s"
        time.sleep(0.1)


def openai_lines(n: int, endpoint: str = "/v1/chat/completions", **body) -> list[dict]:
    lines = []
    for i in range(n):
        if endpoint == "/v1/chat/completions":
            payload = {"messages": [{"role": "user", "content": f"question {i}"}]}
        else:
            payload = {"prompt": f"prompt number {i} " * (1 + i % 3)}
        lines.append(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": endpoint,
                "body": {"model": "tiny-llama", "max_tokens": 4 + i % 5, **payload, **body},  # the served name
            }
        )
    return lines


def write_jsonl(path: Path, objs) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def scrape(stack) -> dict[str, float]:
    """Samples by name and labels, without the worker label: {'cbq_engine_tokens_total{kind=completion}': 12.0}."""
    samples = {}
    for family in text_string_to_metric_families(_get(stack.metrics_url)):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "worker")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# --- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_upload_create_poll_download_matches_cbq_run(stack, client, tmp_path, endpoint):
    # with OpenAI's penalties, as batch files written for OpenAI often carry them
    lines = openai_lines(6, endpoint, frequency_penalty=0.5, presence_penalty=-0.25, seed=1234)  # sampled: T=1
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.bytes == path.stat().st_size and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"

    created = client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", metadata={"job": "nightly"}
    )
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    batch, seen = wait_for_batch(client, created.id)
    assert batch.status == "completed", batch
    assert seen[-2:] in (["in_progress", "completed"], ["finalizing", "completed"]), seen
    assert batch.request_counts.total == batch.request_counts.completed == 6
    assert batch.in_progress_at and batch.completed_at and batch.finalizing_at and batch.error_file_id is None

    served = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert batch.usage.output_tokens == sum(
        s["response"]["body"]["usage"]["completion_tokens"] for s in served
    )
    out = tmp_path / "run.jsonl"
    ran = CliRunner().invoke(
        main, ["run", str(path), "-o", str(out), "--format", "openai", "--device", "cpu"]
    )
    assert ran.exit_code == 0, ran.output
    expected = [json.loads(line) for line in out.read_text().splitlines()]

    body_type = ChatCompletion if endpoint == "/v1/chat/completions" else Completion
    assert [line["custom_id"] for line in served] == [f"r{i}" for i in range(6)]
    for got, want in zip(served, expected, strict=True):
        assert got["error"] is None and got["response"]["status_code"] == 200
        got_body, want_body = (body_type.model_validate(x["response"]["body"]) for x in (got, want))
        assert got_body.choices[0].model_dump() == want_body.choices[0].model_dump()
        assert got_body.usage == want_body.usage and got_body.model == "tiny-llama"


def test_a_responses_batch_runs_and_its_output_parses_as_responses(stack, client, tmp_path):
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "tiny-llama", "input": f"question {i}", "instructions": "Be brief.",
                     "max_output_tokens": 4 + i % 3, "temperature": 0, "store": False, "metadata": {"i": str(i)}},
        }
        for i in range(4)
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "responses.jsonl", lines)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    assert created.endpoint == "/v1/responses"
    batch, _ = wait_for_batch(client, created.id)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    served = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    out = tmp_path / "run.jsonl"
    ran = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--format", "openai", "--device", "cpu"])
    assert ran.exit_code == 0, ran.output
    expected = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in served] == [f"r{i}" for i in range(4)]
    for i, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert got["error"] is None and got["response"]["status_code"] == 200
        got_body, want_body = (Response.model_validate(x["response"]["body"]) for x in (got, want))
        assert got_body.object == "response" and got_body.id == "resp_" + got["response"]["request_id"]
        assert (got_body.output_text, got_body.usage, got_body.status) == (
            want_body.output_text, want_body.usage, want_body.status,
        )  # fmt: skip
        assert got_body.metadata == {"i": str(i)} and got_body.instructions == "Be brief."
    assert batch.usage.output_tokens == sum(s["response"]["body"]["usage"]["output_tokens"] for s in served)

    chat = openai_lines(1)[0]  # a chat line in a responses batch: its url is not the batch's endpoint
    mixed = client.files.create(file=write_jsonl(tmp_path / "mixed.jsonl", [lines[0], chat]).open("rb"), purpose="batch")
    refused, _ = wait_for_batch(
        client, client.batches.create(input_file_id=mixed.id, endpoint="/v1/responses", completion_window="24h").id
    )
    assert refused.status == "failed"
    assert [(e.line, e.param, e.code) for e in refused.errors.data] == [(2, "url", "mismatched_endpoint")]


def test_a_wrong_api_key_gets_401(stack):
    wrong = openai.OpenAI(base_url=stack.base_url, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.batches.list()
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key" and info.value.body["type"] == "invalid_request_error"
    assert _get(stack.base_url.removesuffix("/v1") + "/health") is not None  # health needs no key


def test_each_key_of_a_plain_key_list_is_a_project_of_its_own(stack, client, tmp_path):
    # CBQ_API_KEYS=test-key-1,test-key-2: neither key sees, reads, cancels or deletes the other's files and batches.
    other = openai.OpenAI(base_url=stack.base_url, api_key="test-key-1", max_retries=0, timeout=20)
    uploaded = client.files.create(
        file=write_jsonl(tmp_path / "mine.jsonl", openai_lines(2)).open("rb"), purpose="batch"
    )
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(created.id),
        lambda: other.batches.cancel(created.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert created.id not in {b.id for b in other.batches.list(limit=100)}
    assert uploaded.id not in {f.id for f in other.files.list()}
    batch, _ = wait_for_batch(client, created.id)
    assert batch.status == "completed" and client.files.retrieve(uploaded.id).id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)


def test_an_invalid_file_fails_the_batch_with_openai_shaped_errors(stack, client, tmp_path):
    lines = openai_lines(3)
    lines[1]["body"]["temperature"] = -1
    lines.insert(2, "{not json")
    lines.append({**openai_lines(1, "/v1/completions")[0], "custom_id": "other-endpoint"})
    uploaded = client.files.create(
        file=write_jsonl(tmp_path / "bad.jsonl", lines).open("rb"), purpose="batch"
    )
    num_cbq_batches = stack.conn.zcard("cbq:batches")
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait_for_batch(client, created.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = [(e.line, e.param, e.code) for e in batch.errors.data]
    assert errors == [  # line 2's bad temperature is not a format error: it would fail alone
        (3, None, "invalid_json_line"),
        (5, "url", "mismatched_endpoint"),
    ]
    assert all(e.message for e in batch.errors.data)
    assert stack.conn.zcard("cbq:batches") == num_cbq_batches  # nothing was enqueued

    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    assert info.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h"
        )


def test_an_invalid_request_fails_alone_and_the_others_run(stack, client, tmp_path):
    lines = openai_lines(4)
    lines[1]["body"]["temperature"] = -1
    # logit_bias takes the model's token ids (as vLLM reads it): 50256 is not one of tiny-llama's 320, and that
    # request alone fails when the worker checks it against the vocabulary.
    lines[2]["body"]["logit_bias"] = {"50256": -100}
    uploaded = client.files.create(file=write_jsonl(tmp_path / "mixed.jsonl", lines).open("rb"), purpose="batch")
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait_for_batch(client, created.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 2, 2)
    served = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in served] == ["r0", "r3"]
    failed = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [line["custom_id"] for line in failed] == ["r1", "r2"]
    assert all(line["response"]["status_code"] == 400 for line in failed)
    errors = [line["response"]["body"]["error"] for line in failed]
    assert [(e["type"], e["param"], e["code"]) for e in errors] == [
        ("invalid_request_error", "temperature", "invalid_value"),
        ("invalid_request_error", None, "invalid_prompt"),
    ]
    assert "greater than or equal to 0" in errors[0]["message"]
    assert "logit_bias: token ids must be in [0, 320)" in errors[1]["message"]


def test_an_image_line_fails_alone_on_a_text_only_model(stack, client, tmp_path):
    """OpenAI batch lines with image parts pass the server as they are; the text-only worker refuses the one with
    an image, naming the part, before fetching it."""
    lines = openai_lines(2)
    lines[1]["body"]["messages"][0]["content"] = [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "low"}},
    ]
    uploaded = client.files.create(file=write_jsonl(tmp_path / "images.jsonl", lines).open("rb"), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch, _ = wait_for_batch(client, created.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 1, 1), batch
    (failed,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    error = failed["response"]["body"]["error"]
    assert (failed["custom_id"], failed["response"]["status_code"]) == ("r1", 400)
    assert (error["param"], error["code"]) == ("messages[0].content[1].image_url.url", "invalid_value")
    assert error["message"].startswith("tiny-llama takes text only: images run on")


def test_list_batches_pages_with_after_and_limit(client):
    listed = client.batches.list(limit=100).data
    assert len(listed) >= 3 and [b.created_at for b in listed] == sorted(
        (b.created_at for b in listed), reverse=True
    )
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [listed[0].id] and first.has_more
    second = client.batches.list(limit=2, after=listed[0].id)
    assert [b.id for b in second.data] == [b.id for b in listed[1:3]]
    assert [b.id for b in client.batches.list(limit=2)] == [b.id for b in listed]
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)


def test_files_list_retrieve_delete(client, tmp_path):
    uploaded = client.files.create(
        file=write_jsonl(tmp_path / "x.jsonl", openai_lines(1)).open("rb"), purpose="batch"
    )
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError) as info:
        client.files.retrieve(uploaded.id)
    assert info.value.body["code"] == "not_found"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_models_lists_the_workers_model(stack, client):
    _wait_for("the worker's stats", lambda: client.models.list().data or None, [], timeout=10)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_worker_metrics_move_with_a_batch(stack, client, tmp_path):
    before = scrape(stack)
    assert before["cbq_engine_kv_blocks_total"] > 0
    uploaded = client.files.create(
        file=write_jsonl(tmp_path / "m.jsonl", openai_lines(4)).open("rb"), purpose="batch"
    )
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait_for_batch(client, created.id)
    after = scrape(stack)
    assert after["cbq_worker_requests_finished_total"] - before["cbq_worker_requests_finished_total"] == 4
    completion = "cbq_engine_tokens_total{kind=completion}"
    assert after[completion] - before[completion] == batch.usage.output_tokens
    prompt, hits = "cbq_engine_tokens_total{kind=prompt}", "cbq_engine_prefix_cache_hit_tokens_total"
    # Every prompt token is either computed or found in the prefix cache (earlier tests sent the same prompts).
    assert after[prompt] - before[prompt] + after[hits] - before[hits] == batch.usage.input_tokens
    assert after["cbq_engine_steps_total"] > before["cbq_engine_steps_total"]
    assert after["cbq_engine_busy_seconds_total"] > before["cbq_engine_busy_seconds_total"]
    assert f"cbq_queue_depth{{queue={stack.queue}}}" in after


def test_cancel_stops_a_running_batch(client, tmp_path):
    lines = openai_lines(32, max_tokens=900, ignore_eos=True)  # long, within the 1,024-token context
    uploaded = client.files.create(
        file=write_jsonl(tmp_path / "long.jsonl", lines).open("rb"), purpose="batch"
    )
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    _wait_for(
        "in_progress", lambda: client.batches.retrieve(created.id).status == "in_progress" or None, [], 10
    )
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch, seen = wait_for_batch(client, created.id, timeout=20)
    assert batch.status == "cancelled" and seen[-1] == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 32
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == 32 - batch.request_counts.completed
    assert {e["error"]["code"] for e in errors} == {"cancelled"}


def test_serve_refuses_a_public_host_without_api_keys(monkeypatch, private_redis_url):
    monkeypatch.delenv("CBQ_API_KEYS", raising=False)
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--redis-url", private_redis_url])
    assert result.exit_code == 1 and "refusing to serve 0.0.0.0 without authentication" in result.output


def test_the_readme_python_client_example_runs(stack, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python client", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("CBQ_REDIS_URL", stack.env["CBQ_REDIS_URL"])
    monkeypatch.setenv("CBQ_QUEUE", stack.queue)
    exec(compile(code, "README.md (Python client)", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["q1", "q2"]
    assert all(line.split()[1] in ("stop", "length") for line in printed)
