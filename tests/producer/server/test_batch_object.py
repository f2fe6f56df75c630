import pytest

from producer.server.batch_object import batch_object, openai_status
from producer.store.api_batches import BatchRecordNotFound, BatchRecords
from schemas.status import BatchStatus


def status(done: int, total: int = 4) -> BatchStatus:
    return BatchStatus(
        batch_id="b",
        queue="cbq",
        created_at=0.0,
        num_total=total,
        num_queued=total - done,
        num_running=0,
        num_completed=done,
        num_failed=0,
        num_cancelled=0,
        prompt_tokens=10,
        completion_tokens=5,
    )


def test_records_round_trip_and_page_newest_first(fake_redis):
    records = BatchRecords(fake_redis, ttl_seconds=60)
    made = [records.create("p1", "file-1", "/v1/completions", 3600, "1h", {"k": "v"}, None) for _ in range(3)]
    fake_redis.zadd("cbq:api:batches", {r.id: i for i, r in enumerate(made)})  # distinct creation times
    got = records.get(made[0].id)
    assert got == made[0] and got.metadata == {"k": "v"} and got.expires_at == got.created_at + 3600
    records.update(made[0].id, only_if_unset=True, cancelling_at=5)
    records.update(made[0].id, only_if_unset=True, cancelling_at=7)
    assert records.get(made[0].id).cancelling_at == 5
    assert records.list_ids(None, None, 2) == ([made[2].id, made[1].id], True)
    assert records.list_ids(None, made[1].id, 2) == ([made[0].id], False)
    assert records.list_ids(None, "batch_unknown", 2) == ([], False)
    with pytest.raises(BatchRecordNotFound):
        records.get("batch_unknown")


def test_status_walks_openai_transitions(fake_redis):
    record = BatchRecords(fake_redis, ttl_seconds=60).create(
        "p1", "file-1", "/v1/completions", 60, "1m", None, None
    )
    assert openai_status(record, None) == "validating"
    assert openai_status(record, status(1)) == "in_progress"
    assert openai_status(record, status(4)) == "finalizing"
    record.cancelling_at = 1
    assert openai_status(record, status(4)) == "cancelling"
    record.cancelled_at = 2
    assert openai_status(record, status(4)) == "cancelled"
    record.cancelling_at = record.cancelled_at = None
    record.errors, record.failed_at = [{"code": "x", "message": "m", "param": None, "line": 1}], 3
    assert openai_status(record, None) == "failed"


def test_batch_object_parses_with_the_sdk_type(fake_redis):
    openai_types = pytest.importorskip("openai.types")
    record = BatchRecords(fake_redis, ttl_seconds=60).create(
        "p1", "file-1", "/v1/completions", 60, "1m", None, None
    )
    parsed = openai_types.Batch.model_validate(batch_object(record, status(4)))
    assert parsed.status == "finalizing" and parsed.request_counts.completed == 4
    assert parsed.usage.total_tokens == 15


def test_each_project_lists_its_own_records_and_the_admin_listing_all(fake_redis):
    records = BatchRecords(fake_redis, ttl_seconds=60)
    a1, b1, a2 = (records.create(p, "file-1", "/v1/completions", 60, "1m", None, None) for p in "aba")
    fake_redis.zadd("cbq:api:batches", {r.id: i for i, r in enumerate((a1, b1, a2))})
    fake_redis.zadd("cbq:api:project:a:batches", {a1.id: 0, a2.id: 2})
    assert records.get(b1.id).project == "b"
    assert records.list_ids("a", None, 10) == ([a2.id, a1.id], False)
    assert records.list_ids("b", None, 10) == ([b1.id], False)
    assert records.list_ids("a", b1.id, 10) == ([], False)  # another project's id is no cursor
    assert records.list_ids(None, None, 10) == ([a2.id, b1.id, a1.id], False)
    records.forget(a1.id, "a")
    assert records.list_ids("a", None, 10)[0] == [a2.id] and a1.id not in records.list_ids(None, None, 10)[0]
    assert records.take_finalize_lock(a2.id) and not records.take_finalize_lock(a2.id)
