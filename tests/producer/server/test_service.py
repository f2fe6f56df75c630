"""BatchService without HTTP: a validation that never finished does not leave its batch `validating` forever."""

from __future__ import annotations

import io

from producer.client import Client
from producer.server.auth import Principal
from producer.server.files import FileStore
from producer.server.service import BatchService

ALPHA = Principal("alpha")


def _service(fake_redis, tmp_path, stale_seconds: int) -> BatchService:
    files = FileStore(tmp_path, ttl_seconds=600, max_bytes=1000)
    return BatchService(
        Client(connection=fake_redis, queue="q"),
        files,
        ttl_seconds=600,
        chunk_size=10,
        max_threads=1,
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
