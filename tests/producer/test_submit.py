import json
import zlib

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer import store
from producer.store import SubmitConflict, SubmitOptions, submit_batch, validate_lines
from schemas import keys
from schemas.chunk import CHUNK_FUNC
from schemas.lines import Request
from schemas.sampling import Sampling


def lines_of(*objs) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_validate_lines_reports_every_bad_line_and_skips_blank_ones():
    v = validate_lines(
        lines_of(
            {"prompt": "a"},
            "",
            {"prompt": 1},
            "{oops",
            {"messages": [{"role": "user", "content": "x"}]},
            "  ",
        )
    )
    assert [p.line_no for p in v.requests] == [1, 3, 5]  # line 3's request is kept, to fail alone
    assert [e.line_no for e in v.errors] == [4]
    assert [str(e) for e in v.invalid] == ["line 3: prompt: Input should be a valid string"]
    assert [e.line_no for e in v.refusal(strict=True)] == [3, 4]
    assert v.num_blank_lines == 2


def test_duplicate_custom_ids_name_both_lines():
    v = validate_lines(
        lines_of({"prompt": "a", "custom_id": "x"}, {"prompt": "b"}, {"prompt": "c", "custom_id": "x"})
    )
    assert [str(e) for e in v.errors] == ["line 3: custom_id: duplicate custom_id 'x' (first on line 1)"]
    assert len(v.requests) == 2


def submit(conn, objs, **options):
    parsed = validate_lines(lines_of(*objs)).requests
    return submit_batch(conn, parsed, SubmitOptions(**{"queue": "q", **options}))


