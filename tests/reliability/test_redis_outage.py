"""Redis killed with SIGKILL (AOF on) under a running worker (issue 10, item 2): the worker keeps generating,
buffers what finishes, reconnects, writes it once, and carries on. Past --redis-outage-limit it exits 1 and the
next worker finishes the batch. Either way every request has exactly one result."""

from __future__ import annotations

import signal
import time

from producer import store
from tests.reliability.conftest import (
    FAST_RECOVERY_FLAGS,
    SLOW_FAKE,
    assert_exactly_once,
    submit_prompts,
    wait_until,
)

N = 120


def test_worker_survives_a_redis_restart_and_writes_everything_once(
    redis_server, start_worker, cbq, tmp_path
):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, N, "--chunk-size", "10")
    worker = start_worker(*SLOW_FAKE, "--redis-outage-limit", "30")
    wait_until(lambda: store.get_status(conn, batch_id).num_completed >= 40)
    redis_server.kill()
    time.sleep(3)  # the requests in flight finish meanwhile: their results wait in the worker
    assert worker.proc.poll() is None, worker.output()
    redis_server.start()
    wait_until(lambda: store.get_status(conn, batch_id).is_done, timeout=30, context=worker.output)
    assert worker.proc.poll() is None, worker.output()
    assert "Redis is back" in worker.output()
    assert_exactly_once(conn, batch_id, N)
    worker.kill(signal.SIGTERM)
    assert worker.wait() == 0


def test_an_outage_past_the_limit_stops_the_worker_and_the_next_one_finishes(
    redis_server, start_worker, cbq, tmp_path
):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 60, "--chunk-size", "10")
    worker = start_worker(
        "--fake-engine", "--fake-latency", "30", *FAST_RECOVERY_FLAGS, "--redis-outage-limit", "2"
    )
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 60)
    redis_server.kill()
    assert worker.wait(20) == 1
    assert "Redis did not answer" in worker.output()
    redis_server.start()
    wait_until(lambda: store.get_status(conn, batch_id).num_stalled == 60, timeout=10)
    successor = start_worker("--fake-engine", "--burst", *FAST_RECOVERY_FLAGS)
    assert successor.wait(30) == 0, successor.output()
    assert_exactly_once(conn, batch_id, 60)


