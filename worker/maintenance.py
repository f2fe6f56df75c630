"""A worker's housekeeping against rq and Redis: the registry cleanup of one queue, the clock that tells it
which chunk executions count as abandoned (`HeartbeatClock`), and waiting for Redis to come back during an
outage. Keeps nothing in Redis of its own; `worker.queue_worker` calls all three.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import redis
from rq.queue import Queue
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    RateLimitRegistry,
    ReadyJobRegistry,
    StartedJobRegistry,
)
from rq.worker import BaseWorker
from rq.worker_registration import clean_worker_registry

from worker.job_quarantine import quarantine_undecodable
from worker.lost_dequeues import requeue_lost_dequeues
from worker.orphans import sweep_orphans

# rq's cleaning lock lasts 899 s: a worker killed while cleaning (or Redis restarted before the lock was
# released) must not block cleanup that long. The lock lasts as long as a chunk takes to be taken for abandoned
# (--stale-after), within these bounds: a dead worker's chunks then wait about the longer of the two.
MAINTENANCE_LOCK_SECONDS = (10, 60)
OUTAGE_BACKOFF_SECONDS = (0.25, 5.0)  # first and longest wait between reconnection attempts
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisUnavailable(RuntimeError):
    """Redis did not answer for longer than the worker's outage limit."""


def clean_queue_registries(
    worker: BaseWorker,
    queue: Queue,
    exc_handlers: list[Callable[..., Any]],
    lost_dequeue_after_seconds: float,
    stale_after_seconds: float,
    abandoned_before: float,
) -> None:
    """rq's cleanup of one queue's registries (it re-enqueues or fails the chunks of dead workers), made safe to
    run every few seconds: undecodable jobs are quarantined first, a failure is logged instead of killing the
    worker, and the per-queue lock is released, or expires soon (rq's would block cleanup for 15 min). Only
    executions that expired before `abandoned_before` (epoch seconds, `HeartbeatClock`) count as abandoned.
    Then cbq's own: lost dequeues go back to their queue, and (every `stale_after_seconds`) so do orphaned
    chunks (`worker.orphans`)."""
    conn = worker.connection
    shortest, longest = MAINTENANCE_LOCK_SECONDS
    lock_seconds = int(min(longest, max(shortest, stale_after_seconds)))
    if not _take_lock(conn, queue.registry_cleaning_key, worker.name, lock_seconds):
        return  # another worker is cleaning this queue
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("quarantining undecodable jobs", lambda: quarantine_undecodable(conn, queue)),
        ("rq's registry cleanup", lambda: clean_rq_registries(queue, exc_handlers, abandoned_before)),
        ("rq's worker registry cleanup", lambda: clean_worker_registry(queue)),
        # Before rq's intermediate cleanup, which would fail such a job after a minute (a retry lost).
        ("requeueing lost dequeues", lambda: requeue_lost_dequeues(conn, queue, lost_dequeue_after_seconds)),
        ("rq's intermediate list cleanup", lambda: queue.intermediate_queue.cleanup(worker, queue)),
        (
            "the orphan sweep",
            lambda: sweep_orphans(conn, queue, worker.name, stale_after_seconds, stale_after_seconds),
        ),
    ]
    try:
        # Each step on its own: one that fails on something in Redis (a forged entry, say) must not stop the
        # others, or a dead worker's chunks would wait for ever behind it (issue 44).
        for what, step in steps:
            try:
                step()
            except REDIS_ERRORS:
                raise
            except Exception:
                worker.log.exception("Worker %s: %s of queue %s failed", worker.name, what, queue.name)
    finally:
        try:
            if conn.get(queue.registry_cleaning_key) == worker.name.encode():
                conn.delete(queue.registry_cleaning_key)
        except REDIS_ERRORS:
            pass  # it expires


def clean_rq_registries(queue: Queue, exc_handlers: list[Callable[..., Any]], abandoned_before: float) -> None:
    """rq's `clean_registries`, with the cutoff of abandoned executions given (rq's is its own clock's now)."""
    options: dict[str, Any] = {
        "name": queue.name,
        "connection": queue.connection,
        "job_class": queue.job_class,
        "serializer": queue.serializer,
    }
    FinishedJobRegistry(**options).cleanup()
    StartedJobRegistry(**options).cleanup(timestamp=abandoned_before, exception_handlers=exc_handlers)
    FailedJobRegistry(**options).cleanup()
    DeferredJobRegistry(**options).cleanup()
    ReadyJobRegistry(**options).cleanup()
    for rate_limit_registry in RateLimitRegistry.all(queue.connection):
        rate_limit_registry.cleanup()


