"""OpenAI batch records: what the server adds to a cbq batch, and how the two become an OpenAI batch object.

Owns `cbq:api:batch:{id}` and `cbq:api:batches` (`schemas.keys`). A record holds the fields OpenAI's batch object
has and cbq's batch lacks (input file, endpoint, window, metadata, the lifecycle timestamps, output files, the
validation errors). Counts and tokens are never copied: they are read from the cbq batch each time.

Status, from the record's timestamps and the cbq batch (`openai_status`):

    validating -> in_progress -> finalizing -> completed
    validating -> failed                          (the input file is invalid: `errors` says where)
    in_progress -> cancelling -> cancelled        (POST /cancel; finished requests stay in the output)
    in_progress -> finalizing -> expired          (the completion window ran out; the rest was cancelled)
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

import redis

from schemas import keys
from schemas.status import BatchStatus

MAX_REPORTED_ERRORS = 1000  # validation errors kept on a failed batch (the file may have millions of lines)


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
            metadata=metadata,
            output_expires_seconds=output_expires_seconds,
        )
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.api_batch(record.id), mapping=_encode(asdict(record)))
            pipe.expire(keys.api_batch(record.id), self.ttl_seconds)
            pipe.zadd(keys.API_BATCHES, {record.id: now})
            pipe.execute()
        return record

    def get(self, api_batch_id: str) -> BatchRecord:
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

    def list_ids(self, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Up to `limit` batch ids, newest first, after the batch `after`; and whether more follow."""
        start = 0
        if after is not None:
            rank = self.conn.zrevrank(keys.API_BATCHES, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [raw.decode() for raw in self.conn.zrevrange(keys.API_BATCHES, start, start + limit)]
        return ids[:limit], len(ids) > limit

    def forget(self, api_batch_id: str) -> None:
        """Drop an expired record from the listing."""
        self.conn.zrem(keys.API_BATCHES, api_batch_id)


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


# --- the OpenAI batch object ---------------------------------------------------------------------------------


def openai_status(record: BatchRecord, status: BatchStatus | None) -> str:
    """The OpenAI status of a batch, from its record and (once submitted) its cbq status."""
    if record.failed_at:
        return "failed"
    if record.completed_at:
        return "completed"
    if record.cancelled_at:
        return "cancelled"
    if record.expired_at:
        return "expired"
    if record.cancelling_at:
        return "cancelling"
    if status is None:
        return "validating"
    return "finalizing" if status.is_done else "in_progress"


def batch_object(record: BatchRecord, status: BatchStatus | None) -> dict:
    """The batch object OpenAI's API returns, with cbq's counts and tokens."""
    st = status
    usage = None
    if st is not None:
        usage = {
            "input_tokens": st.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": st.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": st.prompt_tokens + st.completion_tokens,
        }
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": openai_status(record, st),
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": st.num_total if st else 0,
            "completed": st.num_completed if st else 0,
            "failed": st.num_failed if st else 0,
        },
        "usage": usage,
        "metadata": record.metadata,
    }
