"""CbqWorker: an rq worker that keeps many chunk jobs in flight inside one continuous-batching engine.

Owns the in-flight table (rq job -> its chunk, engine request -> its chunk) and every rq state transition of a
chunk job. Redis I/O happens here, in the main thread; the engine's step loop runs in its own thread
(`engine.start()`), and the two meet only through the engine's thread-safe methods.

rq's stock workers run one job at a time; here `work()` is replaced, and each job goes through rq's own hooks:
`prepare_execution` + `prepare_job_execution` on admit, `maintain_heartbeats` while in flight,
`handle_job_success` (so `job.return_value()` is the chunk's summary) or `handle_job_failure` (FailedJobRegistry,
retries) when its last request is back, and `run_maintenance_tasks` periodically.

Failure handling (issue 10):
- A chunk's rq execution expires `stale_after_seconds` after its last heartbeat, and every worker runs rq's
  registry cleanup every `maintenance_interval_seconds`, so a SIGKILLed worker's chunks run again within about
  the sum of the two (the defaults: under a minute).
- A Redis outage is ridden out: the engine keeps generating, finished results wait in memory (at most what was
  admitted), Redis is retried with backoff, and the buffered results are written once it answers. A write whose
  reply was lost is checked before it is repeated, so nothing is written twice; before each write the worker
  checks that it still owns the chunks (nobody re-enqueued them meanwhile). Past `redis_outage_limit_seconds`
  the worker gives up and exits non-zero; rq's cleanup then retries its chunks.
- A dequeue that Redis executed but never answered (it died in between) leaves a QUEUED job in rq's intermediate
  list that no worker holds; maintenance puts it back at the head of its queue (`worker.lost_dequeues`).
- A job that cannot be decoded goes to the FailedJobRegistry with the reason (`worker.job_quarantine`).
- The same chunk dequeued again while it runs here (re-enqueued by a person or by cleanup) is adopted: its
  requests keep running once, under the new execution.
"""

from __future__ import annotations

import os
import queue as thread_queue
import signal
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.utils import now as rq_now
from rq.worker import BaseWorker, DequeueStrategy, WorkerStatus
from rq.worker_registration import clean_worker_registry

from producer.store import publish_worker_stats, queue_admission, queue_results
from schemas import keys
from schemas.chunk import CHUNK_FUNC, ChunkPayload
from schemas.request import Request
from schemas.result import OUTCOME_OF_REASON, ResultLine
from worker.admission import ChunkWork, load_chunk, to_result_line
from worker.engine.api import EngineProtocol, EngineResult, FinishReason
from worker.job_quarantine import quarantine_job, quarantine_undecodable
from worker.lost_dequeues import requeue_lost_dequeues
from worker.output_parsers import OutputParsing
from worker.stats_publisher import build_worker_stats

RESULT_POLL_SECONDS = 0.02  # longest wait for engine results while work is in flight
CANCEL_POLL_SECONDS = 0.5
SUSPENSION_POLL_SECONDS = 1.0
IDLE_DEQUEUE_TIMEOUT_SECONDS = 1  # blocking dequeue when idle (rq wants whole seconds)

# Recovery from a dead worker: a chunk is abandoned STALE_AFTER seconds after its last heartbeat, and cleanup
# runs every MAINTENANCE_INTERVAL seconds on every worker (one at a time, under rq's per-queue lock).
DEFAULT_HEARTBEAT_INTERVAL_SECONDS = 10
DEFAULT_STALE_AFTER_SECONDS = 40
LOST_DEQUEUE_MAX_SECONDS = 50  # requeue a lost dequeue before rq's intermediate cleanup (60 s) fails it
DEFAULT_MAINTENANCE_INTERVAL_SECONDS = 15
# rq's cleaning lock lasts 899 s: a worker killed while cleaning must not block cleanup that long.
MAINTENANCE_LOCK_SECONDS = 60
DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS = 300
WORKER_TTL_SECONDS = 60  # rq derives the client's socket timeout from it (minus 5 s): a hung Redis is noticed
OUTAGE_BACKOFF_SECONDS = (0.25, 5.0)  # first and longest wait between reconnection attempts
FLUSH_ATTEMPTS = 5  # WATCH retries of one flush
COLD_STOP_EXIT_CODE = 1
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisUnavailable(RuntimeError):
    """Redis did not answer for longer than the worker's outage limit."""


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


@dataclass
class _Outcome:
    owner: InFlightJob
    result: ResultLine | None  # None: nothing to record (a request aborted by a timeout gets retried)
    from_engine: bool  # the request was counted as running


