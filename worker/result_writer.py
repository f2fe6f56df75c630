"""The exactly-once result writer: settled requests waiting to be written, and the write itself.

Owns the outcomes not yet in Redis (results, and the running-table and counter changes that go with them),
the write whose reply was lost (in doubt until Redis says whether it happened), and the check, before every
write, that this worker still owns the chunks it writes for. Chunks found taken over are dropped from the
in-flight table (`worker.inflight`); chunks with nothing left in flight are handed to `finish_job` (the
worker's rq handlers) once their last results are written.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from rq.job import JobStatus

from producer.store import queue_results
from schemas import keys
from schemas.request import Request
from schemas.result import OUTCOME_OF_REASON, ResultLine
from worker.admission import to_result_line
from worker.engine.api import EngineResult, FinishReason, TokenizerProtocol
from worker.inflight import InFlightJob, InFlightTable

FLUSH_ATTEMPTS = 5  # WATCH retries of one flush


@dataclass
class Outcome:
    owner: InFlightJob
    result: ResultLine | None  # None: nothing to record (a request aborted by a timeout gets retried)
    from_engine: bool  # the request was counted as running


class ResultWriter:
    """Writes outcomes of the chunks in `table` to Redis; `finish_job(owner)` ends a chunk through rq and
    `forget_execution(owner)` is told when a chunk was taken over by someone else."""

    def __init__(
        self,
        connection: redis.Redis,
        table: InFlightTable,
        *,
        model_name: str,
        finish_job: Callable[[InFlightJob], None],
        forget_execution: Callable[[InFlightJob], None],
        log: logging.Logger,
        worker_name: str,
    ):
        self.connection = connection
        self.table = table
        self.model_name = model_name
        self._finish_job = finish_job
        self._forget_execution = forget_execution
        self.log = log
        self.worker_name = worker_name
        self.outcomes: list[Outcome] = []  # settled requests not yet written to Redis
        self._num_in_doubt = 0  # the first n outcomes went out in a write whose reply was lost
        self.num_requests_finished = 0

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def collect(self, results: Iterable[EngineResult], tokenizer: TokenizerProtocol) -> None:
        """Take the engine's finished requests as outcomes of their chunks."""
        for result in results:
            settled = self.table.settle(result.request_id)
            if settled is None:
                if not self.table.is_dropped(result.request_id):
                    self.log.warning(
                        "Worker %s: result for unknown request %s ignored",
                        self.worker_name,
                        result.request_id,
                    )
                continue
            owner, request = settled
            self.add(Outcome(owner, record_for(owner, request, result, tokenizer), from_engine=True))

    def release(self, owner: InFlightJob) -> None:
        """`owner` leaves this worker unfinished (handed back to rq): its entry in the running table goes."""
        with self.connection.pipeline(transaction=True) as pipe:
            queue_results(
                pipe, owner.payload.batch_id, owner.ttl_seconds, [], finished_job_ids=[owner.job.id]
            )
            pipe.execute()

    def held_indices(self, owner: InFlightJob) -> set[int]:
        """Request indices of `owner` settled here and not written yet."""
        return {o.result.index for o in self.outcomes if o.owner is owner and o.result is not None}

    def flush(self) -> None:
        """Write settled requests (one MULTI for all of them), then finish chunks with nothing left in flight."""
        for _ in range(FLUSH_ATTEMPTS):
            try:
                self._try_flush()
                return
            except redis.WatchError:  # someone touched one of these chunk jobs meanwhile: look again
                continue
        self.log.warning(
            "Worker %s: results not written after %d attempts; next turn", self.worker_name, FLUSH_ATTEMPTS
        )

    def flush_before_exit(self, collect: Callable[[], None]) -> None:
        """`collect()` the last results and `flush`, as the worker goes down (its engine may be dead): a failure
        is logged, and what was not written is redone by a retry."""
        try:
            collect()
            self.flush()
        except Exception:
            self.log.warning(
                "Worker %s: could not write %d finished results", self.worker_name, len(self.outcomes)
            )

    def _try_flush(self) -> None:
        if self._num_in_doubt:
            self._drop_outcomes_already_written()
        # A chunk is done once nothing of it is in the engine (all its outcomes are in this flush).
        done_jobs = self.table.done()
        if not self.outcomes and not done_jobs:
            return
        involved = {o.owner.job.id: o.owner for o in self.outcomes} | {o.job.id: o for o in done_jobs}
        with self.connection.pipeline(transaction=True) as pipe:
            # WATCH the chunk jobs: whoever re-enqueues one of them changes its hash, and this write aborts.
            pipe.watch(*[owner.job.key for owner in involved.values()])
            for owner in self._taken_over(list(involved.values())):
                self._disown(owner)
            done_jobs = [owner for owner in done_jobs if owner.job.id in self.table]
            outcomes = list(self.outcomes)
            by_batch: dict[str, list[Outcome]] = defaultdict(list)
            for outcome in outcomes:
                by_batch[outcome.owner.payload.batch_id].append(outcome)
            for owner in done_jobs:
                by_batch.setdefault(owner.payload.batch_id, [])
            pipe.multi()
            for batch_id, group in by_batch.items():
                done_here = [owner for owner in done_jobs if owner.payload.batch_id == batch_id]
                queue_results(
                    pipe,
                    batch_id,
                    (group[0].owner if group else done_here[0]).ttl_seconds,
                    [o.result for o in group if o.result is not None],
                    running_job_ids=[o.owner.job.id for o in group if o.from_engine],
                    finished_job_ids=[owner.job.id for owner in done_here],
                    model=self.model_name,
                )
            # If the reply to EXEC is lost (Redis died), the write may or may not have happened: the next
            # attempt first looks whether it did (`_drop_outcomes_already_written`).
            self._num_in_doubt = len(outcomes)
            try:
                pipe.execute()
            except redis.WatchError:
                self._num_in_doubt = 0
                raise
        self._num_in_doubt = 0
        del self.outcomes[: len(outcomes)]
        self._count_written(outcomes)
        for owner in done_jobs:
            self._finish_job(owner)

    def _count_written(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.result is not None:
                outcome.owner.counts[f"num_{OUTCOME_OF_REASON[outcome.result.finish_reason]}"] += 1
                self.num_requests_finished += 1

    def _drop_outcomes_already_written(self) -> None:
        """The first `_num_in_doubt` outcomes went out in one MULTI whose reply never came. MULTI is all or
        nothing, so one of their results tells whether it happened; if it did, they are not written again."""
        in_doubt = self.outcomes[: self._num_in_doubt]
        probe = next((o for o in in_doubt if o.result is not None), None)
        applied = probe is None or bool(
            self.connection.hexists(
                keys.batch_results(probe.owner.payload.batch_id),
                str(probe.result.index),  # type: ignore[union-attr]
            )
        )
        if applied:
            self.log.warning(
                "Worker %s: the write before the outage went through; not repeating it", self.worker_name
            )
            del self.outcomes[: self._num_in_doubt]
            self._count_written(in_doubt)
        self._num_in_doubt = 0

    def _taken_over(self, owners: list[InFlightJob]) -> list[InFlightJob]:
        """The chunks among `owners` that this worker no longer owns: their job left the STARTED state or their
        execution left the StartedJobRegistry (rq's cleanup took them for abandoned, or someone requeued them)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for owner in owners:
                pipe.hget(owner.job.key, "status")
                pipe.zscore(owner.queue.started_job_registry.key, owner.execution.composite_key)
            replies = pipe.execute()
        started = JobStatus.STARTED.value.encode()
        return [
            owner
            for owner, status, score in zip(owners, replies[0::2], replies[1::2], strict=True)
            if status != started or score is None
        ]

    def _disown(self, owner: InFlightJob) -> None:
        """Forget a chunk someone else owns now: abort what it has in the engine and drop what it has not
        written. Its new owner runs those requests (and skips the ones already written)."""
        self.log.warning(
            "Worker %s: job %s was re-enqueued while it ran here; dropping its %d unwritten requests",
            self.worker_name,
            owner.job.id,
            len(owner.pending) + sum(1 for o in self.outcomes if o.owner is owner),
        )
        self.table.drop(owner)
        self._forget_execution(owner)
        self.outcomes = [o for o in self.outcomes if o.owner is not owner]


def record_for(
    owner: InFlightJob, request: Request, result: EngineResult, tokenizer: TokenizerProtocol
) -> ResultLine | None:
    """The result line of one engine result; None when there is nothing to record (a request aborted by its
    chunk's timeout runs again in the retried chunk)."""
    if owner.abort_reason == "timeout" and result.finish_reason == FinishReason.CANCELLED:
        return None
    try:
        return to_result_line(request, result, tokenizer)
    except Exception as exc:  # an engine result we cannot record fails that request, not the worker
        message = f"invalid engine result: {exc!r}"
        return ResultLine(
            custom_id=request.custom_id, index=request.index, finish_reason="error", error=message
        )