def test_submit_stores_requests_once_and_enqueues_json_chunk_jobs(conn):
    report = submit(conn, [{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(10)], chunk_size=4)
    assert (report.num_requests, report.num_chunks) == (10, 3)
    queue = Queue("q", connection=conn, serializer=JSONSerializer)
    assert queue.count == 3
    assert conn.hlen(keys.batch_requests(report.batch_id)) == 10
    stored = Request.model_validate_json(conn.hget(keys.batch_requests(report.batch_id), 9))
    assert (stored.index, stored.custom_id, stored.prompt) == (9, "c9", "p9")

    job = Job.fetch(queue.job_ids[2], connection=conn, serializer=JSONSerializer)
    assert job.func_name == CHUNK_FUNC
    assert job.kwargs == {"batch_id": report.batch_id, "start": 8, "stop": 10}
    assert job.retries_left == 2 and job.timeout == -1
    # The payload on the wire is JSON (rq compresses job data with zlib): nothing a worker would unpickle.
    raw = conn.hget(job.key, "data")
    assert json.loads(zlib.decompress(raw))[0] == CHUNK_FUNC

    status = store.get_status(conn, report.batch_id)
    assert (status.num_total, status.num_queued, status.state) == (10, 10, "queued")


def test_batch_defaults_apply_where_a_line_is_silent(conn):
    report = submit(
        conn,
        [{"prompt": "a", "temperature": 0.5}, {"prompt": "b"}],
        defaults=Sampling(temperature=1.0, max_new_tokens=3, stop=["x"]),
    )
    stored = [
        Request.model_validate_json(r) for r in conn.hmget(keys.batch_requests(report.batch_id), [0, 1])
    ]
    assert stored[0].sampling == Sampling(temperature=0.5, max_new_tokens=3, stop=["x"])
    assert stored[1].sampling == Sampling(temperature=1.0, max_new_tokens=3, stop=["x"])


def test_every_batch_key_gets_the_ttl(conn):
    report = submit(conn, [{"prompt": "a"}], ttl_seconds=1234, name="n")
    assert 1200 < conn.ttl(keys.batch(report.batch_id)) <= 1234
    assert 1200 < conn.ttl(keys.batch_requests(report.batch_id)) <= 1234
    assert 1200 < conn.ttl(keys.batch_jobs(report.batch_id)) <= 1234
    assert conn.ttl(keys.name_index("n")) == -2  # no custom_ids: no name index


def test_resubmitting_under_a_name_skips_custom_ids_already_submitted(conn):
    first = submit(
        conn, [{"prompt": "a", "custom_id": "x"}, {"prompt": "b", "custom_id": "y"}], name="nightly"
    )
    second = submit(
        conn,
        [{"prompt": "a", "custom_id": "x"}, {"prompt": "c", "custom_id": "z"}, {"prompt": "no id"}],
        name="nightly",
    )
    assert second.skipped_custom_ids == ["x"] and second.num_requests == 2
    third = submit(
        conn, [{"prompt": "a", "custom_id": "x"}, {"prompt": "c", "custom_id": "z"}], name="nightly"
    )
    assert third.batch_id is None and third.skipped_custom_ids == ["x", "z"]
    other_name = submit(conn, [{"prompt": "a", "custom_id": "x"}], name="other")
    assert other_name.num_requests == 1
    assert conn.hget(keys.name_index("nightly"), "y").decode() == first.batch_id


def test_a_failed_commit_leaves_nothing_visible(conn, monkeypatch):
    def broken_enqueue_many(self, *args, **kwargs):
        raise ConnectionError("network went away mid-commit")

    monkeypatch.setattr(Queue, "enqueue_many", broken_enqueue_many)
    with pytest.raises(ConnectionError):
        submit(conn, [{"prompt": "a", "custom_id": "x"}], name="n")
    assert Queue("q", connection=conn, serializer=JSONSerializer).count == 0
    assert conn.zcard(keys.BATCHES) == 0
    assert conn.exists(keys.name_index("n")) == 0
    assert not conn.keys("cbq:*"), "the staged requests were left behind"


def test_a_concurrent_submit_under_the_same_name_is_refused(conn, monkeypatch):
    import producer.store.submit as submit_module

    original = submit_module._stage_requests

    def stage_then_race(conn_, batch_id, requests, ttl_seconds, on_progress):
        staged = original(conn_, batch_id, requests, ttl_seconds, on_progress)
        conn.hset(keys.name_index("n"), "x", "someone-else")  # another submit committed in between
        return staged

    monkeypatch.setattr(submit_module, "_stage_requests", stage_then_race)
    with pytest.raises(SubmitConflict, match="just submitted under --name 'n'"):
        submit(conn, [{"prompt": "a", "custom_id": "x"}], name="n")
    assert Queue("q", connection=conn, serializer=JSONSerializer).count == 0


@pytest.mark.parametrize(
    "bad", [{"chunk_size": 0}, {"ttl_seconds": 0}, {"retries": -1}, {"job_timeout_seconds": 0}]
)
def test_submit_options_reject_bad_values_with_value_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SubmitOptions(queue="q", **bad)


def test_iter_results_rejects_an_unknown_format_with_a_value_error(conn):
    report = submit_batch(conn, validate_lines(lines_of({"prompt": "a"})).requests, SubmitOptions(queue="q"))
    with pytest.raises(ValueError, match="unknown output format"):
        next(store.iter_results(conn, report.batch_id, output_format="csv", partial=True))


def delete_queued_jobs(conn) -> None:
    """What `rq empty` does (Queue.empty runs a Lua script, which fakeredis lacks)."""
    queue = Queue("q", connection=conn, serializer=JSONSerializer)
    for job_id in queue.job_ids:
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()


def test_a_chunk_job_deleted_from_redis_is_reported_as_deleted_not_expired(conn):
    """`rq empty` (and removing a job from rq's failed registry) deletes the job hash; the batch still lives."""
    report = submit(conn, [{"prompt": f"p{i}"} for i in range(3)], chunk_size=2)
    delete_queued_jobs(conn)
    status = store.get_status(conn, report.batch_id)
    assert (status.num_failed, status.num_queued) == (3, 0)
    errors = {line.error for line in store.iter_results(conn, report.batch_id)}
    assert len(errors) == 2 and all("was deleted from Redis before a worker finished it" in e for e in errors)
    assert not any("expired" in e for e in errors)


def test_a_chunk_job_older_than_its_ttl_is_reported_as_expired(conn):
    report = submit(conn, [{"prompt": "p"}], ttl_seconds=60)
    delete_queued_jobs(conn)
    conn.hset(keys.batch(report.batch_id), keys.BatchField.CREATED_AT.value, 0.0)  # created long ago
    [line] = store.iter_results(conn, report.batch_id)
    assert line.error.endswith("expired (its TTL ran out) before a worker ran it")


def openai_chat_line(i: int) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {i} " + "word " * 60}]}
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_a_file_is_validated_without_holding_its_requests(tmp_path):
    """A file source keeps only custom_ids: validating ~4 MB of OpenAI batch lines allocates a fraction of the
    file at its peak (kept, the parsed requests took 27 MB here, ~6x the file)."""
    import tracemalloc

    from producer.client import Client

    path = tmp_path / "batch.jsonl"
    path.write_text("".join(openai_chat_line(i) + "\n" for i in range(10_000)))
    size = path.stat().st_size
    client = Client("redis://127.0.0.1:1", queue="q")  # validation talks to no server (connections are lazy)
    tracemalloc.start()
    try:
        validated = client.validate(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(validated.requests) == 10_000 and not validated.errors
    assert peak < size / 2, f"validation peaked at {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"
    assert [p.custom_id for p in validated.requests][:2] == ["req-0", "req-1"]  # read again on demand


def test_a_file_changed_after_validation_enqueues_nothing(conn, tmp_path):
    from producer.client import Client
    from producer.store import SourceChanged

    path = tmp_path / "batch.jsonl"
    path.write_text("".join(openai_chat_line(i) + "\n" for i in range(50)))
    client = Client(connection=conn, queue="q")
    validated = client.validate(path)
    for edit in ("truncated", "one prompt changed"):
        lines = [openai_chat_line(i) for i in range(40 if edit == "truncated" else 50)]
        lines[-1] = lines[-1].replace("question", "Question")
        path.write_text("".join(line + "\n" for line in lines))
        with pytest.raises(SourceChanged, match="changed after it was validated"):
            client.submit(validated, chunk_size=8)
        assert Queue("q", connection=conn, serializer=JSONSerializer).count == 0, edit
        assert not list(conn.scan_iter("cbq:batch:*")), edit  # the staged requests were removed too


def test_submit_options_bound_the_batchs_chat_template_kwargs_as_a_line_does():
    from producer.store.submit import SubmitOptions

    assert SubmitOptions(queue="q", chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    with pytest.raises(ValueError, match="chat_template_kwargs: .*tokenize cannot be set here"):
        SubmitOptions(queue="q", chat_template_kwargs={"tokenize": True})
