"""cbq's rq `Job` and `Queue` classes: a job's hash is read as untrusted data. Owns what a worker accepts from one.

Anyone who can write to Redis can put anything in a job hash, and rq honours more than cbq's chunk jobs ever
carry: success/failure/stopped callbacks (any importable function, run by the worker), webhooks (HTTP posts to
any URL, sent from the worker's loop), dependencies and dependents (other jobs enqueued when this one ends) and
repeats (the job enqueued again). cbq's jobs carry none of these (`producer.store.submit`), so:

- `CbqJob` loads a job with bounded sizes (each field, and `data` once decompressed) and raises
  `UntrustedJobData` for a hash without `data` (rq would skip it silently and leave it forever); it strips
  everything above after loading and names what it stripped in `untrusted_reason`, so nothing in a job can make
  the worker run code or open a connection, whatever path (the worker's, rq's cleanup's) loads it.
- `CbqQueue` never enqueues dependents: a forged `dependents` set steers nothing.

`CbqQueue` also dequeues by moving each job into its queue's intermediate list, over any number of queues
(`worker.lost_dequeues.take_next`), where rq pops plain LPOPs over several: no job is ever held by a worker's
memory alone.

A job with an `untrusted_reason` is quarantined by the worker (`worker.job_quarantine`), never run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

from redis import Redis
from rq.job import Job, JobStatus
from rq.queue import Queue

from worker import rq_adapter
from worker.lost_dequeues import take_next

MAX_FIELD_BYTES = 64 * 1024  # of each field of a job hash; a cbq chunk job's largest is about 200 bytes
MAX_DATA_BYTES = 1024 * 1024  # of its `data` once decompressed (a zlib bomb stops here)


class UntrustedJobData(ValueError):
    """A job hash that cbq does not load (too large, no `data`)."""


class CbqJob(Job):
    untrusted_reason: str | None = None  # what the job carried that cbq does not honour (stripped on load)

    def restore(self, raw_data: Any) -> Any:
        fields = {
            (k.decode(errors="replace") if isinstance(k, bytes) else str(k)): v for k, v in raw_data.items()
        }
        big = sorted(name for name, value in fields.items() if len(value) > MAX_FIELD_BYTES)
        if big:
            raise UntrustedJobData(f"job fields larger than {MAX_FIELD_BYTES} bytes: {', '.join(big)[:200]}")
        if "data" not in fields:
            raise UntrustedJobData(
                f"the job hash has no data field (fields: {', '.join(sorted(fields))[:200]})"
            )
        _check_decompressed_size(fields["data"])
        result = super().restore(raw_data)
        self.untrusted_reason = self._strip_untrusted()
        return result

    def _strip_untrusted(self) -> str | None:
        found = []
        for kind in ("success", "failure", "stopped"):
            name = getattr(self, f"_{kind}_callback_name", None)
            if name:
                found.append(f"a {kind} callback {name[:80]!r}")
                setattr(self, f"_{kind}_callback_name", None)
        if self.webhooks:
            found.append(f"webhooks to {', '.join(w.url for w in self.webhooks)[:200]}")
            self.webhooks = []
        if self._dependency_ids:
            found.append(f"dependencies on {', '.join(self._dependency_ids)[:200]}")
            self._dependency_ids = []
        if self.repeats_left:
            found.append(f"{self.repeats_left} repeats")
            self.repeats_left = None
        if not found:
            return None
        return "carries " + "; ".join(found) + " (cbq's chunk jobs never do; not honoured)"

    def send_webhooks(self, status: str | JobStatus, *, exc_string: str | None = None) -> None:
        """Never: a job's webhooks are data from Redis, and the worker opens no connection for them."""

    @classmethod
    def dependents_key_for(cls, job_id: str) -> str:
        """A key nothing writes: rq's registry cleanup enqueues a failed job's dependents through a plain
        `Queue` (not `CbqQueue`), reading them from here, so a forged dependents set is never read."""
        return f"{cls.redis_job_namespace_prefix}{job_id}:dependents-not-read-by-cbq"


class CbqQueue(Queue):
    job_class = CbqJob

    @classmethod
    def dequeue_any(
        cls,
        queues: Iterable[Queue],
        timeout: int | None,
        connection: Redis,
        job_class: type[Job] | None = None,
        serializer: Any = None,
        death_penalty_class: Any = None,
    ) -> tuple[Job, Queue] | None:
        """rq's `dequeue_any`, except that the job is always moved into its queue's intermediate list (rq moves
        it only for a single queue): a worker killed, or a reply lost, right after the pop leaves the job where
        maintenance finds it (`worker.lost_dequeues`), not in no list at all."""
        queue_keys = [queue.key for queue in queues]
        while True:
            taken = take_next(connection, queue_keys, timeout)
            if taken is None:
                return None
            fetched = rq_adapter.fetch_dequeued_job(
                cls, connection, *taken, job_class or cls.job_class, serializer, death_penalty_class
            )
            if fetched is not None:  # else the job hash is gone; rq's intermediate cleanup drops the id
                return fetched

    def enqueue_dependents(
        self, job: Job, exclude_job_id: str | None = None, refresh_job_status: bool = True
    ) -> dict[str, list[str]]:
        """Never: cbq's jobs have no dependents, so a dependents set in Redis is someone's forgery."""
        return {}

    def move_dependents_to_ready(
        self,
        job: Job,
        pipeline: Any = None,
        exclude_job_id: str | None = None,
        refresh_job_status: bool = True,
    ) -> dict[str, list[str]]:
        """Never (see `enqueue_dependents`); rq's success handler starts its own transaction after this."""
        return {}


def _check_decompressed_size(data: bytes) -> None:
    decompressor = zlib.decompressobj()
    try:
        decompressor.decompress(data, MAX_DATA_BYTES)
    except zlib.error:
        return  # not compressed: rq takes it as it is, and it is within MAX_FIELD_BYTES
    if decompressor.unconsumed_tail:
        raise UntrustedJobData(f"the job's data decompresses to more than {MAX_DATA_BYTES} bytes")
