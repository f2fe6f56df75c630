"""A write that Redis applied but whose reply never arrived (Redis killed between the two, a connection reset)
is applied once: counters equal the sums over the result lines (issue 31: 2,016 completed of 2,000, then every
`cbq status` failed). And status reads never fail on counters that are wrong anyway: they say what is wrong.
"""

from __future__ import annotations

import json

import pytest

from schemas import keys
from schemas.keys import BatchField
from tests.reliability.conftest import assert_exactly_once, submit_prompts
from tests.reliability.harness import ReplyDroppingProxy
from tests.worker.conftest import run_burst_worker
from worker.fake_engine import FakeEngine


@pytest.fixture
def proxy(redis_server):
    p = ReplyDroppingProxy(redis_server.port)
    yield p
    p.close()


def test_results_writes_whose_replies_are_lost_are_applied_once(redis_server, proxy, cbq, tmp_path):
    batch_id = submit_prompts(cbq, tmp_path, 300, "--chunk-size", "20")
    # The results transactions (they bump the counters) and the admissions (they set the running table).
    proxy.drop_exec_replies(4, containing=BatchField.NUM_COMPLETED.value.encode())
    proxy.drop_exec_replies(2, containing=BatchField.FIRST_STARTED_AT.value.encode())
    worker_conn = redis_server.connect()
    worker_conn.connection_pool.connection_kwargs["port"] = proxy.port
    run_burst_worker(worker_conn, FakeEngine(max_num_running=40, latency_seconds=0.05))
    assert proxy.num_dropped == 6
    conn = redis_server.connect()
    assert_exactly_once(conn, batch_id, 300)
    assert conn.hlen(keys.batch_running(batch_id)) == 0


def test_status_and_results_survive_counters_that_are_wrong(redis_server, cbq, tmp_path):
    batch_id = submit_prompts(cbq, tmp_path, 10, "--chunk-size", "5")
    run_burst_worker(redis_server.connect(), FakeEngine())
    conn = redis_server.connect()
    # As a write applied twice leaves them, and worse.
    conn.hincrby(keys.batch(batch_id), BatchField.NUM_COMPLETED.value, 3)
    conn.hincrby(keys.batch(batch_id), BatchField.PROMPT_TOKENS.value, 100)
    conn.hset(keys.batch_running(batch_id), mapping={"cbq-x": -2, "cbq-y": "many"})
    conn.hset(keys.batch(batch_id), BatchField.GPU_SECONDS.value, "lots")

    out = cbq("status", batch_id, "--json")
    assert out.exit_code == 0, out.output
    status = json.loads(out.stdout)
    assert (status["num_completed"], status["num_running"], status["num_queued"]) == (10, 0, 0)
    issues = " | ".join(status["inconsistencies"])
    assert "13 finished requests of 10" in issues and "gpu_seconds" in issues and "cbq-y" in issues
    lines = [json.loads(line) for line in cbq("results", batch_id).stdout.splitlines()]
    assert status["prompt_tokens"] == sum(line["usage"]["prompt_tokens"] for line in lines)
    assert cbq("wait", batch_id).exit_code == 0
    human = cbq("status", batch_id)
    assert human.exit_code == 0 and "inconsistent: the counters record 13" in human.output

    conn.hset(keys.batch_results(batch_id), "3", "{not json")
    out = cbq("results", batch_id)
    assert out.exit_code == 0, out.output
    line = json.loads(out.stdout.splitlines()[3])
    assert line["finish_reason"] == "error" and "stored result is unreadable" in line["error"]

    conn.zadd(keys.WORKERS, {"forged": 1})
    conn.set(keys.worker_stats("forged"), "{not stats")
    assert cbq("stats").exit_code == 0
