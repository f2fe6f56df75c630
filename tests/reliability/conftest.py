"""Fault injection: a private redis-server (AOF on, so kill -9 and restart keep its data), real `cbq worker`
processes that get SIGKILLed, and helpers that check exactly-once completion.

Nothing here touches the shared Redis on 6379: each test starts its own server on a free port under tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from producer import store
from producer.cli import main
from schemas import keys
from schemas.keys import BatchField
from tests.reliability.harness import REPO_ROOT, RedisServer, WorkerProcess, wait_until

__all__ = [
    "FAST_RECOVERY_FLAGS",
    "SLOW_FAKE",
    "REPO_ROOT",
    "assert_exactly_once",
    "lose_result_write",
    "submit_prompts",
    "wait_until",
]
# Short enough that a dead worker's chunks come back within seconds, long enough for a loaded 2-core box.
FAST_RECOVERY_FLAGS = ("--heartbeat-interval", "1", "--stale-after", "4", "--maintenance-interval", "1")
# 40 requests at a time, 1 s each.
SLOW_FAKE = ("--fake-engine", "--fake-latency", "1", "--max-num-seqs", "40", *FAST_RECOVERY_FLAGS)


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def start_worker(redis_server, tmp_path):
    """start_worker(*flags) -> a running WorkerProcess on the test's server; all are SIGKILLed at teardown."""
    workers: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        w = WorkerProcess(redis_server.url, tmp_path / f"worker{len(workers)}.log", *args, env=env)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.kill()
        w.wait()


@pytest.fixture
def cbq(redis_server):
    """Run `cbq ARGS...` in this process against the test's server; returns click's Result."""
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(main, [*map(str, args), "--redis-url", redis_server.url], input=input)

    return invoke


def submit_prompts(cbq, tmp_path: Path, n: int, *args) -> str:
    path = tmp_path / f"in{n}.jsonl"
    path.write_text(
        "".join(json.dumps({"custom_id": f"r{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(n))
    )
    out = cbq("submit", path, "--json", *args)
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout.strip().splitlines()[-1])["batch_id"]


def assert_exactly_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    """Every request has exactly one result line, every one completed, and the counters agree with the lines."""
    lines = [line.model_dump() for line in store.iter_results(conn, batch_id)]
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(n)]
    bad = [line for line in lines if line["finish_reason"] not in ("stop", "length")]
    assert not bad, bad[:3]
    status = store.get_status(conn, batch_id)
    assert (status.num_completed, status.num_failed, status.num_cancelled, status.num_running) == (n, 0, 0, 0)
    assert status.completion_tokens == sum(line["usage"]["completion_tokens"] for line in lines)
    assert status.prompt_tokens == sum(line["usage"]["prompt_tokens"] for line in lines)
    assert status.inconsistencies == []


def lose_result_write(conn: redis.Redis, batch_id: str, index: int) -> None:
    """Undo one request's result write, its line and its counters, as a failover to a replica that had not
    received the transaction loses it (its chunk's completion, a later write, may have reached the new primary)."""
    raw = conn.hget(keys.batch_results(batch_id), index)
    assert isinstance(raw, bytes), f"request {index} has no result to lose"
    line = json.loads(raw)
    meta = keys.batch(batch_id)
    with conn.pipeline(transaction=True) as pipe:
        pipe.hdel(keys.batch_results(batch_id), index)
        pipe.hincrby(meta, BatchField.NUM_COMPLETED.value, -1)
        pipe.hincrby(meta, BatchField.PROMPT_TOKENS.value, -line["usage"]["prompt_tokens"])
        pipe.hincrby(meta, BatchField.COMPLETION_TOKENS.value, -line["usage"]["completion_tokens"])
        pipe.hincrbyfloat(meta, BatchField.GPU_SECONDS.value, -line["usage"].get("gpu_seconds", 0.0))
        pipe.execute()
