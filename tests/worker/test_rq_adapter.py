"""rq's members that cbq's worker relies on are still there and still mean what `worker.rq_adapter` assumes.

An rq upgrade that renames a private attribute, changes a hook's parameters or changes what one of them does
fails here, by name, instead of somewhere inside the worker's loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import fakeredis
import pytest
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry, clean_registries
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker, DequeueStrategy

from worker import rq_adapter
from worker.queue_worker import CbqWorker


@pytest.fixture
def rq_worker() -> BaseWorker:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return BaseWorker([Queue("q", connection=conn, serializer=JSONSerializer)], connection=conn)


def test_the_private_members_exist(rq_worker):
    for name in rq_adapter.PRIVATE_WORKER_ATTRIBUTES:
        assert hasattr(rq_worker, name), f"rq's BaseWorker no longer has {name}"
    for name in rq_adapter.PRIVATE_WORKER_METHODS:
        assert callable(getattr(rq_worker, name, None)), f"rq's BaseWorker no longer has a method {name}"
    job = Job.create("f", connection=rq_worker.connection, serializer=JSONSerializer)
    for name in rq_adapter.PRIVATE_JOB_ATTRIBUTES:
        assert hasattr(job, name), f"rq's Job no longer has {name}"
    for name in rq_adapter.PRIVATE_QUEUE_METHODS:
        assert callable(getattr(Queue, name, None)), f"rq's Queue no longer has a method {name}"


def test_fetching_a_dequeued_job_gives_the_job_and_its_queue(rq_worker):
    [queue] = rq_worker.queues
    job = queue.enqueue_call("worker.chunk_job.run_chunk", kwargs={})
    fetched = rq_adapter.fetch_dequeued_job(
        Queue, rq_worker.connection, queue.key, job.id, Job, JSONSerializer, None
    )
    assert fetched is not None and fetched[0].id == job.id and fetched[1].name == queue.name
    assert rq_adapter.fetch_dequeued_job(Queue, rq_worker.connection, queue.key, "gone", Job, None, None) is None


def test_reading_and_setting_them(rq_worker):
    rq_adapter.set_dequeue_strategy(rq_worker, DequeueStrategy.ROUND_ROBIN)
    [queue] = rq_adapter.ordered_queues(rq_worker)
    rq_worker.reorder_queues(queue)  # rq reads the strategy back here
    assert rq_adapter.ordered_queues(rq_worker) == [queue]
    assert rq_adapter.exception_handlers(rq_worker) == []
    assert rq_adapter.stopped_job_id(rq_worker) is None and not rq_adapter.is_stop_requested(rq_worker)
    rq_adapter.request_warm_stop(rq_worker)
    assert rq_adapter.is_stop_requested(rq_worker)
    rq_worker.request_force_stop(2, None)  # within 1 s of the warm stop: rq ignores it (no SystemExit)


def _started_job(rq_worker: BaseWorker) -> tuple[Job, Queue, Execution]:
    [queue] = rq_worker.queues
    queue.enqueue_call("worker.chunk_job.run_chunk", kwargs={"batch_id": "b", "start": 0, "stop": 1})
    result = Queue.dequeue_any([queue], None, connection=rq_worker.connection, serializer=JSONSerializer)
    assert result is not None
    job, _ = result
    execution = rq_worker.prepare_execution(job)
    rq_worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return job, queue, execution


def test_a_job_marked_stopped_ends_stopped_not_failed(rq_worker):
    job, queue, execution = _started_job(rq_worker)
    rq_worker.handle_execution_ended(job, queue, job.failure_callback_timeout)
    rq_adapter.mark_job_stopped(rq_worker, job.id)
    assert rq_adapter.stopped_job_id(rq_worker) == job.id
    rq_worker.handle_job_failure(
        job=job, queue=queue, started_job_registry=queue.started_job_registry, exc_string="x", execution=execution
    )
    assert job.get_status(refresh=True) == JobStatus.STOPPED


def test_the_return_value_set_is_what_handle_job_success_stores(rq_worker):
    job, queue, execution = _started_job(rq_worker)
    rq_worker.handle_execution_ended(job, queue, job.success_callback_timeout)
    rq_adapter.set_return_value(job, {"num_completed": 3})
    rq_worker.handle_job_success(
        job=job, queue=queue, started_job_registry=queue.started_job_registry, execution=execution
    )
    job = Job.fetch(job.id, connection=rq_worker.connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED and job.return_value() == {"num_completed": 3}


def _parameters(func: Callable[..., Any]) -> list[str]:
    return [name for name in inspect.signature(func).parameters if name != "self"]


# rq's methods and functions the worker calls or overrides, with the parameters it passes or accepts.
RQ_SIGNATURES: list[tuple[Callable[..., Any], list[str]]] = [
    (BaseWorker.prepare_execution, ["job"]),
    (BaseWorker.prepare_job_execution, ["job", "remove_from_intermediate_queue"]),
    (BaseWorker.handle_job_success, ["job", "queue", "started_job_registry", "execution"]),
    (BaseWorker.handle_job_failure, ["job", "queue", "exc_string", "execution", "started_job_registry"]),
    (BaseWorker.handle_execution_ended, ["job", "queue", "heartbeat_ttl"]),
    (BaseWorker.maintain_heartbeats, ["job", "execution"]),
    (BaseWorker.get_heartbeat_ttl, ["job", "working_time"]),
    (BaseWorker.kill_horse, ["sig"]),
    (BaseWorker.request_stop_execution, ["execution_id"]),
    (BaseWorker.request_stop, ["signum", "frame"]),
    (BaseWorker.request_force_stop, ["signum", "frame"]),
    (BaseWorker.reorder_queues, ["reference_queue"]),
    (BaseWorker.clean_registries, []),
    (BaseWorker.subscribe, []),
    (BaseWorker.teardown, []),
    (clean_registries, ["queue", "exception_handlers"]),
    (StartedJobRegistry.cleanup, ["timestamp", "exception_handlers"]),  # worker.maintenance.clean_rq_registries
    (IntermediateQueue.cleanup, ["worker", "queue"]),
    (Execution.delete, ["job", "pipeline"]),
    # overridden by worker.rq_classes
    (Job.restore, ["raw_data"]),
    (Job.send_webhooks, ["status", "exc_string"]),
    (Job.dependents_key_for, ["job_id"]),
    (Queue.enqueue_dependents, ["job", "exclude_job_id", "refresh_job_status"]),
    (Queue.move_dependents_to_ready, ["job", "pipeline", "exclude_job_id", "refresh_job_status"]),
    (Queue._fetch_dequeued_job, ["connection", "queue_key", "job_id", "job_class", "serializer", "death_penalty_class"]),
]


@pytest.mark.parametrize(("func", "expected"), RQ_SIGNATURES, ids=lambda x: getattr(x, "__qualname__", ""))
def test_rq_signatures_are_the_ones_the_worker_uses(func, expected):
    parameters = _parameters(func)
    missing = [name for name in expected if name not in parameters]
    assert not missing, f"{func.__qualname__} lost parameters {missing}; it has {parameters}"


def test_dequeue_any_takes_what_the_worker_passes():
    parameters = _parameters(Queue.dequeue_any)
    for name in ("queues", "timeout", "connection", "job_class", "serializer", "death_penalty_class"):
        assert name in parameters, f"Queue.dequeue_any lost {name}: {parameters}"


def test_cbq_work_accepts_every_parameter_of_rqs_work():
    assert _parameters(CbqWorker.work) == _parameters(BaseWorker.work)


def test_rq_reads_dependents_and_webhooks_only_through_what_cbq_overrides(rq_worker):
    """rq's cleanup and handlers reach a job's dependents through `Job.dependents_key` (built from
    `dependents_key_for`) and its webhooks through `Job.send_webhooks`; if rq stops using them, cbq's overrides
    would no longer keep a forged job from steering the worker."""
    source = inspect.getsource(Queue.move_dependents_to_ready)
    assert "job.dependents_key" in source
    assert "dependents_key_for(self.id)" in inspect.getsource(Job.__dict__["dependents_key"].fget)
    assert "send_webhooks" in inspect.getsource(BaseWorker.handle_job_failure)


def test_the_registries_cbq_cleans_are_the_ones_rq_cleans():
    """`worker.maintenance.clean_rq_registries` is rq's `clean_registries` with the abandoned cutoff given."""
    import re

    from worker import maintenance

    def registries(func: Callable[..., Any]) -> list[str]:
        return re.findall(r"(\w+Registry)(?:\(|\.all)", inspect.getsource(func))  # the ones it calls

    assert registries(maintenance.clean_rq_registries) == registries(clean_registries)
