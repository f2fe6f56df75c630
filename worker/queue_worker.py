"""CbqWorker: an rq worker that keeps many chunk jobs in flight inside one continuous-batching engine.

Owns the rq loop: dequeue and admission, rq's state transitions of a chunk job, periodic maintenance, Redis
outages, signals and rq's commands. Redis I/O happens here, in the main thread; the engine's step loop runs in
its own thread (`engine.start()`), and the two meet only through the engine's thread-safe methods. Two parts
live in modules of their own: the in-flight table (`worker.inflight`: which chunks and requests are here,
adoption, aborts, timeouts), chunk admission (`worker.chunk_admission`: a dequeued job's rq execution and engine
requests, and its admission again after an outage) and the exactly-once result writer (`worker.result_writer`). rq's private members
are used only through `worker.rq_adapter`.

rq's stock workers run one job at a time; here `work()` is replaced, and each job goes through rq's own hooks:
`prepare_execution` + `prepare_job_execution` on admit, `maintain_heartbeats` while in flight,
`handle_job_success` (so `job.return_value()` is the chunk's summary) or `handle_job_failure` (FailedJobRegistry,
retries) when its last request is back, and `run_maintenance_tasks` periodically.

Failure handling (issue 10):
- A chunk's rq execution expires `stale_after_seconds` after its last heartbeat, and every worker runs rq's
  registry cleanup every `maintenance_interval_seconds`, so a SIGKILLed worker's chunks run again within about
  the sum of the two (the defaults: under a minute).
- A Redis outage is ridden out: the engine keeps generating, finished results wait in memory (at most what was
  admitted), Redis is retried with backoff, and the buffered results are written once it answers (the writer
  makes sure a write whose reply was lost is not applied twice). Past `redis_outage_limit_seconds` the worker
  gives up and exits non-zero; rq's cleanup then retries its chunks.
- Every dequeue moves the job into its queue's intermediate list (also over several queues, where rq pops it
  outright), so a dequeue whose worker died or whose reply was lost leaves a QUEUED job there that no worker
  holds; maintenance puts it back at the head of its queue (`worker.lost_dequeues`).
- A job that cannot be decoded goes to the FailedJobRegistry with the reason (`worker.job_quarantine`).
- The same chunk dequeued again while it runs here (re-enqueued by a person or by cleanup) is adopted: its
  requests keep running once, under the new execution.
"""

from __future__ import annotations

import queue as thread_queue
import signal
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.utils import now as rq_now
from rq.worker import BaseWorker, DequeueStrategy, WorkerStatus

from producer import settings
from producer.store import MarkerWatch, cancelled_batch_ids, wiped_line
from schemas.result import ResultLine
from worker import rq_adapter
from worker.chunk_admission import ChunkAdmission
from worker.embedding.admission import ModelTask
from worker.engine.api import EngineProtocol
from worker.inflight import InFlightJob, InFlightTable
from worker.job_quarantine import dequeue_decodable
from worker.maintenance import REDIS_ERRORS, HeartbeatClock, Outage, clean_queue_registries, touch
from worker.media.load import ImageAdmission
from worker.media.policy import MediaPolicy
from worker.output_parsers import OutputParsing
from worker.replica_wait import ReplicaWait
from worker.result_writer import ResultWriter
from worker.rq_classes import CbqJob, CbqQueue
from worker.stats_publisher import publish_stats

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
DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS = settings.DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS  # one default for workers and `cbq wait`
WORKER_TTL_SECONDS = 60  # rq derives the client's socket timeout from it (minus 5 s): a hung Redis is noticed
COLD_STOP_EXIT_CODE = 1


def check_stale_after(stale_after_seconds: float, heartbeat_interval_seconds: float) -> None:
    if stale_after_seconds < 2 * heartbeat_interval_seconds:
        raise ValueError(
            f"stale_after_seconds ({stale_after_seconds}) must be at least twice the heartbeat interval "
            f"({heartbeat_interval_seconds}), or live chunks would be taken for abandoned ones"
        )


