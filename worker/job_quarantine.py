"""Jobs a worker cannot or must not run: moved to rq's FailedJobRegistry with the reason, so no worker dies on
them and nothing in them is honoured.

Owns the replacement of such an rq job by a failed placeholder: an undecodable one (a pickled or non-JSON
payload, a job hash whose `created_at`, `timeout` or `status` does not parse, a hash without `data`, fields
too large: see `worker.rq_classes`), or one that carries what cbq's jobs never do (callbacks, webhooks,
dependencies, repeats). rq itself cannot fail such a job: every one of its failure paths first loads the job,
and then runs its callbacks and webhooks. The placeholder keeps the job's id, queue and the start of its bad
fields in the failure message, so `rq info`, `cbq status` (its requests count as failed, with this message)
and a person reading the FailedJobRegistry all see what happened. Placeholders expire with cbq's result TTL.

A queue entry whose id rq rejects (`bad/id`: rq ids are letters, digits, `_` and `-`) cannot have a
placeholder under its own id; its placeholder gets a derived valid id (`cbq-bad-id-<hash>`, the original in
the message), its hash (if any) is given the same expiry, and the id leaves the queue and rq's lists. So does
an entry that is not even UTF-8 (`\xff\xfe...`), taken out as the bytes it is.
"""

from __future__ import annotations

import hashlib
import logging
from typing import cast

import redis
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.job import JOB_ID_PATTERN, Job
from rq.job_lifecycle import record_job_failure
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import current_timestamp
from rq.worker import BaseWorker

from producer import settings
from worker.lost_dequeues import UndecodableEntry
from worker.rq_classes import CbqJob

log = logging.getLogger(__name__)

# The function the placeholder records; nothing runs it (it is failed from the start).
UNDECODABLE_FUNC = "worker.chunk_job.undecodable_job"
MAX_FIELD_CHARS = 60  # of each bad field, in the failure message
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
NOT_UTF8 = "the entry is not UTF-8 text, so no job id"


def decode_failure(conn: redis.Redis, job_id: str) -> str | None:
    """Why a worker will not run job `job_id` (None when it loads and carries nothing untrusted, or no longer
    exists)."""
    if not is_valid_job_id(job_id):
        return f"the job id {job_id[:80]!r} is not one rq accepts"
    try:
        job = CbqJob.fetch(job_id, connection=conn, serializer=JSONSerializer)
        job.func_name  # noqa: B018 -- the payload is decoded lazily; decode it now
    except NoSuchJobError:
        return None
    except redis.RedisError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return getattr(job, "untrusted_reason", None)


def refusal(job: Job) -> str | None:
    """Why a dequeued job must not run (None: it may). Decodes its payload: raises what decoding raises."""
    job.func_name  # noqa: B018 -- the payload is decoded lazily; decode it now
    if not is_valid_job_id(job.id):
        return f"the job id {job.id[:80]!r} is not one rq accepts"
    return getattr(job, "untrusted_reason", None)


def is_valid_job_id(job_id: str) -> bool:
    return JOB_ID_PATTERN.fullmatch(job_id) is not None


def quarantine_job(conn: redis.Redis, queue: Queue, job_id: str | bytes, reason: str) -> None:
    """Replace job `job_id` by a FAILED placeholder in `queue`'s FailedJobRegistry, and take it out of the
    queue, its intermediate list and the StartedJobRegistry: no worker will load it again. `job_id` is bytes
    for an entry that is not UTF-8 (removed as stored; shown with its bad bytes escaped)."""
    raw_id = job_id if isinstance(job_id, bytes) else job_id.encode()
    text_id = raw_id.decode(errors="backslashreplace")
    shown = repr(job_id[:80])  # bytes show as b'\xff...'
    job_key = Job.redis_job_namespace_prefix.encode() + raw_id
    raw = cast("dict[bytes, bytes]", conn.hgetall(job_key))
    fields = ", ".join(
        f"{k.decode(errors='replace')}={v[:MAX_FIELD_CHARS]!r}"
        for k, v in sorted(raw.items())
        if k in (b"created_at", b"timeout", b"status", b"data")
    )
    valid_id = isinstance(job_id, str) and is_valid_job_id(job_id)
    placeholder_id = text_id if valid_id else f"cbq-bad-id-{hashlib.sha256(raw_id).hexdigest()[:20]}"
    kind = "undecodable job data" if valid_id else f"a queue entry rq rejects, {shown}"
    message = f"cbq: {kind} ({reason}); fields: {fields or 'none'}"
    log.error("job %s moved to the FailedJobRegistry as %s: %s", text_id[:80], placeholder_id, message)
    started = queue.started_job_registry
    members = cast("list[bytes]", conn.zrange(started.key, 0, -1))
    entries = [e for e in members if e.startswith(raw_id + b":")]
    placeholder = Job.create(
        UNDECODABLE_FUNC,
        id=placeholder_id,
        connection=conn,
        serializer=JSONSerializer,
        origin=queue.name,
        description=f"quarantined job {shown}",
        failure_ttl=settings.DEFAULT_RESULT_TTL_SECONDS,
    )
    placeholder.started_at = placeholder.ended_at = None
    with conn.pipeline(transaction=True) as pipe:
        pipe.delete(placeholder.key)
        if not valid_id and raw:  # kept for a person to look at, but not forever
            pipe.expire(job_key, settings.DEFAULT_RESULT_TTL_SECONDS)
        placeholder.save(pipeline=pipe)
        pipe.lrem(queue.key, 0, raw_id)  # type: ignore[arg-type]  # redis-py takes bytes as well
        pipe.lrem(queue.intermediate_queue_key, 0, raw_id)  # type: ignore[arg-type]
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
        except (*REDIS_ERRORS, DequeueTimeout):
            raise
        except UndecodableEntry as exc:  # no job id at all: take the entry itself out
            taken_from = next(q for q in queues if q.key == exc.queue_key)
            quarantine_job(worker.connection, taken_from, exc.raw, NOT_UTF8)
            continue
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
    """Quarantine the jobs rq's registry cleanup would load now (abandoned started jobs, jobs stuck in the
    intermediate list) that it cannot load or must not honour, so that cleanup can neither die on them nor run
    their callbacks. Returns how many. A failure on one job is logged; the others are still looked at."""
    started = cast("list[bytes]", conn.zrangebyscore(queue.started_job_registry.key, 0, current_timestamp()))
    # entries are `job_id:execution_id`, split as rq does
    expired = [entry.split(b":", 1)[0] for entry in started]
    stuck = cast("list[bytes]", conn.lrange(queue.intermediate_queue_key, 0, -1))
    num_quarantined = 0
    for raw_id in dict.fromkeys([*expired, *stuck]):
        try:
            job_id = raw_id.decode()
        except UnicodeDecodeError:
            quarantine_job(conn, queue, raw_id, NOT_UTF8)
            num_quarantined += 1
            continue
        try:
            reason = decode_failure(conn, job_id)
            if reason is not None:
                quarantine_job(conn, queue, job_id, reason)
                num_quarantined += 1
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("could not quarantine job %r", job_id[:80])
    return num_quarantined
