"""The OpenAI batch object: how a batch record (`producer.store.api_batches`) and its cbq batch become one.
Owns the mapping only; nothing here reads or writes Redis.

Status, from the record's timestamps and the cbq batch (`openai_status`):

    validating -> in_progress -> finalizing -> completed
    validating -> failed                          (the input file is invalid: `errors` says where)
    in_progress -> cancelling -> cancelled        (POST /cancel; finished requests stay in the output)
    in_progress -> finalizing -> expired          (the completion window ran out; the rest was cancelled)
"""

from __future__ import annotations

from producer.store.api_batches import BatchRecord
from schemas.status import BatchStatus


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
