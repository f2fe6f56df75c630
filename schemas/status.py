"""Batch status and worker stats: what `cbq status`, `cbq wait` and `cbq stats` show (and print with --json).

Owns the shapes only; `producer.store.reads` computes BatchStatus from Redis, the worker publishes WorkerStats.
All `*_at` fields are Unix epoch seconds.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BatchStatus(_Model):
    batch_id: str
    name: str | None = None
    queue: str
    model: str | None = None  # the model the batch's lines name (its queue is that model's)
    # Live workers serving `model`, while the batch is unfinished (None: it names no model, or it is done).
    num_model_workers: int | None = None
    created_at: float
    first_started_at: float | None = None
    last_finished_at: float | None = None
    cancelled_at: float | None = None
    num_total: int = Field(ge=0)
    num_queued: int = Field(ge=0)
    num_running: int = Field(ge=0)
    # Part of num_queued: requests of chunks whose worker stopped heartbeating. rq's cleanup re-enqueues them;
    # until then there is no ETA.
    num_stalled: int = Field(default=0, ge=0)
    num_completed: int = Field(ge=0)
    num_failed: int = Field(ge=0)  # includes requests of chunk jobs that rq failed for good
    num_cancelled: int = Field(ge=0)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    requests_per_second: float = 0.0  # finished requests / seconds since the first was admitted
    completion_tokens_per_second: float = 0.0
    eta_seconds: float | None = None  # None until a rate is known, 0 when done
    # What the stored counters or fields got wrong (shown clamped above); empty when everything agrees.
    inconsistencies: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _counts_add_up(self):
        parts = self.num_queued + self.num_running + self.num_finished
        if parts != self.num_total:
            raise ValueError(f"counts add up to {parts}, not num_total={self.num_total}")
        return self

    @property
    def num_finished(self) -> int:
        return self.num_completed + self.num_failed + self.num_cancelled

    @property
    def is_done(self) -> bool:
        return self.num_finished == self.num_total

    @property
    def state(self) -> str:
        if self.is_done:
            return "cancelled" if self.cancelled_at else "done"
        if self.cancelled_at:
            return "cancelling"
        return "running" if self.first_started_at else "queued"


class WorkerStats(_Model):
    worker_name: str
    hostname: str
    pid: int
    model: str
    model_kind: str = "generate"  # "generate" or "embed" (an embedding model: prompt tokens only)
    mode: str | None = None
    queues: list[str]
    started_at: float
    updated_at: float
    state: str  # idle | busy | draining
    num_in_flight_jobs: int = 0
    num_in_flight_requests: int = 0
    num_jobs_finished: int = 0
    num_requests_finished: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_per_second: float = 0.0
    prompt_tokens_per_second: float = 0.0  # what an embedding model's throughput is counted in
    busy_fraction: float = 0.0  # device busy time / wall time of the engine loop
    cpu_prep_ms_per_step: float = 0.0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens looked up