def test_a_job_dequeued_as_redis_dies_is_admitted_again_without_waiting_for_cleanup(
    redis_server, cbq, tmp_path, monkeypatch
):
    """Redis dies between the dequeue and the read of the chunk: the worker holds the only reference to the job,
    so it admits it again once Redis is back, instead of leaving it to a cleanup a minute later."""
    import threading

    import worker.chunk_admission as chunk_admission
    from tests.worker.conftest import run_burst_worker
    from worker.fake_engine import FakeEngine

    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
    real_load_chunk, calls = chunk_admission.load_chunk_job, []

    def redis_dies_mid_admission(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            redis_server.kill()
            threading.Timer(2.0, redis_server.start).start()
        return real_load_chunk(*args, **kwargs)

    monkeypatch.setattr(chunk_admission, "load_chunk_job", redis_dies_mid_admission)
    started = time.monotonic()
    run_burst_worker(conn, FakeEngine(latency_seconds=0.5))  # default recovery settings: stale after 40 s
    assert time.monotonic() - started < 15
    assert len(calls) >= 3, calls  # the interrupted chunk was read again, and the other chunk once
    assert_exactly_once(conn, batch_id, 20)


def test_a_redis_restarted_without_its_data_is_reported_as_wiped(tmp_path):
    """Issue 44, item 5: Redis restarted without persistence. `cbq status` said "never submitted, or its results
    expired" and the worker that the chunk "was re-enqueued"; both now say the store was wiped."""
    from click.testing import CliRunner

    from producer.cli import main
    from tests.reliability.harness import RedisServer, WorkerProcess

    server = RedisServer(tmp_path, durable=False)
    server.start()
    worker = None
    try:
        conn = server.connect()

        def cbq(*args):
            return CliRunner().invoke(main, [*map(str, args), "--redis-url", server.url])

        batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
        assert cbq("status", batch_id).exit_code == 0
        worker = WorkerProcess(
            server.url, tmp_path / "worker.log", "--fake-engine", "--fake-latency", "3", *FAST_RECOVERY_FLAGS
        )
        wait_until(lambda: store.get_status(conn, batch_id).num_running == 20, context=worker.output)
        server.kill()
        server.start()  # empty: no append-only file
        out = cbq("status", batch_id)
        assert out.exit_code == 1
        wiped = f"the Redis store was wiped (no cbq marker): batch {batch_id}'s records are gone"
        assert wiped in out.output, out.output
        wait_until(lambda: wiped in worker.output(), timeout=20, context=worker.output)
        assert "was re-enqueued" not in worker.output()
        # A fresh store with a new batch: a typo'd id is just not found.
        submit_prompts(cbq, tmp_path, 1)
        assert "never submitted" in cbq("status", "b-no-such-batch").output
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        server.kill()


def test_a_redis_pause_longer_than_stale_after_spends_no_retry(redis_server, start_worker, cbq, tmp_path):
    """Issue 44, item 6: Redis paused (SIGSTOP) for longer than --stale-after expired every execution at once, and
    the first cleanup after it took every chunk in flight for abandoned: one retry spent for each."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from schemas import keys

    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 80, "--chunk-size", "10", "--retries", "2")
    flags = ("--fake-engine", "--fake-latency", "8", "--max-num-seqs", "40", *FAST_RECOVERY_FLAGS)
    workers = [start_worker(*flags), start_worker(*flags)]
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 80, timeout=30)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    time.sleep(6)  # past --stale-after 4
    redis_server.proc.send_signal(signal.SIGCONT)
    logs = lambda: "\n".join(w.output() for w in workers)  # noqa: E731
    wait_until(lambda: store.get_status(conn, batch_id).is_done, timeout=40, context=logs)
    assert_exactly_once(conn, batch_id, 80)
    retries_left = [
        Job.fetch(keys.chunk_job_id(batch_id, c), connection=conn, serializer=JSONSerializer).retries_left
        for c in range(8)
    ]
    assert retries_left == [2] * 8, (retries_left, logs())
    assert "re-enqueued while it ran here" not in logs()
    assert "no heartbeat could be written" in logs()


def test_a_worker_started_while_redis_is_down_or_paused_waits_for_it(redis_server, start_worker, cbq, tmp_path):
    """A worker that starts before Redis answers (a compose stack starting, a restart, a paused server: CI once saw
    a worker started during a SIGSTOP exit at once with 'cannot reach Redis ... Timeout reading') waits for it within
    --redis-outage-limit, says so in one line, then serves; past the limit it exits 1 with one line."""
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # paused: connections open, reads time out
    try:
        paused = start_worker(*SLOW_FAKE, "--redis-outage-limit", "60")
        wait_until(lambda: "Redis unreachable, waiting up to 60 s" in paused.output(), timeout=30, context=paused.output)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    redis_server.kill()  # and then down: connections refused
    time.sleep(2)
    assert paused.proc.poll() is None, paused.output()
    redis_server.start()
    wait_until(lambda: store.get_status(conn, batch_id).is_done, timeout=60, context=paused.output)
    assert "Redis answers after" in paused.output() and "Traceback" not in paused.output()
    assert_exactly_once(conn, batch_id, 20)
    paused.kill(signal.SIGTERM)
    assert paused.wait() == 0
    redis_server.kill()
    gone = start_worker(*SLOW_FAKE, "--redis-outage-limit", "2")
    assert gone.wait(30) == 1
    lines = [line for line in gone.output().splitlines() if line.strip()]
    assert lines[-1].startswith(f"Error: cannot reach Redis at {redis_server.url}: Redis unreachable for"), lines
