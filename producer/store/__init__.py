"""cbq's Redis store: every read and write of the `cbq:` keys (`schemas.keys`), shared by producer and worker.

- `submit`: validate lines, dedupe, stage requests, commit a batch and its chunk jobs in one transaction
- `writes`: the only writer of results, batch counters, the running table and worker stats
- `reads`: status, results in input order, listings of batches and workers
- `cancel`: the cancel flag, and cancelling the chunk jobs still queued
- `api_batches`: the OpenAI batch records of `cbq serve` (`cbq:api:` keys), with their project listings
- `chunks`: a worker's reads of one chunk job (its batch's fields, its requests and results so far)
- `marker`: the store marker (`cbq:store`), whose absence says Redis lost its data

Imports redis, rq and pydantic, never torch and never `worker`: the worker imports this package, not the reverse.
"""

from producer.store.api_batches import BatchRecord, BatchRecordNotFound, BatchRecords
from producer.store.cancel import CancelReport, cancel_batch
from producer.store.marker import MarkerWatch, wiped_line
from producer.store.reads import (
    BatchNotFinished,
    BatchNotFound,
    StoreWiped,
    cancelled_batch_ids,
    find_lost_requests,
    get_status,
    iter_results,
    list_batches,
    list_workers,
    read_meta,
)
from producer.store.submit import (
    SourceChanged,
    SubmitConflict,
    SubmitInterrupted,
    SubmitOptions,
    SubmitReport,
    ValidatedFile,
    ValidRequests,
    submit_batch,
    validate_lines,
)
from producer.store.writes import publish_worker_stats, queue_admission, queue_results

__all__ = [
    "BatchNotFinished",
    "BatchRecord",
    "BatchRecordNotFound",
    "BatchRecords",
    "BatchNotFound",
    "CancelReport",
    "MarkerWatch",
    "SourceChanged",
    "StoreWiped",
    "SubmitConflict",
    "SubmitInterrupted",
    "SubmitOptions",
    "SubmitReport",
    "ValidRequests",
    "ValidatedFile",
    "cancel_batch",
    "cancelled_batch_ids",
    "find_lost_requests",
    "get_status",
    "iter_results",
    "list_batches",
    "list_workers",
    "publish_worker_stats",
    "queue_admission",
    "queue_results",
    "read_meta",
    "submit_batch",
    "validate_lines",
    "wiped_line",
]
