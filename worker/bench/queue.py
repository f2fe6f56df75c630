"""`cbq bench queue`: how many requests per second one worker process admits and finishes through Redis.

The engine is the instant FakeEngine, so this measures the queue alone: rq bookkeeping per chunk job,
loading and tokenizing requests, writing results and counters. For each chunk size: submit N requests
(timed), run one burst worker until they are all finished (timed), check every result is there.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from dataclasses import asdict, dataclass

import click

from producer import store
from producer.options import open_redis, redis_url_option
from producer.settings import in_process_redis
from producer.store import SubmitOptions, submit_batch, validate_lines
from schemas import keys
from schemas.request import SamplingOverrides
from worker.fake_engine import FakeEngine
from worker.queue_worker import CbqWorker


@dataclass
class QueueBenchRow:
    chunk_size: int
    num_requests: int
    num_chunks: int
    submit_seconds: float
    submit_requests_per_second: float
    worker_seconds: float  # first admission to last result written, as seen by the worker loop
    worker_requests_per_second: float
    worker_jobs_per_second: float


def run_one(
    conn, num_requests: int, chunk_size: int, max_new_tokens: int, max_num_running: int
) -> QueueBenchRow:
    queue = f"cbq-bench-{uuid.uuid4().hex[:8]}"
    lines = [
        json.dumps({"prompt": f"benchmark prompt number {i}", "custom_id": f"r{i}"})
        for i in range(num_requests)
    ]
    parsed = validate_lines(lines).requests
    defaults = SamplingOverrides.model_validate({"max_new_tokens": max_new_tokens})
    options = SubmitOptions(queue=queue, chunk_size=chunk_size, ttl_seconds=600, retries=0, defaults=defaults)

    t0 = time.perf_counter()
    report = submit_batch(conn, parsed, options)
    assert report.batch_id is not None, "a batch without a --name always gets an id"
    submit_seconds = time.perf_counter() - t0

    engine = FakeEngine(max_num_running=max_num_running)
    worker = _TimedWorker([queue], engine, connection=conn, model_name="fake", stats_interval_seconds=60)
    worker.work(burst=True, logging_level="WARNING")
    worker_seconds = worker.loop_seconds

    status = store.get_status(conn, report.batch_id)
    if status.num_completed != num_requests:
        raise click.ClickException(f"only {status.num_completed}/{num_requests} requests completed")
    _cleanup(conn, report.batch_id, queue)
    return QueueBenchRow(
        chunk_size=chunk_size,
        num_requests=num_requests,
        num_chunks=report.num_chunks,
        submit_seconds=round(submit_seconds, 3),
        submit_requests_per_second=round(num_requests / submit_seconds),
        worker_seconds=round(worker_seconds, 3),
        worker_requests_per_second=round(num_requests / worker_seconds),
        worker_jobs_per_second=round(report.num_chunks / worker_seconds, 1),
    )


class _TimedWorker(CbqWorker):
    """Times the work loop only: not bootstrap, and not teardown (rq joins its pubsub thread for up to 1 s)."""

    def bootstrap(self, *args, **kwargs):
        super().bootstrap(*args, **kwargs)
        self._loop_started_at = time.perf_counter()

    def teardown(self):
        self.loop_seconds = time.perf_counter() - self._loop_started_at
        super().teardown()


def _cleanup(conn, batch_id: str, queue: str) -> None:
    """Remove the bench's keys (rq's job keys would otherwise linger until their TTL)."""
    job_ids = [k.decode() for k in conn.hkeys(keys.batch_jobs(batch_id))]
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.delete(f"rq:job:{job_id}", f"rq:results:{job_id}", f"rq:executions:{job_id}")
        pipe.delete(*keys.all_batch_keys(batch_id))
        pipe.zrem(keys.BATCHES, batch_id)
        for suffix in ("", ":intermediate"):
            pipe.delete(f"rq:queue:{queue}{suffix}")
        for registry in ("finished", "failed", "wip", "canceled", "deferred", "scheduled"):
            pipe.delete(f"rq:{registry}:{queue}")
        pipe.srem("rq:queues", f"rq:queue:{queue}")
        pipe.execute()


@click.command("queue")
@redis_url_option
@click.option("--fake", is_flag=True, help="Use an in-process fakeredis instead of --redis-url.")
@click.option("--num-requests", type=click.IntRange(min=1), default=20000, show_default=True)
@click.option(
    "--chunk-size",
    "chunk_sizes",
    type=click.IntRange(min=1),
    multiple=True,
    default=(1, 16, 64, 256),
    show_default=True,
    help="Requests per rq job; repeat to compare several.",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-num-running", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Write every number as JSON.")
def queue_bench(redis_url, fake, num_requests, chunk_sizes, max_new_tokens, max_num_running, json_out):
    """Requests/s one worker process admits and finishes through Redis (FakeEngine: the queue alone)."""
    conn = in_process_redis() if fake else open_redis(redis_url)
    rows = [run_one(conn, num_requests, size, max_new_tokens, max_num_running) for size in chunk_sizes]

    cols = list(asdict(rows[0]))
    click.echo(" | ".join(f"{c:>14}" for c in cols))
    for row in rows:
        click.echo(" | ".join(f"{v:>14}" for v in asdict(row).values()))
    if json_out:
        record = {
            "redis": "fakeredis" if fake else _redis_server(conn),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
            "max_new_tokens": max_new_tokens,
            "rows": [asdict(r) for r in rows],
        }
        with open(json_out, "w") as f:
            json.dump(record, f, indent=2)
        click.echo(f"wrote {json_out}", err=True)


def _redis_server(conn) -> str:
    info = conn.info("server")
    return f"redis {info.get('redis_version')}"
