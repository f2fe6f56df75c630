"""Chunk admission: one dequeued chunk job becomes an rq execution and engine requests.

Owns what admitting needs to remember: how many jobs were admitted, the requests of the largest chunk admitted
so far (how many may wait unstarted in the engine: `CbqWorker._can_admit`), and the jobs dequeued just before
Redis failed, which are admitted again once it answers instead of waiting for a cleanup a minute later.

The worker (worker/queue_worker.py) runs the rq loop and calls `admit` for every job it dequeues; rq's hooks
(`prepare_execution`, `prepare_job_execution`, its executions) are the worker's, reached through `rq_worker`.
What a chunk's requests are (finished ones skipped, lines that fail alone) is `worker.admission`'s.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

from producer.store import queue_admission
from worker.admission import error_line, load_chunk_job
from worker.embedding.admission import ModelTask
from worker.engine.api import EngineProtocol
from worker.inflight import InFlightJob, InFlightTable
from worker.job_quarantine import quarantine_job, refusal
from worker.lost_dequeues import forget_sighting
from worker.maintenance import REDIS_ERRORS
from worker.media.load import ImageAdmission
from worker.output_parsers import OutputParsing
from worker.result_writer import Outcome, ResultWriter

T = TypeVar("T")

# (job, queue, execution, traceback text): fail a job through rq's failure handling (the worker's)
FailJob = Callable[[Job, Queue, Execution, str], None]


class ChunkAdmission:
    """Admits dequeued chunk jobs into `engine`, registering them in `in_flight`; a bad job fails alone."""

    def __init__(
        self,
        rq_worker: BaseWorker,
        engine: EngineProtocol,
        in_flight: InFlightTable,
        writer: ResultWriter,
        fail_job: FailJob,
        *,
        output_parsing: OutputParsing | None,
        model_task: ModelTask,
        media: ImageAdmission,
    ):
        self.rq_worker = rq_worker
        self.engine = engine
        self.in_flight = in_flight
        self.writer = writer
        self.fail_job = fail_job
        self.output_parsing = output_parsing
        self.model_task = model_task
        self.media = media
        self.num_jobs_admitted = 0
        # the requests of the largest chunk admitted so far: how many may wait unstarted in the engine
        self.num_reserve_requests = 1
        # (job, queue, execution or None) dequeued when Redis failed mid-admission; admitted again after it
        self._interrupted: list[tuple[Job, Queue, Execution | None]] = []

    def admit(self, job: Job, queue: Queue) -> None:
        """Start an rq execution for `job` and hand its requests to the engine. A bad job fails alone."""
        worker, connection = self.rq_worker, self.rq_worker.connection
        self.num_jobs_admitted += 1
        try:
            reason = refusal(job)  # decodes the payload (lazily done by rq)
        except Exception as exc:  # rq's failure handling decodes the payload again: it must not get this job
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:  # nothing of it is honoured, not even its failure callbacks or webhooks
            self._redis_step(job, queue, None, lambda: quarantine_job(connection, queue, job.id, reason))
            return
        execution = self._redis_step(job, queue, None, lambda: worker.prepare_execution(job))
        try:
            # CbqQueue moved it into the intermediate list, whatever the number of queues: it leaves it here,
            # in the transaction that marks it STARTED.
            worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
            forget_sighting(connection, queue, job.id)
            try:
                work = load_chunk_job(
                    connection,
                    job.id,
                    job.func_name,
                    job.kwargs,
                    self.engine.tokenizer,
                    self.engine.sampling_defaults,
                    self.output_parsing,
                    self.model_task,
                    self.media,
                )
            except REDIS_ERRORS:
                raise
            except Exception:
                worker.log.exception("Worker %s: job %s cannot be run", worker.name, job.id)
                self.fail_job(job, queue, execution, traceback.format_exc())
                return
            owner = self.in_flight.get(job.id)
            if owner is None:
                owner = InFlightJob(job, queue, execution, work.payload, work.ttl_seconds, time.monotonic())
                owner.counts["num_skipped"] = work.num_skipped
                self.in_flight.add(owner)
            else:  # re-enqueued while it ran here, and back: it continues once, under the new execution
                stale = self.in_flight.adopt(
                    owner, job, queue, execution, work, self.writer.held_indices(owner)
                )
                with connection.pipeline(transaction=True) as pipe:
                    stale.delete(job=job, pipeline=pipe)
                    pipe.execute()
                worker.executions.pop(stale.id, None)
        except REDIS_ERRORS:
            self._interrupted.append((job, queue, execution))
            raise
        self.num_reserve_requests = max(self.num_reserve_requests, len(work.to_run))
        for line in work.finished_now:
            self.writer.add(Outcome(owner, line, from_engine=False))
        for request, engine_request in work.to_run:
            try:
                self.engine.add_request(engine_request)
            except Exception as exc:  # the engine broke its contract for one request: fail that request only
                worker.log.exception("Worker %s: engine rejected %s", worker.name, engine_request.request_id)
                self.writer.add(
                    Outcome(owner, error_line(request.index, request.custom_id, repr(exc)), False)
                )
                continue
            self.in_flight.add_request(owner, engine_request.request_id, request)
        # Last: if Redis fails here, the requests are in the engine already and their results get written.
        with connection.pipeline(transaction=True) as pipe:
            queue_admission(pipe, work.payload.batch_id, job.id, len(owner.pending), work.ttl_seconds)
            pipe.execute()

    def _redis_step(self, job: Job, queue: Queue, execution: Execution | None, step: Callable[[], T]) -> T:
        """`step()`; if Redis fails meanwhile, `job` (dequeued, so no one else will take it) is admitted
        again once Redis is back (`resume_interrupted`)."""
        try:
            return step()
        except REDIS_ERRORS:
            self._interrupted.append((job, queue, execution))
            raise

    def resume_interrupted(self) -> None:
        """Admit again the jobs dequeued just before Redis failed. Otherwise they would wait in rq's intermediate
        list, or behind an execution nobody heartbeats, until a cleanup a minute later."""
        worker = self.rq_worker
        interrupted, self._interrupted = self._interrupted, []
        for job, queue, execution in interrupted:
            self.num_jobs_admitted -= 1
            if execution is not None and job.id not in self.in_flight:
                worker.executions.pop(execution.id, None)
                with worker.connection.pipeline(transaction=True) as pipe:
                    execution.delete(job=job, pipeline=pipe)
                    pipe.execute()
            worker.log.info("Worker %s: admitting job %s again after the outage", worker.name, job.id)
            self.admit(job, queue)