class HeartbeatClock:
    """When this worker last wrote its heartbeats, and so which chunk executions it may take for abandoned.

    An execution expires `--stale-after` seconds after its worker's last heartbeat. One that expired before this
    worker's own last heartbeat (the time it was sent, so Redis answered from then on) belongs to a worker that
    stopped heartbeating while Redis answered this one: abandoned. One that expired since may be a live worker's,
    held up as this one may have been: a Redis pause, or an outage, longer than `--stale-after` expires every
    execution at once, and rq's cleanup, which compares with its own clock's now, spent a retry of every chunk
    in flight (issue 44). After this worker's own heartbeats were held up (two writes more than
    `held_up_after` apart), the cutoff stays at the last write before, for `grace_seconds`, so every live
    worker has time to heartbeat again."""

    def __init__(self, held_up_after: float, grace_seconds: float):
        self.held_up_after = held_up_after
        self.grace_seconds = grace_seconds
        self.last_written_at = time.time()
        self._held_up: tuple[float, float] | None = None  # (the last write before, the first after)

    def reset(self, now: float) -> None:
        """The worker registered itself (a write) at `now`: its heartbeats count from there."""
        self.last_written_at = now
        self._held_up = None

    def written(self, sent_at: float) -> float | None:
        """Heartbeats sent at `sent_at` were written; returns how long they were held up (None: they were not)."""
        held_for = sent_at - self.last_written_at
        self.last_written_at = sent_at
        if held_for <= self.held_up_after:
            return None
        self._held_up = (sent_at - held_for, sent_at)
        return held_for

    def abandoned_before(self) -> float:
        if self._held_up is not None:
            before, after = self._held_up
            if time.time() < after + self.grace_seconds:
                return before
            self._held_up = None
        return self.last_written_at


def _take_lock(conn: redis.Redis, key: str, owner: str, seconds: int) -> bool:
    """SET NX under `owner`'s name. redis-py re-sends a command whose reply was lost, and the re-sent SET NX
    finds the lock its first copy took: the name tells that it is ours."""
    if conn.set(key, owner, nx=True, ex=seconds):
        return True
    return conn.get(key) == owner.encode()


class Outage:
    """One Redis outage as a worker rides it out: when it started, and how long the worker may wait."""

    def __init__(self, log: logging.Logger, worker_name: str, limit_seconds: float, cause: Exception):
        self.log = log
        self.worker_name = worker_name
        self.limit_seconds = limit_seconds
        self.cause = cause
        self.started = time.monotonic()

    def report_start(self, num_in_flight_requests: int) -> None:
        self.log.warning(
            "Worker %s: Redis unreachable (%s); %d requests in flight keep running, results are buffered",
            self.worker_name,
            self.cause,
            num_in_flight_requests,
        )

    def wait_for_redis(
        self, conn: redis.Redis, keep_busy: Callable[[float], None], num_buffered: Callable[[], int]
    ) -> None:
        """Return once Redis answers a PING, trying with a growing backoff and calling `keep_busy(seconds)`
        between tries. Raises RedisUnavailable once the outage has lasted `limit_seconds`."""
        delay, longest = OUTAGE_BACKOFF_SECONDS
        while True:
            keep_busy(delay)
            try:
                conn.ping()
                break
            except REDIS_ERRORS:
                pass
            down_for = time.monotonic() - self.started
            if down_for > self.limit_seconds:
                raise RedisUnavailable(
                    f"Redis did not answer for {down_for:.0f} s (limit {self.limit_seconds:g} s); "
                    f"{num_buffered()} finished results could not be written and will be redone"
                ) from self.cause
            delay = min(2 * delay, longest)
        self.log.warning(
            "Worker %s: Redis is back after %.1f s; writing %d buffered results",
            self.worker_name,
            time.monotonic() - self.started,
            num_buffered(),
        )


def touch(path: str) -> None:
    """Create `path` or update its modification time (container healthchecks read its age)."""
    with open(path, "a"):
        os.utime(path)