class CbqWorker(BaseWorker):
    """Drains cbq chunk jobs from rq queues into `engine` (anything with the Engine interface)."""

    def __init__(
        self,
        queues: Any,
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
        media_policy: MediaPolicy | None = None,
        replica_wait: ReplicaWait | None = None,  # --redis-wait-replicas: WAIT after each result write
        **kwargs: Any,
    ):
        options = {
            "job_monitoring_interval": heartbeat_interval_seconds,
            "maintenance_interval": maintenance_interval_seconds,
            "worker_ttl": WORKER_TTL_SECONDS,
            "job_class": CbqJob,  # a job's hash is untrusted data (worker.rq_classes)
            "queue_class": CbqQueue,
            **kwargs,
        }
        check_stale_after(stale_after_seconds, options["job_monitoring_interval"])
        name = name or f"cbq-{uuid.uuid4().hex[:12]}"
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer, **options)
        self.stale_after_seconds = int(stale_after_seconds)
        # Heartbeats held up for longer than this may have let live executions expire (an idle turn blocks on
        # its dequeue for a second, so two heartbeats of an idle worker can be that much more than one apart).
        interval = options["job_monitoring_interval"]
        self.heartbeat_clock = HeartbeatClock(
            held_up_after=max(self.stale_after_seconds - interval, interval + IDLE_DEQUEUE_TIMEOUT_SECONDS + 1),
            grace_seconds=self.stale_after_seconds,
        )
        self.redis_outage_limit_seconds = redis_outage_limit_seconds
        self.health_file = health_file  # touched while the loop turns (container healthchecks read its age)
        self.engine = engine
        self.output_parsing = output_parsing  # tool-call and reasoning parsers for chat outputs (None: none)
        self.model_task = ModelTask.of(engine)  # generation or embedding: lines of the other kind fail alone
        # What a chat's images may be read from (worker/media/); refused at once when the engine takes none.
        self.media = ImageAdmission(media_policy or MediaPolicy(), engine.accepts_images, model_name or "this model")
        self.model_name = model_name
        self.mode = mode
        self.stats_interval_seconds = stats_interval_seconds
        self.in_flight = InFlightTable(engine.abort, self.log, self.name)
        self.store_marker = MarkerWatch(connection)  # tells a Redis that lost its data from a requeue
        self.writer = ResultWriter(
            connection,
            self.in_flight,
            model_name=model_name,
            finish_job=self._finish_job,
            forget_execution=self._forget_execution,
            log=self.log,
            worker_name=self.name,
            on_written=on_results_written,  # in the loop's thread, once Redis has them (`cbq run`'s journal)
            is_store_wiped=self.store_marker.wiped,
            replica_wait=replica_wait,
        )
        self.admission = ChunkAdmission(
            self,
            engine,
            self.in_flight,
            self.writer,
            self._finish_job_failed,
            output_parsing=output_parsing,
            model_task=self.model_task,
            media=self.media,
        )
        self._idle_since = time.monotonic()
        self._stop_execution_ids: thread_queue.SimpleQueue[str] = thread_queue.SimpleQueue()
        self._started_at = time.time()
        self._is_suspended = False
        self.stop_signum: int | None = None  # the first SIGINT/SIGTERM that stopped this worker, if one did
        self._next_at: dict[str, float] = defaultdict(float)  # periodic task -> next time.monotonic()
        self.num_jobs_finished = 0

    def _forget_execution(self, owner: InFlightJob) -> None:
        self.executions.pop(owner.execution.id, None)

    @property
    def num_requests_finished(self) -> int:
        return self.writer.num_requests_finished

    @property
    def num_jobs_admitted(self) -> int:
        return self.admission.num_jobs_admitted

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
        registered_at = time.time()
        self.bootstrap(logging_level, date_format, log_format)
        self.heartbeat_clock.reset(registered_at)
        self.store_marker.start()
        rq_adapter.set_dequeue_strategy(self, dequeue_strategy)
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
        self._collect_engine_results(RESULT_POLL_SECONDS if self.in_flight and waiting_is_useful else 0)
        self.writer.flush()
        if self.in_flight:
            self._idle_since = time.monotonic()
            return False
        # 4. nothing in flight: exit, or wait for the next job
        if rq_adapter.is_stop_requested(self):
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
        """Keep the engine drained while Redis is unreachable; return once it answers again. Finished results
        stay in the writer (bounded by what was admitted: nothing is admitted meanwhile). Raises
        RedisUnavailable past `redis_outage_limit_seconds`."""
        outage = Outage(self.log, self.name, self.redis_outage_limit_seconds, exc)
        outage.report_start(self.in_flight.num_requests)
        while True:
            outage.wait_for_redis(self.connection, self._keep_busy, lambda: len(self.writer.outcomes))
            try:
                self._report_wiped_store()
                # Heartbeats first: the executions may look abandoned by now, and this worker's cleanup is next.
                self._heartbeat_all()
                self.admission.resume_interrupted()
                return
            except REDIS_ERRORS:  # gone again (or still loading its data)
                continue

    def _report_wiped_store(self) -> None:
        """Redis came back without its data (restarted without persistence): say so once per batch in flight;
        the chunks are dropped as their results find no owner (`ResultWriter`)."""
        if self.store_marker.wiped():
            for batch_id in sorted(self.in_flight.batch_ids()):
                self.log.error("Worker %s: %s", self.name, wiped_line(batch_id))

    def _keep_busy(self, seconds: float) -> None:
        """While Redis is away: stay healthy and keep taking the engine's results."""
        self._touch_health_file()
        wake_at = time.monotonic() + seconds
        while time.monotonic() < wake_at:
            self._collect_engine_results(min(RESULT_POLL_SECONDS * 10, max(0.0, wake_at - time.monotonic())))

    def _can_admit(self, max_jobs: int | None) -> bool:
        if rq_adapter.is_stop_requested(self) or self._is_suspended:
            return False
        if max_jobs is not None and self.num_jobs_admitted >= max_jobs:
            return False
        # Fair sharing (docs/operations.md): at most about one chunk waits unstarted in the engine, so the
        # rest of a large batch stays in the queue for a worker that joins; one chunk in reserve keeps every
        # slot that frees busy until the next turn of this loop admits more.
        return self.engine.has_capacity() and self.engine.num_unstarted() < self.admission.num_reserve_requests

    def _admit_jobs(self, max_jobs: int | None) -> bool:
        """Dequeue and admit jobs while the engine has capacity. Returns True when the queues were empty."""
        while self._can_admit(max_jobs):
            result = dequeue_decodable(self, rq_adapter.ordered_queues(self), timeout=None)
            if result is None:
                return True
            self.admission.admit(*result)
        return False

    def _wait_for_job(self) -> None:
        if self.get_state() != WorkerStatus.IDLE:
            self.set_state(WorkerStatus.IDLE)
        if not self._can_admit(None):  # suspended (`rq suspend`): keep the loop turning, slowly
            time.sleep(0.1)
            return
        try:
            result = dequeue_decodable(self, rq_adapter.ordered_queues(self), IDLE_DEQUEUE_TIMEOUT_SECONDS)
        except DequeueTimeout:
            return
        if result is not None:
            self.admission.admit(*result)

    def _collect_engine_results(self, timeout: float) -> None:
        self.writer.collect(self.engine.get_results(timeout=timeout), self.engine.tokenizer, self.output_parsing)

    # --- finishing jobs through rq's handlers ------------------------------------------------------------------

    def _finish_job(self, owner: InFlightJob) -> None:
        job, queue, execution = owner.job, owner.queue, owner.execution
        if owner.failure is not None:
            self._finish_job_failed(
                job, queue, execution, owner.failure, stopped=owner.abort_reason == "stopped"
            )
        else:
            self.handle_execution_ended(job, queue, job.success_callback_timeout)
            rq_adapter.set_return_value(job, owner.summary())
            self.handle_job_success(
                job=job, queue=queue, started_job_registry=queue.started_job_registry, execution=execution
            )
        # Only now: if Redis failed above, the chunk is finished again next turn (or, if rq's write went
        # through, found no longer STARTED and dropped).
        self.in_flight.remove(owner)
        self.num_jobs_finished += 1

    def _finish_job_failed(
        self, job: Job, queue: Queue, execution: Execution, exc_string: str, stopped: bool = False
    ) -> None:
        self.handle_execution_ended(job, queue, job.failure_callback_timeout)
        if stopped:
            rq_adapter.mark_job_stopped(self, job.id)  # STOPPED instead of FAILED, and never retried
        self.handle_job_failure(
            job=job,
            queue=queue,
            started_job_registry=queue.started_job_registry,
            exc_string=exc_string,
            execution=execution,
        )

    def _fail_all_in_flight(self, exc_string: str) -> None:
        # What finished is kept; only the rest is redone.
        self.writer.flush_before_exit(collect=lambda: self._collect_engine_results(0))
        for owner in self.in_flight.owners():
            self.in_flight.remove(owner)
            try:
                self.writer.release(owner)  # nothing of it runs here any more; a retry registers what it runs
                self._finish_job_failed(owner.job, owner.queue, owner.execution, exc_string)
            except Exception:
                self.log.exception("Worker %s: could not hand job %s back", self.name, owner.job.id)

    # --- aborts: cancel flags, `rq` stop commands, timeouts ----------------------------------------------------

    def _check_aborts(self) -> None:
        """Cancel flags of the batches in flight, rq stop commands, --job-timeout."""
        if self._due("cancel", CANCEL_POLL_SECONDS):
            self.in_flight.abort_batches(cancelled_batch_ids(self.connection, self.in_flight.batch_ids()))
            for owner, failure in self.in_flight.timed_out(time.monotonic(), self.engine.stats().num_running):
                self.in_flight.abort(owner, "timeout", failure)
        while not self._stop_execution_ids.empty():
            stopped = self.in_flight.by_execution_id(self._stop_execution_ids.get_nowait())
            if stopped is not None:
                self.in_flight.abort(stopped, "stopped", "stopped by an rq stop-job command")

    def request_stop_execution(self, execution_id: str) -> None:
        """rq's stop-execution command (called from rq's pubsub thread): the main loop aborts that chunk."""
        self._stop_execution_ids.put(execution_id)

    def kill_horse(self, sig: Any = None) -> None:
        """rq's stop-job command records the job to stop and kills the horse; cbq has no horse, so it stops
        that job's chunk instead. (Called from rq's pubsub thread.)"""
        owner = self.in_flight.get(rq_adapter.stopped_job_id(self) or "")
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
        self._check_aborts()
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
            clean_queue_registries(
                self,
                queue,
                rq_adapter.exception_handlers(self),
                min(self.stale_after_seconds, LOST_DEQUEUE_MAX_SECONDS),
                self.stale_after_seconds,
                self.heartbeat_clock.abandoned_before(),
            )
        self.last_cleaned_at = rq_now()  # type: ignore[assignment]  # rq declares it None

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
        sent_at = time.time()
        if not self.in_flight:
            self.heartbeat()
        for owner in self.in_flight.owners():
            self.maintain_heartbeats(owner.job, owner.execution)
        held_for = self.heartbeat_clock.written(sent_at)
        if held_for is not None:
            self.log.warning(
                "Worker %s: no heartbeat could be written for %.0f s (Redis paused or unreachable); chunks that "
                "expired meanwhile are not taken for abandoned for %d s, so live workers heartbeat them first",
                self.name,
                held_for,
                self.stale_after_seconds,
            )

    def _touch_health_file(self) -> None:
        if self.health_file is not None:
            touch(self.health_file)

    def _publish_stats(self, state: str | None = None) -> None:
        busy = "busy" if self.in_flight else "idle"
        state = state or ("draining" if rq_adapter.is_stop_requested(self) else busy)
        publish_stats(
            self.connection,
            self.log,
            worker_name=self.name,
            model=self.model_name,
            mode=self.mode,
            queues=self.queue_names(),
            started_at=self._started_at,
            state=state,
            engine_stats=self.engine.stats(),
            model_kind=self.model_task.kind,
            num_in_flight_jobs=len(self.in_flight),
            num_in_flight_requests=self.in_flight.num_requests,
            num_jobs_finished=self.num_jobs_finished,
            num_requests_finished=self.num_requests_finished,
        )

    def subscribe(self) -> None:
        """rq's command channel (`rq` stop-job, shutdown). Polled every 0.2 s instead of rq's 60 s, because
        teardown joins this thread for up to 1 s and `cbq run` should not idle that long before exiting."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # rq declares it None
            sleep_time=0.2, daemon=True, exception_handler=rq_adapter.pubsub_exception_handler(self)
        )

    # --- signals -----------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        # Signal handlers can only be set from the main thread; a worker embedded in a thread (tests, notebooks)
        # is stopped by its owner through `request_stop` instead.
        if threading.current_thread() is threading.main_thread():
            rq_adapter.install_signal_handlers(self)

    def request_stop(self, signum: Any, frame: Any) -> None:
        """First SIGINT/SIGTERM: stop admitting and drain what is in flight. A second one: cold stop."""
        self.stop_signum = signum
        rq_adapter.request_warm_stop(self)
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self.log.info(
            "Worker %s: warm shutdown requested, draining %d jobs in flight", self.name, len(self.in_flight)
        )

    def request_force_stop(self, signum: Any, frame: Any) -> None:
        """Second SIGINT/SIGTERM: stop now, handing the chunks back (see `work`), and exit non-zero."""
        try:
            super().request_force_stop(signum, frame)
        except SystemExit:
            raise SystemExit(COLD_STOP_EXIT_CODE) from None
