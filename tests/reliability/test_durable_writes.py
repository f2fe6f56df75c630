"""Durable result writes (issue 44): `cbq worker --redis-wait-replicas N` sends Redis's WAIT after each result
write, so the worker counts results as written (and finishes their chunks) only once N replicas have them.

A primary and a replica of the test's own; the replica reads the primary's replication stream through a proxy
that holds it back 0.3 s, so a write the primary acknowledged is certainly not on the replica for that long.
The worker's `on_results_written` hook runs once a write counts as written: there, every result it carries
must already be on the replica. Without the option the same check finds them missing (the control test), so
the check can fail.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal

import pytest
import redis

from producer.store import SubmitOptions, submit_batch, validate_lines
from schemas import keys
from schemas.result import ResultLine
from tests.reliability.conftest import assert_exactly_once, wait_until
from tests.reliability.harness import DelayingProxy, RedisServer, WorkerProcess
from tests.worker.conftest import run_burst_worker
from worker.fake_engine import FakeEngine
from worker.metrics import WorkerCollector
from worker.replica_wait import ReplicaWait

REPLICATION_DELAY_SECONDS = 0.3


class PrimaryAndReplica:
    def __init__(self, tmp_path):
        (tmp_path / "primary").mkdir()
        (tmp_path / "replica").mkdir()
        self.primary = RedisServer(tmp_path / "primary", durable=False)
        self.primary.start()
        self.link = DelayingProxy(self.primary.port, REPLICATION_DELAY_SECONDS)
        self.replica = RedisServer(
            tmp_path / "replica", durable=False, extra_args=("--replicaof", "127.0.0.1", str(self.link.port))
        )
        self.replica.start()
        wait_until(self._in_sync, timeout=30, interval=0.2)

    def _in_sync(self) -> bool:
        info = self.primary.connect().info("replication")
        return info.get("connected_slaves") == 1 and info["slave0"]["state"] == "online"

    def close(self) -> None:
        self.replica.kill()
        self.link.close()
        self.primary.kill()


@pytest.fixture
def nodes(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    n = PrimaryAndReplica(tmp_path)
    yield n
    n.close()


def submit(conn: redis.Redis, n: int) -> str:
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": f"prompt {i}"}) for i in range(n)]
    batch_id = submit_batch(conn, validate_lines(lines).requests, SubmitOptions(queue="cbq", chunk_size=10)).batch_id
    assert batch_id is not None
    return batch_id


def wait_calls(conn: redis.Redis) -> int:
    return int(conn.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def run_checking_the_replica(nodes: PrimaryAndReplica, replica_wait: ReplicaWait | None) -> tuple[str, list[int]]:
    """Run a batch of 40 through an in-process worker; returns the batch id and, per write, how many of its
    results were not on the replica when the write counted as written."""
    primary, replica = nodes.primary.connect(), nodes.replica.connect()
    batch_id = submit(primary, 40)
    missing_per_write: list[int] = []

    def on_written(lines: list[ResultLine]) -> None:
        on_replica = replica.hmget(keys.batch_results(batch_id), [line.index for line in lines])
        missing_per_write.append(sum(1 for value in on_replica if value is None))

    engine = FakeEngine(max_num_running=10, latency_seconds=0.05)
    run_burst_worker(primary, engine, on_results_written=on_written, replica_wait=replica_wait)
    assert_exactly_once(primary, batch_id, 40)
    return batch_id, missing_per_write


def test_with_wait_replicas_the_results_are_on_the_replica_when_the_write_returns(nodes):
    before = wait_calls(nodes.primary.connect())
    batch_id, missing_per_write = run_checking_the_replica(nodes, ReplicaWait(1, timeout_seconds=10))
    assert missing_per_write and all(missing == 0 for missing in missing_per_write), missing_per_write
    assert wait_calls(nodes.primary.connect()) - before >= len(missing_per_write)
    wait_until(lambda: nodes.replica.connect().hlen(keys.batch_results(batch_id)) == 40)
    assert_exactly_once(nodes.replica.connect(), batch_id, 40)


def test_without_it_a_write_returns_before_the_replica_has_it(nodes):
    """The control: the check above can fail (Redis's replication is asynchronous)."""
    before = wait_calls(nodes.primary.connect())
    _, missing_per_write = run_checking_the_replica(nodes, None)
    assert sum(missing_per_write) > 0, missing_per_write
    assert wait_calls(nodes.primary.connect()) == before


def test_a_replica_that_does_not_answer_is_logged_and_the_batch_still_finishes(
    nodes, caplog
):
    assert nodes.replica.proc is not None
    nodes.replica.proc.send_signal(signal.SIGSTOP)  # connected, and acknowledging nothing
    try:
        replica_wait = ReplicaWait(1, timeout_seconds=0.05)
        primary = nodes.primary.connect()
        batch_id = submit(primary, 20)
        with caplog.at_level(logging.WARNING, logger="worker.replica_wait"):
            worker = run_burst_worker(primary, FakeEngine(), replica_wait=replica_wait)
        assert_exactly_once(primary, batch_id, 20)
        assert replica_wait.shortfalls > 0
        metrics = {m.name: m for m in WorkerCollector(worker).collect()}
        assert metrics["cbq_worker_replica_wait_shortfalls"].samples[0].value == replica_wait.shortfalls
        assert "reached fewer than 1 Redis replicas within 0.05 s" in caplog.text
    finally:
        nodes.replica.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("how", ["flags", "env"])
def test_the_worker_options_issue_wait(nodes, tmp_path, how):
    primary = nodes.primary.connect()
    batch_id = submit(primary, 30)
    before = wait_calls(primary)
    flags = ("--redis-wait-replicas", "1", "--redis-wait-timeout", "10") if how == "flags" else ()
    env = {"CBQ_REDIS_WAIT_REPLICAS": "1", "CBQ_REDIS_WAIT_TIMEOUT": "10"} if how == "env" else None
    worker = WorkerProcess(nodes.primary.url, tmp_path / "worker.log", "--fake-engine", "--burst", *flags, env=env)
    try:
        assert worker.wait(120) == 0, worker.output()
    finally:
        worker.kill()
    assert_exactly_once(primary, batch_id, 30)
    assert wait_calls(primary) > before
    assert_exactly_once(nodes.replica.connect(), batch_id, 30)  # WAIT returned only once the replica had them


def test_a_write_no_longer_on_the_server_is_not_confirmed(redis_server):
    """A failover between the write and its WAIT: the server that answers has the marker of an older write only,
    so the write is not counted as written (the writer sends it again); a shortfall alone is still confirmed."""
    conn = redis_server.connect()  # no replica at all
    marker = keys.flush_marker("test-writer")
    conn.set(marker, 3)
    replica_wait = ReplicaWait(1, timeout_seconds=0.01)
    assert not replica_wait.confirm(conn, marker, seq=4, marker_ttl_seconds=60)
    assert replica_wait.confirm(conn, marker, seq=3, marker_ttl_seconds=60) and replica_wait.shortfalls == 1
    assert conn.get(marker) == b"3" and 0 < conn.ttl(marker) <= 60


class UnconfirmedOnce(ReplicaWait):
    """Says the first write is not on the server (as after a failover between the write and its WAIT)."""

    calls = 0

    def confirm(self, conn, marker_key, seq, marker_ttl_seconds):
        self.calls += 1
        return self.calls > 1


def test_an_unconfirmed_write_stays_in_doubt_and_is_counted_once(redis_server, caplog):
    conn = redis_server.connect()
    batch_id = submit(conn, 20)
    replica_wait = UnconfirmedOnce(1, timeout_seconds=0.01)
    with caplog.at_level(logging.WARNING):
        run_burst_worker(conn, FakeEngine(), replica_wait=replica_wait)
    # The next attempt read the marker: the write had gone through, so it counted it instead of sending it again.
    assert replica_wait.calls >= 2
    assert "write 1 went through though its reply was lost; not repeating it" in caplog.text
    assert_exactly_once(conn, batch_id, 20)
    assert conn.hlen(keys.batch_running(batch_id)) == 0
