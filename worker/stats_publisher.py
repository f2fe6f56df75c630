"""A worker's stats for `cbq stats`: engine counters and the worker's own, as one `WorkerStats`.

`producer.store.publish_worker_stats` writes them to Redis.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import redis

from producer.store import publish_worker_stats
from schemas.status import WorkerStats
from worker.engine.api import EngineStats


def build_worker_stats(
    *,
    worker_name: str,
    model: str,
    mode: str | None,
    queues: list[str],
    started_at: float,
    state: str,
    engine_stats: EngineStats,
    model_kind: str = "generate",
    num_in_flight_jobs: int,
    num_in_flight_requests: int,
    num_jobs_finished: int,
    num_requests_finished: int,
) -> WorkerStats:
    return WorkerStats(
        worker_name=worker_name,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        model=model,
        model_kind=model_kind,
        mode=mode,
        queues=queues,
        started_at=started_at,
        updated_at=time.time(),
        state=state,
        num_in_flight_jobs=num_in_flight_jobs,
        num_in_flight_requests=num_in_flight_requests,
        num_jobs_finished=num_jobs_finished,
        num_requests_finished=num_requests_finished,
        steps=engine_stats.steps,
        prompt_tokens=engine_stats.prompt_tokens,
        output_tokens=engine_stats.output_tokens,
        output_tokens_per_second=engine_stats.output_tok_s,
        prompt_tokens_per_second=engine_stats.prompt_tokens / wall if (wall := engine_stats.wall_seconds) > 0 else 0.0,
        busy_fraction=engine_stats.busy_fraction,
        cpu_prep_ms_per_step=engine_stats.cpu_prep_ms_per_step,
        num_preemptions=engine_stats.num_preemptions,
        prefix_cache_hit_rate=engine_stats.prefix_cache_hit_rate,
    )


def publish_stats(conn: redis.Redis, log: logging.Logger, **fields: Any) -> None:
    """Build and publish a worker's stats (`build_worker_stats`'s fields). Stats are informational: a failure
    is logged and never stops the worker."""
    try:
        publish_worker_stats(conn, build_worker_stats(**fields))
    except Exception:
        log.exception("Worker %s: publishing stats failed", fields.get("worker_name"))
