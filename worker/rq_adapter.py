"""Every use of rq's private members by cbq's worker, in one place. Owns nothing.

rq's `BaseWorker` runs one job at a time and keeps some of its state in private attributes that cbq's worker
must read or set to run many jobs at once through rq's own hooks. Each such use is one function here, so an
rq upgrade that renames or changes one of them breaks this module and its test
(`tests/worker/test_rq_adapter.py`), not the worker's loop. rq is pinned to `>=3.0,<3.1` (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis import Redis
from rq.job import Job
from rq.queue import Queue
from rq.utils import now as rq_now
from rq.worker import BaseWorker, DequeueStrategy

# (attribute, what it is) for every private attribute read or written below; the test checks each exists.
PRIVATE_WORKER_ATTRIBUTES = (
    "_dequeue_strategy",  # the strategy `reorder_queues` applies after each dequeue
    "_ordered_queues",  # the queues in the order `dequeue_any` tries them
    "_exc_handlers",  # the exception handlers rq's registry cleanup calls for failed jobs
    "_stopped_job_id",  # set: `handle_job_failure` marks that job STOPPED instead of FAILED
    "_stop_requested",  # a warm shutdown was requested
    "_shutdown_requested_date",  # when; `request_force_stop` ignores a second signal within 1 s of it
)
PRIVATE_WORKER_METHODS = ("_install_signal_handlers", "_pubsub_exception_handler")
PRIVATE_JOB_ATTRIBUTES = ("_result",)  # what `handle_job_success` stores as the job's return value
PRIVATE_QUEUE_METHODS = ("_fetch_dequeued_job",)  # `dequeue_any`'s job lookup after the pop


def fetch_dequeued_job(
    queue_class: type[Queue],
    connection: Redis,
    queue_key: str,
    job_id: str,
    job_class: type[Job] | None,
    serializer: Any,
    death_penalty_class: Any,
) -> tuple[Job, Queue] | None:
    """What rq's `dequeue_any` does with an id it popped: the job and its queue; None when the job hash is gone.
    An error loading the job carries `job_id` and `queue` (`worker.job_quarantine` reads them)."""
    return queue_class._fetch_dequeued_job(
        connection,
        queue_key,
        job_id,
        job_class=job_class,
        serializer=serializer,
        death_penalty_class=death_penalty_class,
    )


def set_dequeue_strategy(worker: BaseWorker, strategy: DequeueStrategy) -> None:
    """rq's `work()` records its `dequeue_strategy` argument; cbq's replacement of `work()` does the same."""
    worker._dequeue_strategy = strategy


def ordered_queues(worker: BaseWorker) -> list[Queue]:
    """The queues in the order the next dequeue tries them (rotated by `reorder_queues`)."""
    return worker._ordered_queues


def exception_handlers(worker: BaseWorker) -> list[Callable[..., Any]]:
    """The handlers rq's `clean_registries` calls for the jobs it fails."""
    return worker._exc_handlers


def stopped_job_id(worker: BaseWorker) -> str | None:
    """The job rq's stop-job command asked to stop (set by rq before it calls `kill_horse`)."""
    return worker._stopped_job_id


def mark_job_stopped(worker: BaseWorker, job_id: str) -> None:
    """Make the next `handle_job_failure` of `job_id` mark it STOPPED (never retried) instead of FAILED."""
    worker._stopped_job_id = job_id


def set_return_value(job: Job, value: Any) -> None:
    """What `handle_job_success` stores as `job.return_value()` (rq sets it from the function's return)."""
    job._result = value


def is_stop_requested(worker: BaseWorker) -> bool:
    return worker._stop_requested


def request_warm_stop(worker: BaseWorker) -> None:
    """Record a warm shutdown as rq's `request_stop` does (its date lets `request_force_stop` ignore a
    duplicate signal), without rq's `StopRequested`, which would leave the in-flight chunks behind."""
    worker._shutdown_requested_date = rq_now()
    worker._stop_requested = True


def install_signal_handlers(worker: BaseWorker) -> None:
    """rq's SIGINT/SIGTERM handlers (they call `request_stop`, then `request_force_stop`)."""
    BaseWorker._install_signal_handlers(worker)


def pubsub_exception_handler(worker: BaseWorker) -> Callable[..., None]:
    """rq's handler for errors of the command-channel thread (it reconnects after Redis errors)."""
    return worker._pubsub_exception_handler
