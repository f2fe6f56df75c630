"""The in-flight table: which chunk jobs a worker holds, and which of their requests are inside its engine.

Owns `InFlightJob` records (rq job id -> chunk, engine request id -> its chunk), their adoption when the same
chunk is dequeued again while it runs, aborts (cancel flags, rq stop commands, job timeouts) and the requests
dropped after a chunk was taken over. It reads and writes no Redis: the worker loop (`worker.queue_worker`)
does that, and the result writer (`worker.result_writer`) asks it who owns what.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from schemas.chunk import ChunkPayload
from schemas.request import Request
from worker.admission import ChunkWork


@dataclass
class InFlightJob:
    job: Job
    queue: Queue
    execution: Execution
    payload: ChunkPayload
    ttl_seconds: int
    admitted_at: float  # time.monotonic()
    started_at: float | None = None  # time.monotonic() when its first request could be scheduled (timeouts)
    pending: dict[str, Request] = field(default_factory=dict)  # engine request id -> request
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    abort_reason: str | None = None  # "cancelled" | "stopped" | "timeout"
    failure: str | None = None  # set: the job ends through handle_job_failure

    def summary(self) -> dict[str, Any]:
        """The job's return value (JSON, via rq's JSONSerializer)."""
        return {
            "batch_id": self.payload.batch_id,
            "start": self.payload.start,
            "stop": self.payload.stop,
            **self.counts,
        }


class InFlightTable:
    """Chunks in flight, in admission order. `abort_request(engine_request_id)` asks the engine to stop one."""

    def __init__(self, abort_request: Callable[[str], None], log: logging.Logger, worker_name: str):
        self._abort_request = abort_request
        self._log = log
        self._worker_name = worker_name
        self._jobs: dict[str, InFlightJob] = {}  # rq job id -> chunk in flight
        self._owner_of: dict[str, InFlightJob] = {}  # engine request id -> its chunk
        self._dropped_request_ids: set[str] = set()  # aborted here after their chunk was taken over

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def get(self, job_id: str) -> InFlightJob | None:
        return self._jobs.get(job_id)

    def owners(self) -> list[InFlightJob]:
        """The chunks in admission order (a copy: callers may remove while iterating)."""
        return list(self._jobs.values())

    @property
    def num_requests(self) -> int:
        """Requests inside the engine."""
        return len(self._owner_of)

    def add(self, owner: InFlightJob) -> None:
        self._jobs[owner.job.id] = owner

    def add_request(self, owner: InFlightJob, engine_request_id: str, request: Request) -> None:
        owner.pending[engine_request_id] = request
        self._owner_of[engine_request_id] = owner

    def settle(self, engine_request_id: str) -> tuple[InFlightJob, Request] | None:
        """The chunk and request an engine result belongs to, no longer pending. None for a request this table
        dropped (its chunk was taken over) or never knew; `is_dropped` tells which."""
        owner = self._owner_of.pop(engine_request_id, None)
        if owner is None:
            return None
        return owner, owner.pending.pop(engine_request_id)

    def is_dropped(self, engine_request_id: str) -> bool:
        """Whether a result nobody owns was expected (and forget it)."""
        if engine_request_id in self._dropped_request_ids:
            self._dropped_request_ids.discard(engine_request_id)
            return True
        return False

    def remove(self, owner: InFlightJob) -> None:
        """The chunk ended here (finished, failed or handed back): forget it and its pending requests."""
        self._jobs.pop(owner.job.id, None)
        for request_id in owner.pending:
            self._owner_of.pop(request_id, None)

    def clear(self) -> None:
        for owner in self.owners():
            self.remove(owner)

    def drop(self, owner: InFlightJob) -> None:
        """Someone else owns the chunk now: abort what it has in the engine (results that still come back are
        ignored) and forget it."""
        self._jobs.pop(owner.job.id, None)
        for request_id in owner.pending:
            self._owner_of.pop(request_id, None)
            self._dropped_request_ids.add(request_id)
            self._abort_request(request_id)
        owner.pending.clear()

    def done(self) -> list[InFlightJob]:
        """Chunks with nothing left in the engine."""
        return [owner for owner in self._jobs.values() if not owner.pending]

    def adopt(
        self,
        owner: InFlightJob,
        job: Job,
        queue: Queue,
        execution: Execution,
        work: ChunkWork,
        settled: set[int],
    ) -> Execution:
        """`owner`'s job was dequeued again while it runs here (re-enqueued by a person or by cleanup): it
        continues once, under the new execution. Of `work` (the chunk loaded again) only the requests neither
        pending here nor `settled` (settled and not yet written) are kept. Returns the stale execution, which
        the caller deletes."""
        self._log.warning(
            "Worker %s: job %s is already running here; it continues once", self._worker_name, job.id
        )
        stale = owner.execution
        owner.job, owner.queue, owner.execution = job, queue, execution
        held = settled | {request.index for request in owner.pending.values()}
        work.to_run = [(r, e) for r, e in work.to_run if r.index not in held]
        work.finished_now = [r for r in work.finished_now if r.index not in held]
        return stale

    def by_execution_id(self, execution_id: str) -> InFlightJob | None:
        return next((o for o in self._jobs.values() if o.execution.id == execution_id), None)

    def batch_ids(self) -> list[str]:
        return sorted({owner.payload.batch_id for owner in self._jobs.values()})

    def abort(self, owner: InFlightJob, reason: str, failure: str | None = None) -> bool:
        """Abort `owner`'s requests in the engine (once); `failure` set: the job ends as failed. Returns whether
        this call aborted it."""
        if owner.abort_reason is not None:
            return False
        owner.abort_reason = reason
        owner.failure = failure
        self._log.info(
            "Worker %s: aborting %d requests of job %s (%s)",
            self._worker_name,
            len(owner.pending),
            owner.job.id,
            reason,
        )
        for request_id in list(owner.pending):
            self._abort_request(request_id)
        return True

    def abort_batches(self, batch_ids: Iterable[str]) -> None:
        """Abort the chunks of cancelled batches."""
        cancelled = set(batch_ids)
        for owner in self.owners():
            if owner.payload.batch_id in cancelled:
                self.abort(owner, "cancelled")

    def timed_out(self, now: float, num_running: int) -> list[tuple[InFlightJob, str]]:
        """Chunks past their --job-timeout, each with its failure message. A chunk's clock starts when its first request can
        be scheduled, not when it is admitted: chunks are admitted ahead of the engine (about one chunk beyond
        what it runs) and wait their turn. The engine schedules in admission order, so a chunk's turn has come once
        fewer requests admitted before it are unfinished than the engine is running."""
        out = []
        num_ahead = 0
        for owner in self.owners():
            if owner.started_at is None and num_ahead < max(1, num_running):
                owner.started_at = now
            num_ahead += len(owner.pending)
            timeout = owner.job.timeout
            if owner.started_at is None or timeout is None or timeout <= 0:
                continue
            if now - owner.started_at > timeout:
                out.append((owner, f"JobTimeoutException: chunk ran longer than {timeout:g} s"))
        return out
