"""The OpenAI batch records of `cbq serve`. Owns `cbq:api:batch:{id}`, its finalize lock, and the listings
`cbq:api:batches` (every record) and `cbq:api:project:{project}:batches` (one project's records), all named by
`schemas.keys`.

A record holds what OpenAI's batch object has and cbq's batch lacks (input file, endpoint, window, metadata, the
lifecycle timestamps, output files, validation errors) and the project that owns it. Counts and tokens are never
copied: the server reads them from the cbq batch each time. Each record expires `ttl_seconds` after its last
write; the listings are sorted sets that lose an id when a listing finds its record gone (`forget`).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

import redis

from schemas import keys

MAX_REPORTED_ERRORS = 1000  # validation errors kept on a failed batch (the file may have millions of lines)
FINALIZE_LOCK_SECONDS = 600  # a server process that died while finalizing releases the batch after this
# What `create` makes; any other id (one with a `:`, which would name another key such as the finalize lock) is not
# found before it reaches Redis.
API_BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{24}$")


class BatchRecordNotFound(LookupError):
    def __init__(self, api_batch_id: str):
        super().__init__(f"No batch found with id '{api_batch_id}'.")


@dataclass
class BatchRecord:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    # The owning project (`producer.server.auth`); None on records written before projects existed, which only
    # an admin key sees.
    project: str | None = None
    metadata: dict[str, str] | None = None
    output_expires_seconds: int | None = None  # OpenAI's output_expires_after.seconds
    cbq_batch_id: str | None = None  # set once the input validated and was submitted
    errors: list[dict] = field(default_factory=list)  # {code, message, param, line}
    in_progress_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    expire_requested_at: int | None = None  # the window ran out: cancelled like a cancel, shown as expired
    finalizing_at: int | None = None
    completed_at: int | None = None
    cancelled_at: int | None = None
    expired_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    @property
    def is_terminal(self) -> bool:
        return any((self.failed_at, self.completed_at, self.cancelled_at, self.expired_at))


_JSON_FIELDS = {"metadata", "errors"}
_INT_FIELDS = {f.name for f in fields(BatchRecord) if f.type in ("int", "int | None")}


class BatchRecords:
    """Read and write batch records in Redis; each record expires `ttl_seconds` after its last write."""

    def __init__(self, conn: redis.Redis, ttl_seconds: int):
        self.conn = conn
        self.ttl_seconds = ttl_seconds

    def create(
        self,
        project: str,
        input_file_id: str,
        endpoint: str,
        completion_window_seconds: int,
        completion_window: str,
        metadata: dict[str, str] | None,
        output_expires_seconds: int | None,
    ) -> BatchRecord:
        now = int(time.time())
        record = BatchRecord(
            id=f"batch_{secrets.token_hex(12)}",
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            created_at=now,
            expires_at=now + completion_window_seconds,
            project=project,
            metadata=metadata,
            output_expires_seconds=output_expires_seconds,
        )
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.api_batch(record.id), mapping=_encode(asdict(record)))
            pipe.expire(keys.api_batch(record.id), self.ttl_seconds)
            pipe.zadd(keys.API_BATCHES, {record.id: now})
            pipe.zadd(keys.api_project_batches(project), {record.id: now})
            pipe.execute()
        return record

    def get(self, api_batch_id: str) -> BatchRecord:
        if not API_BATCH_ID_RE.fullmatch(api_batch_id):
            raise BatchRecordNotFound(api_batch_id)
        raw = self.conn.hgetall(keys.api_batch(api_batch_id))
        if not raw:
            raise BatchRecordNotFound(api_batch_id)
        return BatchRecord(**_decode({k.decode(): v.decode() for k, v in raw.items()}))

    def update(self, api_batch_id: str, only_if_unset: bool = False, **changes) -> None:
        """Set fields; with only_if_unset, each field only if it has no value yet (HSETNX)."""
        encoded = _encode(changes)
        with self.conn.pipeline(transaction=True) as pipe:
            for name, value in encoded.items():
                (pipe.hsetnx if only_if_unset else pipe.hset)(keys.api_batch(api_batch_id), name, value)
            pipe.expire(keys.api_batch(api_batch_id), self.ttl_seconds)
            pipe.execute()

    def list_ids(self, project: str | None, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Up to `limit` batch ids of `project` (None: of every project), newest first, after the batch `after`;
        and whether more follow."""
        listing = keys.API_BATCHES if project is None else keys.api_project_batches(project)
        start = 0
        if after is not None:
            rank = self.conn.zrevrank(listing, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [raw.decode() for raw in self.conn.zrevrange(listing, start, start + limit)]
        return ids[:limit], len(ids) > limit

    def forget(self, api_batch_id: str, project: str | None) -> None:
        """Drop an expired record from the listings (its project's too, when known)."""
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.zrem(keys.API_BATCHES, api_batch_id)
            if project is not None:
                pipe.zrem(keys.api_project_batches(project), api_batch_id)
            pipe.execute()

    def take_finalize_lock(self, api_batch_id: str) -> bool:
        """True for the one server process (across processes) that is to write the batch's output files."""
        lock = keys.api_batch_finalize_lock(api_batch_id)
        return bool(self.conn.set(lock, "1", nx=True, ex=FINALIZE_LOCK_SECONDS))


def _encode(values: dict) -> dict[str, str]:
    out = {}
    for name, value in values.items():
        if value is None or (name == "errors" and not value):
            continue
        out[name] = json.dumps(value) if name in _JSON_FIELDS else str(value)
    return out


def _decode(raw: dict[str, str]) -> dict:
    known = {f.name for f in fields(BatchRecord)}
    out: dict = {}
    for name, value in raw.items():
        if name not in known:
            continue
        if name in _JSON_FIELDS:
            out[name] = json.loads(value)
        elif name in _INT_FIELDS:
            out[name] = int(value)
        else:
            out[name] = value
    return out
