"""Every Redis key cbq uses, from one place. Owns the key layout; nothing else spells a `cbq:` key.

Layout of one batch (all keys expire together after the batch's result TTL):

    cbq:batch:{id}            hash   metadata + counters (see BatchField)
    cbq:batch:{id}:requests   hash   index -> normalized request JSON (written once by `cbq submit`)
    cbq:batch:{id}:results    hash   index -> result JSON (written once per request by the worker)
    cbq:batch:{id}:jobs       hash   rq job id -> "start:stop" (the request range the chunk job carries)
    cbq:batch:{id}:running    hash   rq job id -> requests of that chunk still inside an engine
    cbq:batch:{id}:cancel     string present once `cbq cancel` ran; workers poll it to abort

Global:

    cbq:batches               zset   batch id -> created_at (for `cbq stats`)
    cbq:name:{name}           hash   custom_id -> batch id, for dedupe across resubmissions of a --name
    cbq:workers               zset   worker name -> last stats publish time
    cbq:worker:{name}:stats   string WorkerStats JSON, expires when the worker stops publishing
    cbq:flush:{writer_id}     string the last results write a worker process applied (its sequence number);
                                     set in that write's transaction, so a write whose reply was lost is
                                     recognised instead of applied again (`worker.result_writer`)
    cbq:orphans:{queue}:seen  hash   chunk job id -> when the orphan sweep first saw it held by nothing
                                     (or finished with requests that have no result)
    cbq:orphans:{queue}:swept string held while one worker's sweep of that queue is recent (`worker.orphans`)
    cbq:store                 string the store marker: set with the first submit, never expires; a store
                                     without it lost its data (`producer.store.marker`)

OpenAI-compatible server (`cbq serve`; expire with the batch's result TTL):

    cbq:api:batch:{id}        hash   the OpenAI batch object's own fields (see producer.store.api_batches)
    cbq:api:batch:{id}:final  string lock held by the server process writing the batch's output files
    cbq:api:batches           zset   OpenAI batch id -> created_at, for an admin key's `GET /v1/batches`
    cbq:api:project:{p}:batches zset the same for one project's batches (what its keys list)

The rq side keeps rq's own `rq:` keys (queues, jobs, registries); cbq never writes them directly.
"""

from __future__ import annotations

import re
import uuid
from enum import Enum

PREFIX = "cbq:"


class BatchField(str, Enum):
    """Fields of the `cbq:batch:{id}` hash. Counters are HINCRBY'd by the worker, one pipeline per write."""

    NAME = "name"
    QUEUE = "queue"
    CREATED_AT = "created_at"  # epoch seconds, set by submit
    NUM_REQUESTS = "num_requests"
    NUM_CHUNKS = "num_chunks"
    TTL_SECONDS = "ttl_seconds"
    MODEL = "model"  # the served model name of the last worker that wrote a result
    ROUTED_MODEL = "routed_model"  # the model the batch's lines name: its queue is that model's (`model_queue`)
    FIRST_STARTED_AT = "first_started_at"  # epoch seconds, HSETNX by the first admitting worker
    LAST_FINISHED_AT = "last_finished_at"
    CANCELLED_AT = "cancelled_at"
    NUM_COMPLETED = "num_completed"  # finish_reason stop|length
    NUM_FAILED = "num_failed"  # finish_reason error
    NUM_CANCELLED = "num_cancelled"
    PROMPT_TOKENS = "prompt_tokens"
    COMPLETION_TOKENS = "completion_tokens"
    GPU_SECONDS = "gpu_seconds"

    @classmethod
    def counter_of(cls, outcome: str) -> BatchField:
        """The counter of one `schemas.result.Outcome`: NUM_COMPLETED, NUM_FAILED or NUM_CANCELLED."""
        return cls(f"num_{outcome}")


def model_queue(queue: str, model: str | None) -> str:
    """The rq queue of a batch whose lines name `model`: workers serving that name listen on it (and on `queue`,
    for batches that name no model)."""
    return f"{queue}:{model}" if model else queue


BATCH_ID_HEX_DIGITS = 16


def new_batch_id() -> str:
    return uuid.uuid4().hex[:BATCH_ID_HEX_DIGITS]


def is_batch_id(text: str) -> bool:
    """Whether `text` has the form `new_batch_id` gives (a store that lost its data is named only for these)."""
    return re.fullmatch(f"[0-9a-f]{{{BATCH_ID_HEX_DIGITS}}}", text) is not None


def batch(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def batch_requests(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:requests"


def batch_results(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:results"


def batch_jobs(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:jobs"


def batch_running(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:running"


def batch_cancel(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:cancel"


def all_batch_keys(batch_id: str) -> list[str]:
    """Every key of one batch, so TTLs are refreshed (and deletes done) for all of them together."""
    return [
        batch(batch_id),
        batch_requests(batch_id),
        batch_results(batch_id),
        batch_jobs(batch_id),
        batch_running(batch_id),
        batch_cancel(batch_id),
    ]


BATCHES = f"{PREFIX}batches"
STORE_MARKER = f"{PREFIX}store"
WORKERS = f"{PREFIX}workers"


def name_index(name: str) -> str:
    return f"{PREFIX}name:{name}"


def worker_stats(worker_name: str) -> str:
    return f"{PREFIX}worker:{worker_name}:stats"


def flush_marker(writer_id: str) -> str:
    return f"{PREFIX}flush:{writer_id}"


def orphans_seen(queue: str) -> str:
    return f"{PREFIX}orphans:{queue}:seen"


def orphan_sweep(queue: str) -> str:
    return f"{PREFIX}orphans:{queue}:swept"


API_BATCHES = f"{PREFIX}api:batches"


def api_batch(api_batch_id: str) -> str:
    return f"{PREFIX}api:batch:{api_batch_id}"


def api_project_batches(project: str) -> str:
    return f"{PREFIX}api:project:{project}:batches"


def api_batch_finalize_lock(api_batch_id: str) -> str:
    return f"{PREFIX}api:batch:{api_batch_id}:final"


def chunk_job_id(batch_id: str, chunk_index: int) -> str:
    """rq job id of one chunk (rq allows letters, digits, '_' and '-')."""
    return f"cbq-{batch_id}-{chunk_index:06d}"


def batch_of_chunk_job(job_id: str) -> str | None:
    """The batch id inside a `chunk_job_id`; None for an id not of that form."""
    prefix, _, rest = job_id.partition("-")
    batch_id, _, chunk_index = rest.rpartition("-")
    if prefix != "cbq" or not batch_id or not chunk_index.isdigit():
        return None
    return batch_id


def engine_request_id(batch_id: str, index: int) -> str:
    """Request id handed to the engine; `split_engine_request_id` inverts it."""
    return f"{batch_id}:{index}"


def split_engine_request_id(request_id: str) -> tuple[str, int]:
    batch_id, _, index = request_id.rpartition(":")
    return batch_id, int(index)
