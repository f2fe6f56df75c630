"""BatchService without HTTP: a validation that never finished does not leave its batch `validating` forever."""

from __future__ import annotations

import io
import threading
import time

from producer.client import Client
from producer.server.auth import Principal
from producer.server.files import FileStore
from producer.server.service import BatchService
from producer.store.api_batches import MAX_REPORTED_ERRORS

ALPHA = Principal("alpha")


def _service(fake_redis, tmp_path, stale_seconds: int, max_threads: int = 1) -> BatchService:
    files = FileStore(tmp_path, ttl_seconds=600, max_bytes=1000)
    return BatchService(
        Client(connection=fake_redis, queue="q"),
        files,
        ttl_seconds=600,
        chunk_size=10,
        max_threads=max_threads,
        validation_stale_seconds=stale_seconds,
    )


def _record(service: BatchService, cancelling: bool):
    # A record as a server that died while validating left it: created, never validated.
    uploaded = service.files.save(io.BytesIO(b'{"prompt": "x"}\n'), "in.jsonl", "batch", "alpha")
    record = service.records.create("alpha", uploaded.id, "/v1/completions", 60, "1m", None, None)
    service.records.update(record.id, created_at=record.created_at - 10)
    if cancelling:
        service.records.update(record.id, cancelling_at=record.created_at)
    return record


def test_a_validation_that_never_finished_fails_its_batch(fake_redis, tmp_path):
    service = _service(fake_redis, tmp_path, stale_seconds=5)
    record = _record(service, cancelling=False)
    batch = service.view(ALPHA, record.id)
    assert batch["status"] == "failed" and batch["failed_at"]
    assert [e["code"] for e in batch["errors"]["data"]] == ["validation_interrupted"]
    service.shutdown()


def test_a_stale_validation_that_was_cancelled_ends_cancelled(fake_redis, tmp_path):
    service = _service(fake_redis, tmp_path, stale_seconds=5)
    record = _record(service, cancelling=True)
    assert service.view(ALPHA, record.id)["status"] == "cancelled"
    service.shutdown()


def test_a_fresh_validation_is_left_alone(fake_redis, tmp_path):
    service = _service(fake_redis, tmp_path, stale_seconds=3600)
    record = _record(service, cancelling=False)
    assert service.view(ALPHA, record.id)["status"] == "validating"
    service.shutdown()


def _upload(service: BatchService, data: bytes):
    uploaded = service.files.save(io.BytesIO(data), "in.jsonl", "batch", "alpha")
    return service.create(
        ALPHA,
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window_seconds=60,
        completion_window="1m",
        metadata=None,
        output_expires_seconds=None,
    )


def _settled(service: BatchService, batch_id: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (batch := service.view(ALPHA, batch_id))["status"] == "validating":
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
    return batch


def test_validations_run_one_at_a_time(fake_redis, tmp_path, monkeypatch):
    service = _service(fake_redis, tmp_path, stale_seconds=3600, max_threads=4)  # the finalize pool's size
    release = threading.Event()
    num_running, most_running = 0, 0
    validate = service.client.validate

    def held_validate(*args, **kwargs):
        nonlocal num_running, most_running
        num_running += 1
        most_running = max(most_running, num_running)
        release.wait(10)
        try:
            return validate(*args, **kwargs)
        finally:
            num_running -= 1

    monkeypatch.setattr(service.client, "validate", held_validate)
    batches = [_upload(service, b'{"prompt": "x"}\n') for _ in range(3)]
    time.sleep(0.3)
    assert (num_running, most_running) == (1, 1)
    release.set()
    assert [_settled(service, b["id"])["status"] for b in batches] == ["in_progress"] * 3
    assert most_running == 1
    service.shutdown()


def test_a_file_of_many_errors_keeps_the_first_and_counts_the_rest(fake_redis, tmp_path):
    service = _service(fake_redis, tmp_path, stale_seconds=3600)
    service.files.max_bytes = 1 << 20
    line = b'{"custom_id": "same", "prompt": "x"}\n'
    batch = _settled(service, _upload(service, line * (MAX_REPORTED_ERRORS + 500))["id"])
    errors = batch["errors"]["data"]
    assert batch["status"] == "failed" and len(errors) == MAX_REPORTED_ERRORS
    assert [e["line"] for e in errors[:-1]] == list(range(2, MAX_REPORTED_ERRORS + 1))
    assert errors[-1]["code"] == "too_many_errors"
    assert errors[-1]["message"] == f"500 more errors are not listed ({MAX_REPORTED_ERRORS + 499} lines in all have errors)"
    service.shutdown()


def test_a_file_past_the_line_limit_fails_at_that_line(fake_redis, tmp_path):
    service = _service(fake_redis, tmp_path, stale_seconds=3600)
    service.max_lines_per_file = 5
    lines = [f'{{"custom_id": "r{i}", "prompt": "x"}}\n'.encode() for i in range(6)]
    assert _settled(service, _upload(service, b"".join(lines[:5]))["id"])["status"] == "in_progress"
    batch = _settled(service, _upload(service, b"".join(lines))["id"])
    assert batch["status"] == "failed", batch
    [error] = batch["errors"]["data"]
    assert error["code"] == "too_many_lines" and error["line"] == 6 and "--max-lines-per-file" in error["message"]
    service.shutdown()
