"""The worker's reads of one chunk job's share of a batch: the batch fields a chunk is checked against, then
its stored requests, their results so far, and the batch's cancel flag. Owns no key; `schemas.keys` spells
them, `submit` writes them."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from schemas import keys
from schemas.keys import BatchField


@dataclass(frozen=True)
class ChunkBatch:
    """What a chunk's batch says about it (None fields: the batch is gone)."""

    created_at: float
    ttl_seconds: int
    num_requests: int
    recorded_range: str | None  # "start:stop" submit recorded for the job, None if it recorded none


@dataclass(frozen=True)
class ChunkRequests:
    is_cancelled: bool
    raw_requests: list[bytes | None]  # stored request JSON, per index asked for
    raw_results: list[bytes | None]  # stored result JSON (None: not finished yet)


def read_chunk_batch(conn: redis.Redis, batch_id: str, job_id: str | None) -> ChunkBatch | None:
    """The batch fields of a chunk job (one round trip); None when the batch no longer exists."""
    fields = [BatchField.CREATED_AT.value, BatchField.TTL_SECONDS.value, BatchField.NUM_REQUESTS.value]
    with conn.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.batch(batch_id), fields)
        pipe.hget(keys.batch_jobs(batch_id), job_id or "")
        (created_at, ttl_seconds, num_requests), recorded_range = pipe.execute()
    if created_at is None:
        return None
    return ChunkBatch(
        created_at=float(created_at),
        ttl_seconds=int(ttl_seconds),
        num_requests=int(num_requests),
        recorded_range=recorded_range.decode(errors="replace") if recorded_range is not None else None,
    )


def read_chunk_requests(conn: redis.Redis, batch_id: str, indices: list[int]) -> ChunkRequests:
    """The stored requests and results at `indices`, and the cancel flag (one round trip)."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.exists(keys.batch_cancel(batch_id))
        pipe.hmget(keys.batch_requests(batch_id), indices)
        pipe.hmget(keys.batch_results(batch_id), indices)
        is_cancelled, raw_requests, raw_results = pipe.execute()
    return ChunkRequests(bool(is_cancelled), raw_requests, raw_results)
