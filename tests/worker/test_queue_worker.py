"""The queue end to end: `cbq submit` -> CbqWorker (FakeEngine) -> `cbq results`, on fakeredis and real Redis."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from rq import Queue
from rq.command import send_stop_execution_command
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer import store
from producer.store import validate_lines
from schemas import keys
from worker.admission import to_engine_request
from worker.fake_engine import FakeEngine


def mixed_requests(n: int) -> list[dict]:
    """n requests cycling through the accepted shapes, with per-line sampling fields here and there."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append({"prompt": f"prompt number {i}", "max_new_tokens": 1 + i % 7})
        elif kind == 1:
            out.append({"custom_id": f"chat-{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
        elif kind == 2:
            body = {"prompt": f"completion {i}", "max_tokens": 3, "stop": "o"}
            out.append({"custom_id": f"oa-{i}", "method": "POST", "url": "/v1/completions", "body": body})
        else:
            body = {"messages": [{"role": "user", "content": f"chat {i}"}], "max_completion_tokens": 4}
            out.append(
                {"custom_id": f"oac-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    return out


def expected_texts(objs, max_new_tokens_default=None) -> list[str]:
    """What FakeEngine.generate gives for the same requests, built the way the worker builds them."""
    engine = FakeEngine()
    parsed = validate_lines([json.dumps(o) for o in objs]).requests
    from schemas.request import SamplingOverrides

    defaults = SamplingOverrides(max_new_tokens=max_new_tokens_default)
    reqs = [
        to_engine_request(p.resolve(i, defaults), engine.tokenizer, "b", 0.0) for i, p in enumerate(parsed)
    ]
    return [r.text for r in engine.generate(reqs)]


def results_of(cbq, batch_id, *args) -> list[dict]:
    out = cbq("results", batch_id, *args)
    assert out.exit_code == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def submit(cbq, write_jsonl, objs, *args) -> str:
    result = cbq("submit", write_jsonl(objs), "--json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["batch_id"]


def test_200_mixed_requests_complete_in_input_order(cbq, conn, burst_worker, write_jsonl):
    objs = mixed_requests(200)
    batch_id = submit(cbq, write_jsonl, objs, "--chunk-size", "16", "--max-new-tokens", "6")
    worker = burst_worker(FakeEngine(max_num_running=40))
    assert worker.num_jobs_finished == 13

    lines = results_of(cbq, batch_id)
    assert [r["index"] for r in lines] == list(range(200))
    assert [r["text"] for r in lines] == expected_texts(objs, max_new_tokens_default=6)
    assert lines[1]["custom_id"] == "chat-1" and "custom_id" not in lines[0]
    assert all(r["usage"]["prompt_tokens"] > 0 and r["usage"]["completion_tokens"] > 0 for r in lines)
    assert all(r["usage"]["latency_seconds"] >= 0 and r["usage"]["gpu_seconds"] > 0 for r in lines)
    assert {r["finish_reason"] for r in lines} == {"length", "stop"}

    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["num_completed"], status["state"], status["eta_seconds"]) == (200, "done", 0.0)
    assert status["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in lines)
    assert status["requests_per_second"] > 0
    assert cbq("wait", batch_id).exit_code == 0
    assert conn.hlen(keys.batch_running(batch_id)) == 0


def test_openai_batch_input_gives_openai_batch_output(cbq, burst_worker, write_jsonl):
    objs = [o for o in mixed_requests(12) if "method" in o]
    objs[0]["body"]["model"] = "my-model"  # the batch's model: it goes to that model's queue
    objs[2]["body"]["model"] = "other-model"  # a batch names one model: this line fails alone
    batch_id = submit(cbq, write_jsonl, objs)
    assert burst_worker().num_requests_finished == 0  # a worker serving no such model leaves it queued
    burst_worker(queue=keys.model_queue("cbq", "my-model"), model_name="my-model")
    lines = results_of(cbq, batch_id, "--format", "openai")
    assert [r["custom_id"] for r in lines] == [o["custom_id"] for o in objs]
    first, second = lines[0], lines[1]
    assert first["response"]["body"]["object"] == "text_completion"
    assert second["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["model"] == second["response"]["body"]["model"] == "my-model"  # served
    expected = expected_texts(objs[:2])
    assert first["response"]["body"]["choices"][0]["text"] == expected[0]
    assert second["response"]["body"]["choices"][0]["message"]["content"] == expected[1]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["body"]["usage"]["total_tokens"] > 0
    not_found = lines[2]["response"]
    assert not_found["status_code"] == 400 and not_found["body"]["error"]["code"] == "model_not_found"
    assert not_found["body"]["error"]["param"] == "model"


def test_token_ids_are_returned_on_request(cbq, burst_worker, write_jsonl):
    batch_id = submit(cbq, write_jsonl, [{"prompt": "abc", "max_new_tokens": 2}], "--token-ids")
    burst_worker()
    assert results_of(cbq, batch_id)[0]["token_ids"] == [ord("a"), ord("b")]


def test_cancelled_before_any_worker_never_runs(cbq, burst_worker, write_jsonl):
    batch_id = submit(cbq, write_jsonl, mixed_requests(10), "--chunk-size", "3")
    assert cbq("cancel", batch_id).exit_code == 0
    engine = FakeEngine()
    burst_worker(engine)
    assert engine.num_added == 0
    assert {r["finish_reason"] for r in results_of(cbq, batch_id)} == {"cancelled"}


def test_cancel_aborts_running_requests(cbq, conn, write_jsonl):
    from worker.queue_worker import CbqWorker

    batch_id = submit(cbq, write_jsonl, mixed_requests(20), "--chunk-size", "8")
    engine = FakeEngine(latency_seconds=60)  # everything stays in flight until aborted
    worker = CbqWorker(["cbq"], engine, connection=conn, model_name="fake")
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"})
    thread.start()
    _wait_until(lambda: store.get_status(conn, batch_id).num_running == 20)
    report = json.loads(cbq("cancel", batch_id, "--json").stdout)
    assert report["num_chunks_dequeued"] == 0  # the worker owns all three chunks
    assert (report["num_requests_cancelled"], report["num_requests_aborting"]) == (20, 20)  # requests, not chunks
    thread.join(timeout=10)
    assert not thread.is_alive()
    lines = results_of(cbq, batch_id)
    assert [r["finish_reason"] for r in lines] == ["cancelled"] * 20
    status = store.get_status(conn, batch_id)
    assert (status.num_cancelled, status.state) == (20, "cancelled")
    job = Job.fetch(keys.chunk_job_id(batch_id, 0), connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED and job.return_value()["num_cancelled"] == 8


def test_cancel_of_a_finished_batch_changes_nothing_and_says_so(cbq, conn, burst_worker, write_jsonl):
    batch_id = submit(cbq, write_jsonl, mixed_requests(4), "--chunk-size", "2")
    burst_worker()
    before = store.get_status(conn, batch_id)
    assert before.state == "done"
    text = cbq("cancel", batch_id)
    assert text.exit_code == 0 and "had already finished: nothing to cancel" in text.stdout
    report = json.loads(cbq("cancel", batch_id, "--json").stdout)
    assert report["already_finished"] and report["num_requests_cancelled"] == 0
    after = store.get_status(conn, batch_id)
    assert (after.state, after.cancelled_at, after.num_completed) == ("done", None, before.num_completed)


def test_rq_stop_execution_command_stops_one_chunk(cbq, conn, write_jsonl):
    from worker.queue_worker import CbqWorker

    batch_id = submit(cbq, write_jsonl, mixed_requests(4), "--chunk-size", "2")
    engine = FakeEngine(latency_seconds=60)
    worker = CbqWorker(["cbq"], engine, connection=conn, model_name="fake")
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"})
    thread.start()
    _wait_until(lambda: store.get_status(conn, batch_id).num_running == 4)
    for chunk in (0, 1):
        job = Job.fetch(keys.chunk_job_id(batch_id, chunk), connection=conn, serializer=JSONSerializer)
        [execution] = job.get_executions()
        send_stop_execution_command(conn, job.id, execution.id)
    thread.join(timeout=10)
    assert not thread.is_alive()
    job = Job.fetch(keys.chunk_job_id(batch_id, 0), connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STOPPED
    assert [r["finish_reason"] for r in results_of(cbq, batch_id)] == ["cancelled"] * 4


def test_dedupe_within_a_file_and_across_resubmissions(cbq, burst_worker, write_jsonl):
    dup = cbq("submit", write_jsonl([{"prompt": "a", "custom_id": "x"}, {"prompt": "b", "custom_id": "x"}]))
    assert dup.exit_code == 1 and "line 2: custom_id: duplicate custom_id 'x' (first on line 1)" in dup.stderr

    first = submit(
        cbq,
        write_jsonl,
        [{"prompt": "a", "custom_id": "x"}, {"prompt": "b", "custom_id": "y"}],
        "--name",
        "n",
    )
    second = submit(
        cbq,
        write_jsonl,
        [{"prompt": "a", "custom_id": "x"}, {"prompt": "c", "custom_id": "z"}],
        "--name",
        "n",
    )
    engine = FakeEngine()
    burst_worker(engine)
    assert engine.num_added == 3  # x ran once
    assert [r["custom_id"] for r in results_of(cbq, first)] == ["x", "y"]
    assert [r["custom_id"] for r in results_of(cbq, second)] == ["z"]


def test_every_chunk_in_flight_gets_heartbeats(cbq, conn, write_jsonl):
    from worker.queue_worker import CbqWorker

    batch_id = submit(cbq, write_jsonl, mixed_requests(4), "--chunk-size", "2")
    worker = CbqWorker(
        ["cbq"], FakeEngine(latency_seconds=60), connection=conn, model_name="fake", job_monitoring_interval=1
    )
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"})
    thread.start()
    _wait_until(lambda: store.get_status(conn, batch_id).num_running == 4)
    jobs = [
        Job.fetch(keys.chunk_job_id(batch_id, c), connection=conn, serializer=JSONSerializer) for c in (0, 1)
    ]
    first = [job.get_executions()[0].last_heartbeat for job in jobs]
    time.sleep(1.5)
    later = [job.get_executions()[0].last_heartbeat for job in jobs]
    assert all(b > a for a, b in zip(first, later, strict=True))
    store.cancel_batch(conn, batch_id)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_suspended_burst_worker_takes_nothing(cbq, conn, burst_worker, write_jsonl):
    from rq.suspension import resume, suspend

    batch_id = submit(cbq, write_jsonl, mixed_requests(3))
    suspend(conn)
    engine = FakeEngine()
    burst_worker(engine)
    assert engine.num_added == 0
    resume(conn)
    burst_worker(engine)
    assert store.get_status(conn, batch_id).num_completed == 3


def test_the_worker_refuses_to_fork_a_scheduler(conn):
    from worker.queue_worker import CbqWorker

    with pytest.raises(ValueError, match="would fork after CUDA started"):
        CbqWorker(["cbq"], FakeEngine(), connection=conn).work(with_scheduler=True)


class CrashingEngine(FakeEngine):
    """Hands back `crash_after` results, then dies like an engine whose thread crashed."""

    def __init__(self, crash_after: int, **kwargs):
        super().__init__(**kwargs)
        self.crash_after = crash_after
        self.num_returned = 0

    def get_results(self, timeout=0):
        if self.num_returned >= self.crash_after:
            raise RuntimeError("engine thread died")
        results = super().get_results(timeout)[: self.crash_after - self.num_returned]
        self.num_returned += len(results)
        return results


def test_a_retried_chunk_skips_finished_requests(cbq, conn, burst_worker, write_jsonl):
    objs = mixed_requests(10)
    batch_id = submit(cbq, write_jsonl, objs, "--chunk-size", "10", "--retries", "1")
    with pytest.raises(RuntimeError, match="engine thread died"):
        burst_worker(CrashingEngine(crash_after=4))
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_queued, status.num_running) == (4, 6, 0)
    job = Job.fetch(keys.chunk_job_id(batch_id, 0), connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED and job.retries_left == 0

    engine = FakeEngine()
    burst_worker(engine)
    assert engine.num_added == 6  # only what the crashed worker had not written
    lines = results_of(cbq, batch_id)
    assert [r["text"] for r in lines] == expected_texts(objs)
    assert store.get_status(conn, batch_id).num_completed == 10  # nothing counted twice
    assert job.return_value(refresh=True)["num_skipped"] == 4


def test_a_chunk_abandoned_by_a_dead_worker_is_retried_by_rq_maintenance(
    cbq, conn, burst_worker, write_jsonl
):
    from rq.registry import StartedJobRegistry

    from worker.queue_worker import CbqWorker

    class DiesHard(CbqWorker):
        def _fail_all_in_flight(self, exc_string):  # SIGKILL: nobody hands the chunk back
            pass

    batch_id = submit(cbq, write_jsonl, mixed_requests(6), "--chunk-size", "6", "--retries", "1")
    with pytest.raises(RuntimeError):
        DiesHard(["cbq"], CrashingEngine(crash_after=2), connection=conn).work(
            burst=True, logging_level="WARNING"
        )
    registry = StartedJobRegistry("cbq", connection=conn, serializer=JSONSerializer)
    [entry] = conn.zrange(registry.key, 0, -1)
    conn.zadd(registry.key, {entry: 1})  # its heartbeats stopped long ago

    engine = FakeEngine()
    burst_worker(engine)  # starts with rq's maintenance: the abandoned chunk is re-enqueued, then run
    assert engine.num_added == 4
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.state) == (6, "done")


def test_a_chunk_that_fails_for_good_reports_its_requests_as_failed(cbq, conn, burst_worker, write_jsonl):
    batch_id = submit(cbq, write_jsonl, mixed_requests(10), "--chunk-size", "5", "--retries", "0")
    with pytest.raises(RuntimeError):
        burst_worker(CrashingEngine(crash_after=7, max_num_running=5))  # chunk 0 done, chunk 1 half done
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_failed, status.state) == (7, 3, "done")
    lines = results_of(cbq, batch_id)
    failed = [r for r in lines if r["finish_reason"] == "error"]
    assert [r["index"] for r in failed] == [7, 8, 9]
    assert failed[0]["error"].startswith(f"chunk job {keys.chunk_job_id(batch_id, 1)} failed: ")
    assert failed[0]["error"].endswith("RuntimeError: engine thread died")
    assert cbq("wait", batch_id).exit_code == 2
    failed_registry = Queue("cbq", connection=conn, serializer=JSONSerializer).failed_job_registry
    assert failed_registry.get_job_ids() == [keys.chunk_job_id(batch_id, 1)]


def test_failing_requests_do_not_take_down_the_worker(cbq, conn, burst_worker, write_jsonl):
    objs = [
        {"prompt": "fine"},
        {"prompt": "x" * 100},
        {"prompt": "please boom"},
        {"prompt": ""},
        {"prompt": "ok"},
    ]
    batch_id = submit(cbq, write_jsonl, objs, "--chunk-size", "2")
    burst_worker(FakeEngine(max_model_len=50, raise_on_prompt_substring="boom"))
    lines = results_of(cbq, batch_id)
    assert [r["finish_reason"] for r in lines] == ["length", "error", "error", "error", "length"]
    assert lines[1]["error"].startswith("prompt has 100 tokens; the context is 50 tokens")
    assert "FakeEngine told to fail" in lines[2]["error"]
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_failed) == (2, 3)
    assert Queue("cbq", connection=conn, serializer=JSONSerializer).failed_job_registry.count == 0


def test_a_bad_job_fails_alone(cbq, conn, burst_worker, write_jsonl):
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    not_ours = queue.enqueue("os.getcwd")
    missing_batch = queue.enqueue("worker.chunk_job.run_chunk", batch_id="gone", start=0, stop=2)
    bad_payload = queue.enqueue("worker.chunk_job.run_chunk", batch_id="x", start=3, stop=1)
    batch_id = submit(cbq, write_jsonl, mixed_requests(6))
    burst_worker()
    assert store.get_status(conn, batch_id).num_completed == 6
    failed = queue.failed_job_registry
    assert sorted(failed.get_job_ids()) == sorted([not_ours.id, missing_batch.id, bad_payload.id])
    assert "not a cbq chunk job" in not_ours.latest_result().exc_string
    assert "batch gone not found" in missing_batch.latest_result().exc_string
    assert "empty chunk range" in bad_payload.latest_result().exc_string


def test_job_timeout_aborts_and_the_retry_finishes(cbq, conn, burst_worker, write_jsonl):
    objs = mixed_requests(4)
    batch_id = submit(cbq, write_jsonl, objs, "--job-timeout", "1", "--retries", "1")
    from worker.queue_worker import CbqWorker

    slow = CbqWorker(["cbq"], FakeEngine(latency_seconds=60), connection=conn, model_name="fake")
    slow.work(burst=True, logging_level="WARNING", max_jobs=1)
    status = store.get_status(conn, batch_id)
    assert (status.num_queued, status.num_finished) == (4, 0)  # aborted by the timeout, not recorded
    burst_worker()
    assert [r["text"] for r in results_of(cbq, batch_id)] == expected_texts(objs)


def test_sigterm_stops_admitting_and_drains(cbq, conn, burst_worker, write_jsonl):
    class SignalOnFirstRequest(FakeEngine):
        def add_request(self, req):
            if self.num_added == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            super().add_request(req)

    batch_id = submit(cbq, write_jsonl, mixed_requests(9), "--chunk-size", "3")
    worker = burst_worker(SignalOnFirstRequest(latency_seconds=0.2))
    assert worker.num_jobs_admitted == 1 and worker.num_jobs_finished == 1
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_queued) == (
        3,
        6,
    )  # the chunk in flight was finished, no more taken


def test_worker_publishes_stats(cbq, burst_worker, write_jsonl):
    submit(cbq, write_jsonl, mixed_requests(5))
    worker = burst_worker()
    record = json.loads(cbq("stats", "--json").stdout)
    [stats] = record["workers"]
    assert (stats["worker_name"], stats["state"], stats["num_requests_finished"]) == (
        worker.name,
        "stopped",
        5,
    )
    assert stats["output_tokens"] > 0 and stats["model"] == "fake"
    assert "stopped" in cbq("stats").stdout


@pytest.mark.redis_server
def test_rq_info_shows_the_queue_and_every_chunk_in_flight(real_redis):
    from producer.store import SubmitOptions, submit_batch
    from worker.queue_worker import CbqWorker

    parsed = validate_lines([json.dumps(o) for o in mixed_requests(10)]).requests
    batch_id = submit_batch(real_redis, parsed, SubmitOptions(queue="cbq-info", chunk_size=4)).batch_id
    kwargs = real_redis.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs['db']}"
    rq = os.path.join(os.path.dirname(sys.executable), "rq")

    def rq_info() -> str:
        return subprocess.run([rq, "info", "--url", url], check=True, capture_output=True, text=True).stdout

    [queue_line] = [line for line in rq_info().splitlines() if line.startswith("cbq-info")]
    assert queue_line.endswith(" 3, 0 executing, 0 finished, 0 failed")

    worker = CbqWorker(["cbq-info"], FakeEngine(latency_seconds=60), connection=real_redis, model_name="fake")
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"})
    thread.start()
    _wait_until(lambda: store.get_status(real_redis, batch_id).num_running == 10)
    out = rq_info()
    assert "0, 3 executing" in out  # rq sees all three chunk executions of the one worker
    [worker_line] = [line for line in out.splitlines() if line.startswith(worker.name)]
    assert "busy cbq-info" in worker_line and "1 workers, 1 queues" in out
    store.cancel_batch(real_redis, batch_id)
    thread.join(timeout=10)
    assert not thread.is_alive()


def _wait_until(predicate, timeout_seconds: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_cancel_racing_a_worker_dequeue_never_double_owns_a_chunk(cbq, conn, write_jsonl, monkeypatch):
    """A worker takes a chunk between cancel's look at the queue and its write: the WATCH makes cancel retry,
    so that chunk stays the worker's (not cancelled) and the rest are cancelled in one transaction."""
    batch_id = submit(cbq, write_jsonl, mixed_requests(9), "--chunk-size", "3")
    queue_key = Queue("cbq", connection=conn, serializer=JSONSerializer).key
    taken: list[bytes] = []
    real_fetch_many = Job.fetch_many

    def fetch_many_while_a_worker_dequeues(job_ids, **kwargs):
        if not taken:
            taken.append(conn.lpop(queue_key))  # the "worker" owns this chunk now
        return real_fetch_many(job_ids, **kwargs)

    monkeypatch.setattr(store.cancel.Job, "fetch_many", fetch_many_while_a_worker_dequeues)
    report = store.cancel_batch(conn, batch_id)
    assert taken and taken[0] is not None
    assert report.num_chunks_dequeued == 2
    assert (report.num_requests_cancelled, report.num_requests_aborting) == (9, 3)  # 3 are the worker's to abort
    assert conn.llen(queue_key) == 0
    cancelled = {
        r.index for r in store.iter_results(conn, batch_id, partial=True) if r.finish_reason == "cancelled"
    }
    assert len(cancelled) == 6


def test_cancel_interrupted_before_its_write_leaves_nothing_half_done(cbq, conn, write_jsonl, monkeypatch):
    """Taking chunks out of the queue and writing them as cancelled is one transaction: if cancel dies in
    between, the chunks are still queued, and running cancel again completes the job."""
    batch_id = submit(cbq, write_jsonl, mixed_requests(9), "--chunk-size", "3")
    queue_key = Queue("cbq", connection=conn, serializer=JSONSerializer).key

    def crash(*args, **kwargs):
        raise ConnectionError("cancel died here")

    with monkeypatch.context() as patch:
        patch.setattr(store.cancel, "queue_results", crash)
        with pytest.raises(ConnectionError):
            store.cancel_batch(conn, batch_id)
    assert conn.llen(queue_key) == 3, "chunks left the queue without being written as cancelled"
    report = store.cancel_batch(conn, batch_id)
    assert (report.num_chunks_dequeued, report.num_requests_cancelled) == (3, 9)
    assert {r["finish_reason"] for r in results_of(cbq, batch_id)} == {"cancelled"}


def test_a_failed_request_reports_one_error_line_and_no_completion_tokens():
    """A grammar engine's multi-line error dump becomes one line; the token the grammar rejected (the engine
    counts it) is not reported as a completion token of a request that returns no text."""
    from schemas.request import Request
    from worker.admission import MAX_ERROR_CHARS, to_result_line
    from worker.engine.api import EngineResult, FinishReason, Usage

    request = Request(index=3, line_no=4, shape="prompt", prompt="p", custom_id="c")
    dump = "constraint: token 17 rejected\n  at state 4\n    expected one of:\n" + "      'a'\n" * 200
    result = EngineResult("b:3", "", [17], FinishReason.ERROR, Usage(prompt_tokens=5, completion_tokens=1), dump)
    line = to_result_line(request, result, FakeEngine().tokenizer)
    assert "\n" not in line.error and line.error.startswith("constraint: token 17 rejected at state 4")
    assert len(line.error) <= MAX_ERROR_CHARS
    assert (line.usage.prompt_tokens, line.usage.completion_tokens) == (5, 0)
