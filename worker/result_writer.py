"""The exactly-once result writer: settled requests waiting to be written, and the write itself.

Owns the outcomes not yet in Redis (results, and the running-table and counter changes that go with them),
the write in flight (in doubt until Redis says whether it happened), and the check, before every write, that
this worker still owns the chunks it writes for. Chunks found taken over are dropped from the in-flight table
(`worker.inflight`); chunks with nothing left in flight are handed to `finish_job` (the worker's rq handlers)
once their last results are written.

Each write is applied at most once, even when Redis applies it and its reply is lost (Redis killed between
the two, a connection reset): results are plain HSETs, but the counters are HINCRBYs, which a repeat would
count twice (issue 31: 2,016 completed of 2,000 behind a proxy that dropped one reply). So every write carries
a sequence number of this writer's, and its MULTI also sets `cbq:flush:{writer_id}` to that number. A write
stays "in doubt" from the moment it is sent until Redis answered it; the next attempt (after a WatchError,
which redis-py raises instead of re-sending when the connection dies while WATCHing, or after an outage) first
reads the marker under WATCH: at or past the write's number, it went through, and its outcomes count as
written; otherwise it is sent again under the same number, never with anything added to it.

With a `ReplicaWait` (`--redis-wait-replicas`), a write also stays in doubt until Redis's `WAIT` returned
(`worker.replica_wait`), so its results count as written, and its chunks are finished, only after that.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
from rq.job import JobStatus

from producer.store import queue_results, wiped_line
from schemas import keys
from schemas.request import Request
from schemas.result import OUTCOME_OF_REASON, ResultLine
from worker.admission import error_line, to_result_line
from worker.engine.api import EngineResult, FinishReason, TokenizerProtocol
from worker.inflight import InFlightJob, InFlightTable
from worker.output_parsers import OutputParsing
from worker.replica_wait import ReplicaWait

FLUSH_ATTEMPTS = 5  # WATCH retries of one flush
# How long a writer's marker outlives its last write: far longer than a write can stay in doubt (the worker
# gives up after its Redis outage limit, 300 s by default). One key per worker process.
FLUSH_MARKER_TTL_SECONDS = 24 * 3600


@dataclass
class Outcome:
    owner: InFlightJob
    result: ResultLine | None  # None: nothing to record (a request aborted by a timeout gets retried)
    from_engine: bool  # the request was counted as running


@dataclass
class _Flush:
    """One write: its sequence number and what it carries. Once sent, only ever shrinks (chunks taken over
    meanwhile leave it), so a repeat under the same number never writes what the first send did not."""

    seq: int
    outcomes: list[Outcome]
    done: list[InFlightJob]  # chunks with nothing left in flight: their running entry goes, then rq ends them
    by_batch: dict[str, list[Outcome]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_batch = defaultdict(list)
        for outcome in self.outcomes:
            self.by_batch[outcome.owner.payload.batch_id].append(outcome)
        for owner in self.done:
            self.by_batch.setdefault(owner.payload.batch_id, [])

    def owners(self) -> list[InFlightJob]:
        owners = {id(o.owner): o.owner for o in self.outcomes}
        owners.update((id(owner), owner) for owner in self.done)
        return list(owners.values())

    def drop(self, owner: InFlightJob) -> None:
        self.outcomes = [o for o in self.outcomes if o.owner is not owner]
        self.done = [o for o in self.done if o is not owner]
        self.__post_init__()


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
        on_written: Callable[[list[ResultLine]], None] | None = None,
        is_store_wiped: Callable[[], bool] = lambda: False,
        replica_wait: ReplicaWait | None = None,
    ):
        self.connection = connection
        self.table = table
        self.model_name = model_name
        self._finish_job = finish_job
        self._forget_execution = forget_execution
        self.log = log
        self.worker_name = worker_name
        self.outcomes: list[Outcome] = []  # settled requests not yet written to Redis
        self.writer_id = uuid.uuid4().hex  # names this writer's marker: sequence numbers restart with it
        self._next_seq = 1
        self._in_doubt: _Flush | None = None  # sent, and Redis has not said whether it applied it
        self.num_requests_finished = 0
        # Called with each group of results once Redis has them (`cbq run`'s journal and progress line).
        self._on_written = on_written
        self._is_store_wiped = is_store_wiped  # Redis lost its data (`producer.store.marker`)
        self.replica_wait = replica_wait  # None: a write counts once the primary acknowledged it

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def collect(
        self, results: Iterable[EngineResult], tokenizer: TokenizerProtocol, parsing: OutputParsing | None = None
    ) -> None:
        """Take the engine's finished requests as outcomes of their chunks (chat outputs split by `parsing`)."""
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
            self.add(Outcome(owner, record_for(owner, request, result, tokenizer, parsing), from_engine=True))

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
                was_in_doubt = self._in_doubt is not None
                self._try_flush()
                if not (was_in_doubt and self.outcomes):
                    return
                # that was an earlier write, settled now: what came after it is written next
            except redis.WatchError:
                # A chunk job or the marker changed, or the connection died while WATCHing (then the write may
                # have gone through): the write stays in doubt, and the next attempt looks at the marker first.
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
        flush = self._in_doubt or self._next_flush()
        if flush is None:
            return
        self._in_doubt = flush  # until Redis answers, or says it already applied it
        marker = keys.flush_marker(self.writer_id)
        with self.connection.pipeline(transaction=True) as pipe:
            # WATCH the chunk jobs (whoever re-enqueues one changes its hash, and this write aborts) and the
            # marker (a late copy of this write landing meanwhile aborts it too).
            pipe.watch(marker, *[owner.job.key for owner in flush.owners()])
            applied_seq = int(pipe.get(marker) or 0)
            if applied_seq >= flush.seq:
                self.log.warning(
                    "Worker %s: write %d went through though its reply was lost; not repeating it",
                    self.worker_name,
                    flush.seq,
                )
            else:
                for owner in self._taken_over(flush.owners()):
                    self._disown(owner)
                pipe.multi()
                pipe.set(marker, flush.seq, ex=FLUSH_MARKER_TTL_SECONDS)
                for batch_id, group in flush.by_batch.items():
                    done_here = [owner for owner in flush.done if owner.payload.batch_id == batch_id]
                    queue_results(
                        pipe,
                        batch_id,
                        (group[0].owner if group else done_here[0]).ttl_seconds,
                        [o.result for o in group if o.result is not None],
                        running_job_ids=[o.owner.job.id for o in group if o.from_engine],
                        finished_job_ids=[owner.job.id for owner in done_here],
                        model=self.model_name,
                    )
                pipe.execute()
        if self.replica_wait is not None and not self.replica_wait.confirm(
            self.connection, marker, flush.seq, FLUSH_MARKER_TTL_SECONDS
        ):
            return  # still in doubt: the next attempt finds the marker short and sends the write again
        self._in_doubt = None
        written = {id(o) for o in flush.outcomes}
        self.outcomes = [o for o in self.outcomes if id(o) not in written]
        self._count_written(flush.outcomes)
        for owner in flush.done:
            self._finish_job(owner)

    def _next_flush(self) -> _Flush | None:
        """Everything settled so far, and the chunks it completes; None when there is nothing to write."""
        done = self.table.done()  # all their outcomes are among these (nothing of them is in the engine)
        if not self.outcomes and not done:
            return None
        self._next_seq += 1
        return _Flush(self._next_seq - 1, list(self.outcomes), done)

    def _count_written(self, outcomes: list[Outcome]) -> None:
        written = [outcome.result for outcome in outcomes if outcome.result is not None]
        for outcome in outcomes:
            if outcome.result is not None:
                outcome.owner.counts[f"num_{OUTCOME_OF_REASON[outcome.result.finish_reason]}"] += 1
                self.num_requests_finished += 1
        if written and self._on_written is not None:
            self._on_written(written)

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
        num_unwritten = len(owner.pending) + sum(1 for o in self.outcomes if o.owner is owner)
        if self._is_store_wiped():  # no new owner: nothing of the batch is left to write to
            self.log.error(
                "Worker %s: %s; dropping job %s's %d unwritten requests",
                self.worker_name,
                wiped_line(owner.payload.batch_id),
                owner.job.id,
                num_unwritten,
            )
        else:
            self.log.warning(
                "Worker %s: job %s was re-enqueued while it ran here; dropping its %d unwritten requests",
                self.worker_name,
                owner.job.id,
                num_unwritten,
            )
        self.table.drop(owner)
        self._forget_execution(owner)
        self.outcomes = [o for o in self.outcomes if o.owner is not owner]
        if self._in_doubt is not None:
            self._in_doubt.drop(owner)


def record_for(
    owner: InFlightJob,
    request: Request,
    result: EngineResult,
    tokenizer: TokenizerProtocol,
    parsing: OutputParsing | None = None,
) -> ResultLine | None:
    """The result line of one engine result; None when there is nothing to record (a request aborted by its
    chunk's timeout runs again in the retried chunk)."""
    if owner.abort_reason == "timeout" and result.finish_reason == FinishReason.CANCELLED:
        return None
    try:
        return to_result_line(request, result, tokenizer, parsing)
    except Exception as exc:  # an engine result we cannot record fails that request, not the worker
        return error_line(request.index, request.custom_id, f"invalid engine result: {exc!r}")
