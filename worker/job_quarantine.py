"""Jobs a worker cannot decode: moved to rq's FailedJobRegistry with the reason, so no worker dies on them.

Owns the replacement of an undecodable rq job (a pickled or non-JSON payload, a job hash whose `created_at`,
`timeout` or `status` does not parse) by a failed placeholder under the same id. rq itself cannot fail such a
job: every one of its failure paths first loads the job. The placeholder keeps the job's id, queue and the
start of its bad fields in the failure message, so `rq info`, `cbq status` (its requests count as failed, with
this message) and a person reading the FailedJobRegistry all see what happened.
"""

from __future__ import annotations

import logging
from typing import cast

import redis
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.job import Job
from rq.job_lifecycle import record_job_failure
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import as_text, current_timestamp
from rq.worker import BaseWorker

from producer import settings

log = logging.getLogger(__name__)

# The function the placeholder records; nothing runs it (it is failed from the start).
UNDECODABLE_FUNC = "worker.chunk_job.undecodable_job"
MAX_FIELD_CHARS = 60  # of each bad field, in the failure message


def decode_failure(conn: redis.Redis, job_id: str) -> str | None:
    """Why rq cannot load job `job_id` (None when it loads, or no longer exists)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        job.func_name  # noqa: B018 -- the payload is decoded lazily; decode it now
    except NoSuchJobError:
        return None
    except redis.RedisError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def quarantine_job(conn: redis.Redis, queue: Queue, job_id: str, reason: str) -> None:
    """Replace job `job_id` by a FAILED placeholder in `queue`'s FailedJobRegistry, and take it out of the
    queue, its intermediate list and the StartedJobRegistry: no worker will load it again."""
    raw = conn.hgetall(Job.key_for(job_id))
    fields = ", ".join(
        f"{k.decode(errors='replace')}={v[:MAX_FIELD_CHARS]!r}"
        for k, v in sorted(raw.items())
        if k in (b"created_at", b"timeout", b"status", b"data")
    )
    message = f"cbq: undecodable job data ({reason}); fields: {fields or 'none'}"
    log.error("job %s moved to the FailedJobRegistry: %s", job_id, message)
    started = queue.started_job_registry
    members = cast("list[bytes]", conn.zrange(started.key, 0, -1))
    entries = [e for e in members if as_text(e).startswith(f"{job_id}:")]
    placeholder = Job.create(
        UNDECODABLE_FUNC,
        id=job_id,
        connection=conn,
        serializer=JSONSerializer,
        origin=queue.name,
        description=f"undecodable job {job_id}",
        failure_ttl=settings.DEFAULT_RESULT_TTL_SECONDS,
    )
    placeholder.started_at = placeholder.ended_at = None
    with conn.pipeline(transaction=True) as pipe:
        pipe.delete(placeholder.key)
        placeholder.save(pipeline=pipe)
        pipe.lrem(queue.key, 0, job_id)
        pipe.lrem(queue.intermediate_queue_key, 0, job_id)
        if entries:
            pipe.zrem(started.key, *entries)
        record_job_failure(placeholder, message, pipe)
        pipe.execute()


def dequeue_decodable(
    worker: BaseWorker, queues: list[Queue], timeout: int | None
) -> tuple[Job, Queue] | None:
    """rq's `dequeue_any` over `queues` for `worker`; a job that cannot even be loaded is quarantined and the
    next one taken. Redis errors and rq's DequeueTimeout pass through."""
    while True:
        try:
            result = worker.queue_class.dequeue_any(
                queues,
                timeout,
                connection=worker.connection,
                job_class=worker.job_class,
                serializer=worker.serializer,
                death_penalty_class=worker.death_penalty_class,
            )
        except (redis.ConnectionError, redis.TimeoutError, DequeueTimeout):
            raise
        except Exception as exc:
            job_id, queue = getattr(exc, "job_id", None), getattr(exc, "queue", None)
            if job_id is None or queue is None:
                raise
            quarantine_job(worker.connection, queue, job_id, f"{type(exc).__name__}: {exc}")
            continue
        if result is not None:
            worker.reorder_queues(reference_queue=result[1])
        return result


def quarantine_undecodable(conn: redis.Redis, queue: Queue) -> int:
    """Quarantine the undecodable jobs rq's registry cleanup would load now (abandoned started jobs, jobs
    stuck in the intermediate list), so that cleanup cannot die on them. Returns how many."""
    expired = queue.started_job_registry.get_expired_job_ids(current_timestamp())
    stuck = [as_text(j) for j in conn.lrange(queue.intermediate_queue_key, 0, -1)]
    num_quarantined = 0
    for job_id in dict.fromkeys([*expired, *stuck]):
        reason = decode_failure(conn, job_id)
        if reason is not None:
            quarantine_job(conn, queue, job_id, reason)
            num_quarantined += 1
    return num_quarantined
