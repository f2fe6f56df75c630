"""Jobs a worker cannot decode: moved to rq's FailedJobRegistry with the reason, so no worker dies on them.

Owns the replacement of an undecodable rq job (a pickled or non-JSON payload, a job hash whose `created_at`,
`timeout` or `status` does not parse) by a failed placeholder under the same id. rq itself cannot fail such a
job: every one of its failure paths first loads the job. The placeholder keeps the job's id, queue and the
start of its bad fields in the failure message, so `rq info`, `cbq status` (its requests count as failed, with
this message) and a person reading the FailedJobRegistry all see what happened.
"""

from __future__ import annotations

import logging

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job_lifecycle import record_job_failure
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import current_timestamp

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
    entries = [
        e for e in conn.zrange(started.key, 0, -1) if e.decode(errors="replace").startswith(f"{job_id}:")
    ]
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


def quarantine_undecodable(conn: redis.Redis, queue: Queue) -> int:
    """Quarantine the undecodable jobs rq's registry cleanup would load now (abandoned started jobs, jobs
    stuck in the intermediate list), so that cleanup cannot die on them. Returns how many."""
    expired = queue.started_job_registry.get_expired_job_ids(current_timestamp())
    stuck = [j.decode() for j in conn.lrange(queue.intermediate_queue_key, 0, -1)]
    num_quarantined = 0
    for job_id in dict.fromkeys([*expired, *stuck]):
        reason = decode_failure(conn, job_id)
        if reason is not None:
            quarantine_job(conn, queue, job_id, reason)
            num_quarantined += 1
    return num_quarantined
