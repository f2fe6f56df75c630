"""The only code that writes request outcomes (the results hash, the batch counters, the running table) and
worker stats (`cbq:worker:{name}:stats`, `cbq:workers`).

Callers queue these writes on a MULTI pipeline of their own, together with whatever else belongs to the same
state change, so a result and its counters land together or not at all. Each chunk job has one owner at a time
(the worker that dequeued it, or `cbq cancel` for a job it removed from the queue), and owners write each
request once, so counters stay exact without server-side scripts (which fakeredis cannot run).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

import redis
from redis.client import Pipeline

from schemas import keys
from schemas.keys import BatchField
from schemas.result import OUTCOME_OF_REASON, ResultLine
from schemas.status import WorkerStats

WORKER_STATS_TTL_SECONDS = 60  # a worker that stops publishing disappears from `cbq stats` after this


def queue_admission(pipe: Pipeline, batch_id: str, job_id: str, num_running: int, ttl_seconds: int) -> None:
    """A worker admitted `num_running` requests of chunk `job_id` into its engine."""
    pipe.hset(keys.batch_running(batch_id), job_id, num_running)
    pipe.hsetnx(keys.batch(batch_id), BatchField.FIRST_STARTED_AT.value, repr(time.time()))
    pipe.expire(keys.batch_running(batch_id), ttl_seconds)


def queue_results(
    pipe: Pipeline,
    batch_id: str,
    ttl_seconds: int,
    results: list[ResultLine],
    running_job_ids: Iterable[str] = (),
    finished_job_ids: Iterable[str] = (),
    model: str | None = None,
) -> None:
    """Store `results` (all of one batch) and bump the batch counters.

    `running_job_ids` has one entry per result that came out of an engine (its chunk's running count drops);
    `finished_job_ids` are chunks with nothing left running (their entry is removed).
    """
    running_job_ids, finished_job_ids = list(running_job_ids), list(finished_job_ids)
    if not results and not running_job_ids and not finished_job_ids:
        return
    meta_key = keys.batch(batch_id)
    if results:
        pipe.hset(
            keys.batch_results(batch_id),
            mapping={r.index: r.model_dump_json(exclude_none=True) for r in results},
        )
        for outcome, count in Counter(OUTCOME_OF_REASON[r.finish_reason] for r in results).items():
            pipe.hincrby(meta_key, BatchField.counter_of(outcome).value, count)
        pipe.hincrby(meta_key, BatchField.PROMPT_TOKENS.value, sum(r.usage.prompt_tokens for r in results))
        pipe.hincrby(
            meta_key, BatchField.COMPLETION_TOKENS.value, sum(r.usage.completion_tokens for r in results)
        )
        pipe.hincrbyfloat(meta_key, BatchField.GPU_SECONDS.value, sum(r.usage.gpu_seconds for r in results))
        fields = {BatchField.LAST_FINISHED_AT.value: repr(time.time())}
        if model:
            fields[BatchField.MODEL.value] = model
        pipe.hset(meta_key, mapping=fields)
    running_key = keys.batch_running(batch_id)
    for job_id, count in Counter(running_job_ids).items():
        pipe.hincrby(running_key, job_id, -count)
    if finished_job_ids:
        pipe.hdel(running_key, *finished_job_ids)
    # Results expire `ttl_seconds` after the batch's last activity, all keys together.
    for key in keys.all_batch_keys(batch_id):
        pipe.expire(key, ttl_seconds)


def publish_worker_stats(conn: redis.Redis, stats: WorkerStats) -> None:
    """Publish one worker's stats for `cbq stats`; they expire unless published again."""
    with conn.pipeline(transaction=True) as pipe:
        pipe.set(keys.worker_stats(stats.worker_name), stats.model_dump_json(), ex=WORKER_STATS_TTL_SECONDS)
        pipe.zadd(keys.WORKERS, {stats.worker_name: stats.updated_at})
        pipe.execute()
