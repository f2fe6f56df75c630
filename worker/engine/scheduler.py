"""Scheduler: decides what each step computes. Owns the waiting and running queues and, on each
`Sequence`, `status`, `num_computed_tokens` and `num_inflight_samples`.

Per step, within a token budget: running sequences first (decodes, and the next chunk of a prefill
in progress), then new prompts in arrival order while KV blocks last. When a running sequence
cannot get a block, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its known tokens.

Async mode schedules step N+1 before step N's tokens are known. A sequence's length then includes
the tokens sampled in flight (`num_inflight_samples`): its next input is a placeholder that the
device fills from step N's output (the carry-over), and its KV slots are reserved now.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # positions start .. start + num_tokens - 1
    samples: bool  # the chunk reaches the sequence's end, so this step samples its next token


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(c.num_tokens == 1 and c.samples for c in self.chunks)

    def sampling_chunks(self) -> list[ScheduledChunk]:
        """Chunks that produce a token; output row k of the step belongs to the k-th of them."""
        return [c for c in self.chunks if c.samples]


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
    ):
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_done_generating(self, seq: Sequence) -> bool:
        """Known to finish by length once its in-flight tokens land: schedule it no further."""
        return seq.num_generated >= seq.sampling.max_new_tokens or seq.num_tokens >= self.max_model_len

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if self.is_done_generating(seq):
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            budget -= self._schedule_chunk(plan, seq, num_new)
        # 2. New (or preempted) prompts in arrival order.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight_samples:
                break  # preempted with a token still in flight: admit once it is known
            num_new = min(seq.num_tokens, budget)
            if not self.blocks.can_allocate(seq, num_new):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule_chunk(plan, seq, num_new)
        return plan

    def _schedule_chunk(self, plan: StepPlan, seq: Sequence, num_new: int) -> int:
        start = seq.num_computed_tokens
        self.blocks.allocate(seq, start + num_new)
        samples = start + num_new == seq.num_tokens
        plan.chunks.append(ScheduledChunk(seq, start, num_new, samples))
        seq.num_computed_tokens += num_new
        if samples:
            seq.num_inflight_samples += 1
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_token(self, seq: Sequence) -> None:
        """A token sampled for `seq` in a launched step is now known on the host."""
        assert seq.num_inflight_samples > 0, f"{seq.request_id}: token arrived with none in flight"
        seq.num_inflight_samples -= 1

    def unschedule(self, plan: StepPlan) -> None:
        """`plan` was never launched: its sequences are as before it was scheduled (blocks allocated for it stay
        with their sequence and serve the next schedule). Sequences it admitted stay running."""
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens -= chunk.num_tokens
            if chunk.samples:
                chunk.seq.num_inflight_samples -= 1

    def on_step_failed(self) -> list[Sequence]:
        """A launched step failed, so its tokens never arrive. Returns the sequences it may have touched (every
        running one, and waiting ones with a token in flight), with nothing left in flight; the caller
        finishes them."""
        touched = list(self.running) + [s for s in self.waiting if s.num_inflight_samples]
        for seq in touched:
            seq.num_inflight_samples = 0
        return touched

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)
