"""No job data can kill or steer a worker (issue 31, item 2): queue entries whose id rq rejects, job hashes
without `data` or too large, and forged chunk jobs carrying webhooks, callbacks, dependencies or dependents are
quarantined with their reason (and an expiry), the worker and rq's registry cleanup carry on, and nothing in a
job makes the worker open a connection."""

from __future__ import annotations

import json
import socket
import threading
import zlib

from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from schemas import keys
from tests.reliability.conftest import SLOW_FAKE, assert_exactly_once, submit_prompts, wait_until
from tests.worker.conftest import run_burst_worker
from worker.fake_engine import FakeEngine


def _failure(conn, job_id: str) -> str:
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    return job.latest_result().exc_string


def test_a_bad_id_neither_kills_the_worker_nor_stops_recovery(redis_server, start_worker, cbq, tmp_path):
    conn = redis_server.connect()
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    batch_id = submit_prompts(cbq, tmp_path, 40, "--chunk-size", "10")
    victim = start_worker(*SLOW_FAKE)
    wait_until(lambda: conn.hlen(keys.batch_running(batch_id)) == 4, context=victim.output)
    victim.kill()
    victim.wait()
    # What issue 31 found: an id rq rejects, at the head of the queue and stuck in the intermediate list (one
    # with a hash, one without).
    conn.hset("rq:job:bad/id", mapping={"data": b"{not json", "status": "queued"})
    conn.lpush(queue.key, "bad/id")
    conn.lpush(queue.intermediate_queue_key, "also bad!")

    survivor = start_worker(*SLOW_FAKE)
    wait_until(lambda: conn.hget(keys.batch(batch_id), "num_completed") == b"40", 40, context=survivor.output)
    assert survivor.proc.poll() is None, survivor.output()
    assert_exactly_once(conn, batch_id, 40)
    assert b"bad/id" not in conn.lrange(queue.key, 0, -1)
    wait_until(lambda: not conn.lrange(queue.intermediate_queue_key, 0, -1), 10, context=survivor.output)
    failures = {job_id: _failure(conn, job_id) for job_id in queue.failed_job_registry.get_job_ids()}
    assert any("'bad/id'" in f for f in failures.values()), failures
    assert 0 < conn.ttl("rq:job:bad/id"), "the bad entry's hash is kept for a while, not forever"
    assert "cleaning the registries of queue cbq failed" not in survivor.output()


class Listener:
    """A TCP listener on 127.0.0.1 that counts connections (a webhook's target)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.num_connections = 0
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.num_connections += 1
            conn.close()

    def close(self):
        self.closed = True
        self.thread.join(2)
        self.sock.close()


def test_forged_jobs_are_quarantined_and_nothing_in_them_is_honoured(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    batch_id = submit_prompts(cbq, tmp_path, 60, "--chunk-size", "10", "--retries", "0")
    chunk = [keys.chunk_job_id(batch_id, c) for c in range(6)]
    listener = Listener()
    try:
        hooks = [{"url": listener.url, "job_status": s, "method": "POST"} for s in ("finished", "failed")]
        conn.hset(Job.key_for(chunk[0]), "webhooks", json.dumps(hooks))
        conn.hset(Job.key_for(chunk[1]), "failure_callback_name", "os.getcwd")
        conn.hset(Job.key_for(chunk[2]), "dependency_ids", json.dumps([chunk[5]]))
        conn.hdel(Job.key_for(chunk[3]), "data")
        conn.hset(Job.key_for(chunk[4]), "description", "x" * 100_000)
        # chunk 5 stays good, but someone made the others its "dependents" (rq would enqueue them again)
        conn.sadd(f"rq:job:{chunk[5]}:dependents", *chunk[:5])

        run_burst_worker(conn, FakeEngine())
        assert listener.num_connections == 0
    finally:
        listener.close()
    expected = {
        chunk[0]: "webhooks to http://127.0.0.1",
        chunk[1]: "failure callback 'os.getcwd'",
        chunk[2]: "dependencies on",
        chunk[3]: "no data field",
        chunk[4]: "larger than",
    }
    assert sorted(queue.failed_job_registry.get_job_ids()) == sorted(expected)
    for job_id, text in expected.items():
        assert text in _failure(conn, job_id), (job_id, _failure(conn, job_id))
        assert 0 < conn.ttl(Job.key_for(job_id)), f"{job_id} was left without an expiry"
    assert not conn.lrange(queue.key, 0, -1), "a forged dependents set enqueued jobs again"
    lines = {line["index"]: line for line in map(json.loads, cbq("results", batch_id).stdout.splitlines())}
    assert all(lines[i]["finish_reason"] in ("stop", "length") for i in range(50, 60))
    assert all(lines[i]["finish_reason"] == "error" for i in range(50))


def test_a_zlib_bomb_is_not_decompressed(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
    bomb = zlib.compress(b"[" + b" " * (50 * 1024 * 1024) + b"]", 9)  # 50 KB that would become 50 MB
    conn.hset(Job.key_for(keys.chunk_job_id(batch_id, 0)), "data", bomb)
    run_burst_worker(conn, FakeEngine())
    assert "decompresses to more than" in _failure(conn, keys.chunk_job_id(batch_id, 0))
    lines = [json.loads(line) for line in cbq("results", batch_id).stdout.splitlines()]
    assert [line["finish_reason"] == "error" for line in lines] == [True] * 10 + [False] * 10