class CbqWorker(BaseWorker):
    """Drains cbq chunk jobs from rq queues into `engine` (anything with the Engine interface)."""

    def __init__(
        self,
        queues,
        engine: EngineProtocol,
        *,
        connection: redis.Redis,
        model_name: str = "",
        mode: str | None = None,
        name: str | None = None,
        stats_interval_seconds: float = 2.0,
        heartbeat_interval_seconds: int = DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
        stale_after_seconds: int = DEFAULT_STALE_AFTER_SECONDS,
        maintenance_interval_seconds: float = DEFAULT_MAINTENANCE_INTERVAL_SECONDS,
        redis_outage_limit_seconds: float = DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS,
        health_file: str | None = None,
        on_results_written: Callable[[list[ResultLine]], None] | None = None,
        output_parsing: OutputParsing | None = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("job_monitoring_interval", heartbeat_interval_seconds)
        kwargs.setdefault("maintenance_interval", maintenance_interval_seconds)
        kwargs.setdefault("worker_ttl", WORKER_TTL_SECONDS)
        if stale_after_seconds < 2 * kwargs["job_monitoring_interval"]:
            raise ValueError(
                f"stale_after_seconds ({stale_after_seconds}) must be at least twice the heartbeat interval "
                f"({kwargs['job_monitoring_interval']}), or live chunks would be taken for abandoned ones"
            )
        super().__init__(
            queues,
            name=name or f"cbq-{uuid.uuid4().hex[:12]}",
            connection=connection,
            serializer=JSONSerializer,
            **kwargs,
        )
        self.stale_after_seconds = int(stale_after_seconds)
        self.redis_outage_limit_seconds = redis_outage_limit_seconds
        self.health_file = health_file  # touched while the loop turns (container healthchecks read its age)
        # Called in the loop's thread with each group of results once Redis has them (`cbq run`'s journal).
        self.on_results_written = on_results_written
        self.engine = engine
        self.output_parsing = output_parsing  # tool-call and reasoning parsers for chat outputs (None: none)
        self.model_name = model_name
        self.mode = mode
        self.stats_interval_seconds = stats_interval_seconds
        self._jobs: dict[str, InFlightJob] = {}  # rq job id -> chunk in flight
        self._owner_of: dict[str, InFlightJob] = {}  # engine request id -> its chunk
        self._outcomes: list[_Outcome] = []  # settled requests not yet written to Redis
        self._num_in_doubt = 0  # the first n outcomes went out in a write whose reply was lost
        self._dropped_request_ids: set[str] = set()  # aborted here after their chunk was taken over
        # (job, queue, execution or None) dequeued when Redis failed mid-admission; admitted again after it
        self._interrupted_admissions: list[tuple[Job, Queue, Execution | None]] = []
        self._idle_since = time.monotonic()
        self._stop_execution_ids: thread_queue.SimpleQueue[str] = thread_queue.SimpleQueue()
        self._started_at = time.time()
        self._is_suspended = False
        self._next_at: dict[str, float] = defaultdict(float)  # periodic task -> next time.monotonic()
        self.num_jobs_admitted = 0
        self.num_jobs_finished = 0
        self.num_requests_finished = 0

    # --- the loop ----------------------------------------------------------------------------------------------

    def work(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = "%H:%M:%S",
        log_format: str = "%(asctime)s %(message)s",
        max_jobs: int | None = None,
        max_idle_time: int | None = None,
        with_scheduler: bool = False,
        dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT,
    ) -> bool:
        """Run until stopped (SIGINT/SIGTERM: stop admitting, drain, exit), or in burst mode until the queues
        are empty and nothing is in flight. Returns whether any job was admitted."""
        if with_scheduler:
            # rq's scheduler runs in a forked process, and the engine has already started CUDA. cbq retries
            # without intervals, so it needs no scheduler; run `rq worker --with-scheduler` elsewhere if wanted.
            raise ValueError("CbqWorker does not run rq's scheduler: it would fork after CUDA started")
        self.bootstrap(logging_level, date_format, log_format)
        self._dequeue_strategy = dequeue_strategy
        self._install_signal_handlers()
        self.engine.start()
        self._idle_since = time.monotonic()
        try:
            while True:
                try:
                    if self._turn(burst, max_jobs, max_idle_time):
                        break
                except REDIS_ERRORS as exc:
                    self._ride_out_outage(exc)
        except BaseException:
            # A crash (engine thread died, Redis gone too long, cold shutdown): hand the chunks back to rq right
            # away, rather than leaving them for the abandoned-job cleanup; retries skip what was written.
            self._fail_all_in_flight(traceback.format_exc())
            raise
        finally:
            self.engine.shutdown()
            self._publish_stats(state="stopped")
            self.teardown()
        return self.num_jobs_admitted > 0

    def _turn(self, burst: bool, max_jobs: int | None, max_idle_time: int | None) -> bool:
        """One turn of the loop; returns True when the worker should stop."""
        # 1. rq housekeeping: registries, abandoned jobs, `rq suspend`
        self._run_periodic_tasks()
        # 2. admit chunk jobs while the engine can use more requests
        queue_is_empty = self._admit_jobs(max_jobs)
        # 3. collect finished requests, write them, finish chunks whose last request is back
        waiting_is_useful = queue_is_empty or not self._can_admit(max_jobs)
        self._collect_engine_results(RESULT_POLL_SECONDS if self._jobs and waiting_is_useful else 0)
        self._flush_outcomes()
        if self._jobs:
            self._idle_since = time.monotonic()
            return False
        # 4. nothing in flight: exit, or wait for the next job
        if self._stop_requested:
            self.log.info("Worker %s: drained, stopping on request", self.name)
            return True
        if burst and self._is_suspended:
            self.log.info("Worker %s: suspended in burst mode, quitting", self.name)
            return True
        if burst and queue_is_empty:
            self.log.info("Worker %s: queues empty and nothing in flight, quitting (burst)", self.name)
            return True
        if max_jobs is not None and self.num_jobs_admitted >= max_jobs:
            return True
        if max_idle_time is not None and time.monotonic() - self._idle_since > max_idle_time:
            self.log.info("Worker %s: idle for %d seconds, quitting", self.name, max_idle_time)
            return True
        self._wait_for_job()
        return False

    def _ride_out_outage(self, exc: Exception) -> None:
        """Keep the engine drained while Redis is unreachable; return once it answers again.

        Finished results stay in `_outcomes` (bounded by what was admitted: nothing is admitted meanwhile).
        Raises RedisUnavailable past `redis_outage_limit_seconds`.
        """
        started = time.monotonic()
        self.log.warning(
            "Worker %s: Redis unreachable (%s); %d requests in flight keep running, results are buffered",
            self.name,
            exc,
            len(self._owner_of),
        )
        while True:
            self._wait_for_redis(started, exc)
            self.log.warning(
                "Worker %s: Redis is back after %.1f s; writing %d buffered results",
                self.name,
                time.monotonic() - started,
                len(self._outcomes),
            )
            try:
                # Heartbeats first: the executions may look abandoned by now, and this worker's cleanup is next.
                self._heartbeat_all()
                self._resume_interrupted_admissions()
                return
            except REDIS_ERRORS:  # gone again (or still loading its data)
                continue

    def _wait_for_redis(self, started: float, exc: Exception) -> None:
        delay, longest = OUTAGE_BACKOFF_SECONDS
        while True:
            wake_at = time.monotonic() + delay
            self._touch_health_file()  # alive, and doing what it should
            while time.monotonic() < wake_at:
                self._collect_engine_results(
                    min(RESULT_POLL_SECONDS * 10, max(0.0, wake_at - time.monotonic()))
                )
            try:
                self.connection.ping()
                return
            except REDIS_ERRORS:
                pass
            down_for = time.monotonic() - started
            if down_for > self.redis_outage_limit_seconds:
                raise RedisUnavailable(
                    f"Redis did not answer for {down_for:.0f} s (limit {self.redis_outage_limit_seconds:g} s); "
                    f"{len(self._outcomes)} finished results could not be written and will be redone"
                ) from exc
            delay = min(2 * delay, longest)

    def _can_admit(self, max_jobs: int | None) -> bool:
        if self._stop_requested or self._is_suspended:
            return False
        if max_jobs is not None and self.num_jobs_admitted >= max_jobs:
            return False
        return self.engine.has_capacity()

    def _admit_jobs(self, max_jobs: int | None) -> bool:
        """Dequeue and admit jobs while the engine has capacity. Returns True when the queues were empty."""
        while self._can_admit(max_jobs):
            result = self._dequeue(timeout=None)
            if result is None:
                return True
            self._admit(*result)
        return False

    def _wait_for_job(self) -> None:
        if self.get_state() != WorkerStatus.IDLE:
            self.set_state(WorkerStatus.IDLE)
        if not self._can_admit(None):  # suspended (`rq suspend`): keep the loop turning, slowly
            time.sleep(0.1)
            return
        try:
            result = self._dequeue(timeout=IDLE_DEQUEUE_TIMEOUT_SECONDS)
        except DequeueTimeout:
            return
        if result is not None:
            self._admit(*result)

    def _dequeue(self, timeout: int | None) -> tuple[Job, Queue] | None:
        """rq's dequeue; a job that cannot even be loaded is quarantined (and the next one taken)."""
        while True:
            try:
                result = self.queue_class.dequeue_any(
                    self._ordered_queues,
                    timeout,
                    connection=self.connection,
                    job_class=self.job_class,
                    serializer=self.serializer,
                    death_penalty_class=self.death_penalty_class,
                )
            except (*REDIS_ERRORS, DequeueTimeout):
                raise
            except Exception as exc:
                job_id, queue = getattr(exc, "job_id", None), getattr(exc, "queue", None)
                if job_id is None or queue is None:
                    raise
                quarantine_job(self.connection, queue, job_id, f"{type(exc).__name__}: {exc}")
                continue
            if result is not None:
                self.reorder_queues(reference_queue=result[1])
            return result

    # --- admission ---------------------------------------------------------------------------------------------

    def _admit(self, job: Job, queue: Queue) -> None:
        """Start an rq execution for `job` and hand its requests to the engine. A bad job fails alone."""
        self.num_jobs_admitted += 1
        try:
            func_name, kwargs = job.func_name, job.kwargs  # the payload is decoded here, lazily
        except Exception as exc:
            # rq's failure handling decodes the payload again, so an undecodable job must not reach it.
            self._redis_step(
                job,
                queue,
                None,
                quarantine_job,
                self.connection,
                queue,
                job.id,
                f"{type(exc).__name__}: {exc}",
            )
            return
        execution = self._redis_step(job, queue, None, self.prepare_execution, job)
        try:
            self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
            try:
                if func_name != CHUNK_FUNC:
                    raise ValueError(f"not a cbq chunk job: it calls {func_name!r}, expected {CHUNK_FUNC!r}")
                payload = ChunkPayload.model_validate(kwargs)
                work = load_chunk(
                    self.connection,
                    payload,
                    self.engine.tokenizer,
                    job.id,
                    self.engine.sampling_defaults,
                    self.output_parsing,
                )
            except REDIS_ERRORS:
                raise
            except Exception:
                self.log.exception("Worker %s: job %s cannot be run", self.name, job.id)
                self._finish_job_failed(job, queue, execution, traceback.format_exc())
                return
            owner = self._jobs.get(job.id)
            if owner is None:
                owner = InFlightJob(job, queue, execution, payload, work.ttl_seconds, time.monotonic())
                owner.counts["num_skipped"] = work.num_skipped
                self._jobs[job.id] = owner
            else:
                self._adopt(owner, job, queue, execution, work)
        except REDIS_ERRORS:
            self._interrupted_admissions.append((job, queue, execution))
            raise
        self._outcomes.extend(_Outcome(owner, r, from_engine=False) for r in work.finished_now)
        for request, engine_request in work.to_run:
            try:
                self.engine.add_request(engine_request)
            except Exception as exc:  # the engine broke its contract for one request: fail that request only
                self.log.exception("Worker %s: engine rejected %s", self.name, engine_request.request_id)
                error = ResultLine(
                    custom_id=request.custom_id, index=request.index, finish_reason="error", error=repr(exc)
                )
                self._outcomes.append(_Outcome(owner, error, from_engine=False))
                continue
            owner.pending[engine_request.request_id] = request
            self._owner_of[engine_request.request_id] = owner
        # Last: if Redis fails here, the requests are in the engine already and their results get written.
        with self.connection.pipeline(transaction=True) as pipe:
            queue_admission(pipe, payload.batch_id, job.id, len(owner.pending), work.ttl_seconds)
            pipe.execute()

    def _redis_step(self, job: Job, queue: Queue, execution: Execution | None, step, *args):
        """`step(*args)`; if Redis fails meanwhile, `job` (dequeued, so no one else will take it) is admitted
        again once Redis is back (`_resume_interrupted_admissions`)."""
        try:
            return step(*args)
        except REDIS_ERRORS:
            self._interrupted_admissions.append((job, queue, execution))
            raise

    def _resume_interrupted_admissions(self) -> None:
        """Admit again the jobs dequeued just before Redis failed. Otherwise they would wait in rq's intermediate
        list, or behind an execution nobody heartbeats, until a cleanup a minute later."""
        interrupted, self._interrupted_admissions = self._interrupted_admissions, []
        for job, queue, execution in interrupted:
            self.num_jobs_admitted -= 1
            if execution is not None and job.id not in self._jobs:
                self.executions.pop(execution.id, None)
                with self.connection.pipeline(transaction=True) as pipe:
                    execution.delete(job=job, pipeline=pipe)
                    pipe.execute()
            self.log.info("Worker %s: admitting job %s again after the outage", self.name, job.id)
            self._admit(job, queue)

    def _adopt(
        self, owner: InFlightJob, job: Job, queue: Queue, execution: Execution, work: ChunkWork
    ) -> None:
        """`job` is already in flight here (it was re-enqueued while it ran, and came back to this worker): it
        continues under the new execution, and only the requests this worker does not hold yet are added."""
        self.log.warning("Worker %s: job %s is already running here; it continues once", self.name, job.id)
        stale = owner.execution
        owner.job, owner.queue, owner.execution = job, queue, execution
        with self.connection.pipeline(transaction=True) as pipe:
            stale.delete(job=job, pipeline=pipe)
            pipe.execute()
        self.executions.pop(stale.id, None)
        held = {request.index for request in owner.pending.values()}
        held.update(o.result.index for o in self._outcomes if o.owner is owner and o.result is not None)
        work.to_run = [(r, e) for r, e in work.to_run if r.index not in held]
        work.finished_now = [r for r in work.finished_now if r.index not in held]

    # --- results -----------------------------------------------------------------------------------------------

    def _collect_engine_results(self, timeout: float) -> None:
        for result in self.engine.get_results(timeout=timeout):
            owner = self._owner_of.pop(result.request_id, None)
            if owner is None:
                if result.request_id in self._dropped_request_ids:
                    self._dropped_request_ids.discard(result.request_id)
                else:
                    self.log.warning(
                        "Worker %s: result for unknown request %s ignored", self.name, result.request_id
                    )
                continue
            request = owner.pending.pop(result.request_id)
            self._outcomes.append(_Outcome(owner, self._record_for(owner, request, result), from_engine=True))

    def _record_for(self, owner: InFlightJob, request: Request, result: EngineResult) -> ResultLine | None:
        if owner.abort_reason == "timeout" and result.finish_reason == FinishReason.CANCELLED:
            return None  # not finished: the retried chunk runs it again
        try:
            return to_result_line(request, result, self.engine.tokenizer, self.output_parsing)
        except Exception as exc:  # an engine result we cannot record fails that request, not the worker
            message = f"invalid engine result: {exc!r}"
            return ResultLine(
                custom_id=request.custom_id, index=request.index, finish_reason="error", error=message
            )

    def _flush_outcomes(self) -> None:
        """Write settled requests (one MULTI for all of them), then finish chunks with nothing left in flight."""
        for _ in range(FLUSH_ATTEMPTS):
            try:
                self._try_flush()
                return
            except redis.WatchError:  # someone touched one of these chunk jobs meanwhile: look again
                continue
        self.log.warning(
            "Worker %s: results not written after %d attempts; next turn", self.name, FLUSH_ATTEMPTS
        )

    def _try_flush(self) -> None:
        if self._num_in_doubt:
            self._drop_outcomes_already_written()
        # A chunk is done once nothing of it is in the engine (all its outcomes are in this flush).
        done_jobs = [owner for owner in self._jobs.values() if not owner.pending]
        if not self._outcomes and not done_jobs:
            return
        involved = {o.owner.job.id: o.owner for o in self._outcomes} | {o.job.id: o for o in done_jobs}
        with self.connection.pipeline(transaction=True) as pipe:
            # WATCH the chunk jobs: whoever re-enqueues one of them changes its hash, and this write aborts.
            pipe.watch(*[owner.job.key for owner in involved.values()])
            for owner in self._taken_over(list(involved.values())):
                self._disown(owner)
            done_jobs = [owner for owner in done_jobs if owner.job.id in self._jobs]
            outcomes = list(self._outcomes)
            by_batch: dict[str, list[_Outcome]] = defaultdict(list)
            for outcome in outcomes:
                by_batch[outcome.owner.payload.batch_id].append(outcome)
            for owner in done_jobs:
                by_batch.setdefault(owner.payload.batch_id, [])
            pipe.multi()
            for batch_id, group in by_batch.items():
                done_here = [owner for owner in done_jobs if owner.payload.batch_id == batch_id]
                queue_results(
                    pipe,
                    batch_id,
                    (group[0].owner if group else done_here[0]).ttl_seconds,
                    [o.result for o in group if o.result is not None],
                    running_job_ids=[o.owner.job.id for o in group if o.from_engine],
                    finished_job_ids=[owner.job.id for owner in done_here],
                    model=self.model_name,
                )
            # If the reply to EXEC is lost (Redis died), the write may or may not have happened: the next
            # attempt first looks whether it did (`_drop_outcomes_already_written`).
            self._num_in_doubt = len(outcomes)
            try:
                pipe.execute()
            except redis.WatchError:
                self._num_in_doubt = 0
                raise
        self._num_in_doubt = 0
        del self._outcomes[: len(outcomes)]
        self._count_written(outcomes)
        for owner in done_jobs:
            self._finish_job(owner)

    def _count_written(self, outcomes: list[_Outcome]) -> None:
        written = [outcome.result for outcome in outcomes if outcome.result is not None]
        for outcome in outcomes:
            if outcome.result is not None:
                outcome.owner.counts[f"num_{OUTCOME_OF_REASON[outcome.result.finish_reason]}"] += 1
                self.num_requests_finished += 1
        if written and self.on_results_written is not None:
            self.on_results_written(written)

    def _drop_outcomes_already_written(self) -> None:
        """The first `_num_in_doubt` outcomes went out in one MULTI whose reply never came. MULTI is all or
        nothing, so one of their results tells whether it happened; if it did, they are not written again."""
        in_doubt = self._outcomes[: self._num_in_doubt]
        probe = next((o for o in in_doubt if o.result is not None), None)
        applied = probe is None or bool(
            self.connection.hexists(keys.batch_results(probe.owner.payload.batch_id), probe.result.index)
        )
        if applied:
            self.log.warning(
                "Worker %s: the write before the outage went through; not repeating it", self.name
            )
            del self._outcomes[: self._num_in_doubt]
            self._count_written(in_doubt)
        self._num_in_doubt = 0

    def _taken_over(self, owners: list[InFlightJob]) -> list[InFlightJob]:
        """The chunks among `owners` that this worker no longer owns: their job left the STARTED state or their
        execution left the StartedJobRegistry (rq's cleanup took them for abandoned, or someone requeued them)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for owner in owners:
                pipe.hget(owner.job.key, "status")
                pipe.zscore(owner.queue.started_job_registry.key, owner.execution.composite_key)
            replies = pipe.execute()
        started = JobStatus.STARTED.value.encode()
        return [
            owner
            for owner, status, score in zip(owners, replies[0::2], replies[1::2], strict=True)
            if status != started or score is None
        ]

    def _disown(self, owner: InFlightJob) -> None:
        """Forget a chunk someone else owns now: abort what it has in the engine and drop what it has not
        written. Its new owner runs those requests (and skips the ones already written)."""
        self.log.warning(
            "Worker %s: job %s was re-enqueued while it ran here; dropping its %d unwritten requests",
            self.name,
            owner.job.id,
            len(owner.pending) + sum(1 for o in self._outcomes if o.owner is owner),
        )
        del self._jobs[owner.job.id]
        self.executions.pop(owner.execution.id, None)
        for request_id in owner.pending:
            self._owner_of.pop(request_id, None)
            self._dropped_request_ids.add(request_id)
            self.engine.abort(request_id)
        owner.pending.clear()
        self._outcomes = [o for o in self._outcomes if o.owner is not owner]

    # --- finishing jobs through rq's handlers ------------------------------------------------------------------

    def _finish_job(self, owner: InFlightJob) -> None:
        job, queue, execution = owner.job, owner.queue, owner.execution
        if owner.failure is not None:
            self._finish_job_failed(
                job, queue, execution, owner.failure, stopped=owner.abort_reason == "stopped"
            )
        else:
            self.handle_execution_ended(job, queue, job.success_callback_timeout)
            job._result = (
                owner.summary()
            )  # NOTE: rq's handle_job_success stores job._result as the return value
            self.handle_job_success(
                job=job, queue=queue, started_job_registry=queue.started_job_registry, execution=execution
            )
        # Only now: if Redis failed above, the chunk is finished again next turn (or, if rq's write went
        # through, found no longer STARTED and dropped).
        del self._jobs[job.id]
        self.num_jobs_finished += 1

    def _finish_job_failed(
        self, job: Job, queue: Queue, execution: Execution, exc_string: str, stopped: bool = False
    ) -> None:
        self.handle_execution_ended(job, queue, job.failure_callback_timeout)
        if stopped:
            self._stopped_job_id = job.id  # rq marks it STOPPED instead of FAILED, and never retries it
        self.handle_job_failure(
            job=job,
            queue=queue,
            started_job_registry=queue.started_job_registry,
            exc_string=exc_string,
            execution=execution,
        )

    def _fail_all_in_flight(self, exc_string: str) -> None:
        try:
            self._collect_engine_results(0)
            self._flush_outcomes()  # what finished is kept; only the rest is redone
        except Exception:
            self.log.warning("Worker %s: could not write %d finished results", self.name, len(self._outcomes))
        for owner in list(self._jobs.values()):
            for request_id in owner.pending:
                self._owner_of.pop(request_id, None)
            try:
                with self.connection.pipeline(transaction=True) as pipe:
                    # Nothing of this chunk runs here any more; a retry registers again what it runs.
                    queue_results(
                        pipe, owner.payload.batch_id, owner.ttl_seconds, [], finished_job_ids=[owner.job.id]
                    )
                    pipe.execute()
                self._finish_job_failed(owner.job, owner.queue, owner.execution, exc_string)
            except Exception:
                self.log.exception("Worker %s: could not hand job %s back", self.name, owner.job.id)
        self._jobs.clear()

    # --- aborts: cancel flags, `rq` stop commands, timeouts ----------------------------------------------------

    def _abort(self, owner: InFlightJob, reason: str, failure: str | None = None) -> None:
        if owner.abort_reason is not None:
            return
        owner.abort_reason = reason
        owner.failure = failure
        self.log.info(
            "Worker %s: aborting %d requests of job %s (%s)",
            self.name,
            len(owner.pending),
            owner.job.id,
            reason,
        )
        for request_id in list(owner.pending):
            self.engine.abort(request_id)

    def _check_cancel_flags(self) -> None:
        batch_ids = sorted({owner.payload.batch_id for owner in self._jobs.values()})
        if not batch_ids:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.exists(keys.batch_cancel(batch_id))
            cancelled = {b for b, flag in zip(batch_ids, pipe.execute(), strict=True) if flag}
        for owner in list(self._jobs.values()):
            if owner.payload.batch_id in cancelled:
                self._abort(owner, "cancelled")

    def _check_stop_commands(self) -> None:
        while not self._stop_execution_ids.empty():
            execution_id = self._stop_execution_ids.get_nowait()
            for owner in list(self._jobs.values()):
                if owner.execution.id == execution_id:
                    self._abort(owner, "stopped", failure="stopped by an rq stop-job command")

    def _check_timeouts(self) -> None:
        """A chunk's --job-timeout clock starts when its first request can be scheduled, not when it is
        admitted: chunks are admitted ahead of the engine (up to twice what it runs) and wait their turn.
        The engine schedules in admission order, so a chunk's turn has come once fewer requests admitted
        before it are unfinished than the engine is running."""
        now = time.monotonic()
        num_running = self.engine.stats().num_running
        num_ahead = 0
        for owner in list(self._jobs.values()):  # in admission order
            if owner.started_at is None and num_ahead < max(1, num_running):
                owner.started_at = now
            num_ahead += len(owner.pending)
            timeout = owner.job.timeout
            if owner.started_at is None or timeout is None or timeout <= 0:
                continue
            if now - owner.started_at > timeout:
                self._abort(
                    owner, "timeout", failure=f"JobTimeoutException: chunk ran longer than {timeout} s"
                )

    def request_stop_execution(self, execution_id: str) -> None:
        """rq's stop-execution command (called from rq's pubsub thread): the main loop aborts that chunk."""
        self._stop_execution_ids.put(execution_id)

    def kill_horse(self, sig=None) -> None:
        """rq's stop-job command sets `_stopped_job_id` and kills the horse; cbq has no horse, so it stops that
        job's chunk instead. (Called from rq's pubsub thread.)"""
        owner = self._jobs.get(self._stopped_job_id or "")
        if owner is not None:
            self._stop_execution_ids.put(owner.execution.id)

    # --- periodic tasks ----------------------------------------------------------------------------------------

    def _due(self, task: str, every_seconds: float) -> bool:
        now = time.monotonic()
        if now < self._next_at[task]:
            return False
        self._next_at[task] = now + every_seconds
        return True

    def _run_periodic_tasks(self) -> None:
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        if self._due("suspension", SUSPENSION_POLL_SECONDS):
            self._is_suspended = bool(is_suspended(self.connection, self))
        if self._due("cancel", CANCEL_POLL_SECONDS):
            self._check_cancel_flags()
            self._check_timeouts()
        self._check_stop_commands()
        if self._due("heartbeat", self.job_monitoring_interval):
            self._heartbeat_all()
        if self._due("stats", self.stats_interval_seconds):
            self._publish_stats()
            self._touch_health_file()

    def clean_registries(self) -> None:
        """rq's cleanup of each queue's registries (it re-enqueues or fails the chunks of dead workers), made
        safe to run every few seconds: undecodable jobs are quarantined first, a failure is logged instead of
        killing the worker, and the per-queue lock is always released (rq's would block cleanup for 15 min)."""
        for queue in self.queues:
            if not self.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=MAINTENANCE_LOCK_SECONDS):
                continue
            try:
                quarantine_undecodable(self.connection, queue)
                clean_registries(queue, self._exc_handlers)
                clean_worker_registry(queue)
                # Before rq's intermediate cleanup, which would fail such a job after a minute (a retry lost).
                requeue_lost_dequeues(
                    self.connection, queue, min(self.stale_after_seconds, LOST_DEQUEUE_MAX_SECONDS)
                )
                queue.intermediate_queue.cleanup(self, queue)
            except REDIS_ERRORS:
                raise
            except Exception:
                self.log.exception(
                    "Worker %s: cleaning the registries of queue %s failed", self.name, queue.name
                )
            finally:
                try:
                    queue.release_maintenance_lock()
                except REDIS_ERRORS:
                    pass  # it expires
        self.last_cleaned_at = rq_now()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """How long an execution lives without a heartbeat: past it, rq's cleanup takes the chunk for abandoned.
        (rq's own is the heartbeat interval + 60 s, and shorter near a job timeout, which cbq counts itself.)"""
        return self.stale_after_seconds

    def teardown(self) -> None:
        try:
            super().teardown()
        except REDIS_ERRORS as exc:  # Redis gone: rq's worker entry expires on its own
            self.log.warning("Worker %s: could not unregister (%s)", self.name, exc)

    def _heartbeat_all(self) -> None:
        if not self._jobs:
            self.heartbeat()
        for owner in self._jobs.values():
            self.maintain_heartbeats(owner.job, owner.execution)

    def _touch_health_file(self) -> None:
        if self.health_file is not None:
            with open(self.health_file, "a"):
                os.utime(self.health_file)

    def _publish_stats(self, state: str | None = None) -> None:
        if state is None:
            state = "draining" if self._stop_requested else ("busy" if self._jobs else "idle")
        try:
            stats = build_worker_stats(
                worker_name=self.name,
                model=self.model_name,
                mode=self.mode,
                queues=self.queue_names(),
                started_at=self._started_at,
                state=state,
                engine_stats=self.engine.stats(),
                num_in_flight_jobs=len(self._jobs),
                num_in_flight_requests=len(self._owner_of),
                num_jobs_finished=self.num_jobs_finished,
                num_requests_finished=self.num_requests_finished,
            )
            publish_worker_stats(self.connection, stats)
        except Exception:  # stats are informational; never let them stop the worker
            self.log.exception("Worker %s: publishing stats failed", self.name)

    def subscribe(self) -> None:
        """rq's command channel (`rq` stop-job, shutdown). Polled every 0.2 s instead of rq's 60 s, because
        teardown joins this thread for up to 1 s and `cbq run` should not idle that long before exiting."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=0.2, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    # --- signals -----------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        # Signal handlers can only be set from the main thread; a worker embedded in a thread (tests, notebooks)
        # is stopped by its owner through `request_stop` instead.
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()

    def request_stop(self, signum, frame) -> None:
        """First SIGINT/SIGTERM: stop admitting and drain what is in flight. A second one: cold stop."""
        self._shutdown_requested_date = rq_now()
        self._stop_requested = True
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self.log.info(
            "Worker %s: warm shutdown requested, draining %d jobs in flight", self.name, len(self._jobs)
        )

    def request_force_stop(self, signum, frame) -> None:
        """Second SIGINT/SIGTERM: stop now, handing the chunks back (see `work`), and exit non-zero."""
        try:
            super().request_force_stop(signum, frame)
        except SystemExit:
            raise SystemExit(COLD_STOP_EXIT_CODE) from None
