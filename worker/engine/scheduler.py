"""Scheduler: decides what each step computes. Owns the waiting and running queues and, on each
`Sequence`, `status`, `num_computed_tokens` and `num_inflight_samples`.

Per step, within a token budget: running sequences first (decodes, and the next chunk of a prefill
in progress), then new prompts in arrival order while KV blocks last. When a running sequence
cannot get a block, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its known tokens.

Async mode schedules step N+1 before step N's tokens are known. A sequence's length then includes
the tokens sampled in flight (`num_inflight_samples`): its next input is a placeholder that the
device fills from step N's output (the carry-over), and its KV slots are reserved now.

Prefix reuse happens at admission: a sequence starts with the cached blocks that match its known
tokens (a preempted sequence can find its own), and computes from there; at least one token is always
computed. Parallel samples (n > 1) are a leader and followers: the followers wait, outside the queues,
until the leader's prompt is written (`on_step_processed`), then share its full prompt blocks by
reference and compute only the partial last block (at most one block of tokens) themselves.
A waiting sequence never holds blocks, so preemption can always make room for the oldest one.

A sequence that wants prompt logprobs (prompt_logprobs.py) starts from cached blocks only up to the prompt
positions whose logprobs it has recorded, and its prefill chunks are shortened so that a step computes at most
`prompt_logprobs.MAX_ROWS_PER_STEP` such rows. A chunk never ends inside an image whose tokens attend both ways
(Gemma 3: `SequenceImages.whole_images`); the engine refuses an image longer than the step's token budget. `max_new_tokens` 0 (scoring) samples once, at the prompt's end,
and the engine drops that token.

longrope (`long_rope_after`: the model's original context, families/spec.py `longrope_original_len`). In Phi-3's
`generate` a sequence's K/V all rotate with one table: the short factors while it is at most that long, the long
ones once longer (its prompt is one forward, so a long prompt is long from its first chunk; and the step that makes
a sequence longer recomputes its whole cache). Here a sequence's table is a function of its length as the scheduler
sees it (`num_tokens`, which counts the token its next step samples after): admission sets `long_rope` from it, and a
running sequence whose length passes the bound is put back at the front of the queue, its blocks freed as in a
preemption, and recomputed from its first token with the long table (the prefix cache names long blocks apart).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .prompt_logprobs import MAX_ROWS_PER_STEP, rows_of_chunk
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # positions start .. start + num_tokens - 1
    samples: bool  # the chunk reaches the sequence's end, so this step samples its next token
    epoch: int = 0  # `seq.num_preemptions` when scheduled: after a preemption the chunk's blocks are gone


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Chunks whose processing matters to the block manager: they write a block's last token, or end the
    # prompt of a leader with followers waiting. Most decodes are neither, so processing skips them.
    committing_chunks: list[ScheduledChunk] = field(default_factory=list)

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
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        long_rope_after: int | None = None,
    ):
        self.blocks = block_manager
        self.long_rope_after = long_rope_after  # longrope: sequences longer than this rotate with the long table
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._prompt_rows_left = MAX_ROWS_PER_STEP  # in the step being scheduled
        # Parallel samples: leader -> followers not yet queued; follower -> leader until it is admitted.
        self._followers: dict[Sequence, list[Sequence]] = {}
        self._leader_of: dict[Sequence, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """Parallel samples of one prompt: the first is queued; the others once its prompt is written."""
        leader, followers = seqs[0], seqs[1:]
        self.add(leader)
        if followers:
            self._followers[leader] = list(followers)
            self._leader_of.update((f, leader) for f in followers)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._followers)

    def is_done_generating(self, seq: Sequence) -> bool:
        """Known to finish by length once its in-flight tokens land: schedule it no further."""
        return self._is_done_generating(seq, seq.num_tokens)

    def _is_done_generating(self, seq: Sequence, num_tokens: int) -> bool:
        # `or 1`: a scoring request (max_new_tokens 0) still samples once, which ends its prefill
        return num_tokens >= self.max_model_len or seq.num_generated >= (seq.sampling.max_new_tokens or 1)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        self._prompt_rows_left = MAX_ROWS_PER_STEP
        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        # NOTE: this loop runs once per running sequence per step (1,000 in W2), so it reads each sequence's
        # length once and skips the block manager while the sequence's table already covers the chunk.
        block_size = self.blocks.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            num_tokens = seq.num_tokens
            if self._is_done_generating(seq, num_tokens):
                continue
            if self._passes_long_rope(seq, num_tokens):
                self._requeue(seq)  # recomputed with the long table, from step 2 on (its blocks are short ones)
                i -= 1
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            if num_new > 1 and seq.wants_prompt_logprobs:
                num_new = self._within_prompt_rows(seq, seq.num_computed_tokens, num_new)
                if not num_new:
                    continue
            if seq.images is not None:  # a bidirectional image is computed whole (a 1-token chunk too)
                num_new = seq.images.whole_images(seq.num_computed_tokens, num_new)
                if not num_new:
                    continue
            end = seq.num_computed_tokens + num_new
            if end > len(seq.block_table) * block_size:  # needs a new block (else can_allocate is True)
                while not self.blocks.can_allocate(seq, end):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status != SeqStatus.RUNNING:
                    break  # it preempted itself: everything after it is gone too
            budget -= self._schedule_chunk(plan, seq, num_new, num_tokens)
        # 2. New (or preempted) prompts in arrival order.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight_samples:
                break  # preempted with a token still in flight: admit once it is known
            if self._passes_long_rope(seq, seq.num_tokens):
                seq.long_rope = True
                self.blocks.forget_hashes(seq)  # before any prefix lookup: its cached blocks are the long ones
            prefix = self._reusable_prefix(seq)
            start = len(prefix) * self.blocks.block_size
            num_new = min(seq.num_tokens - start, budget)
            if seq.wants_prompt_logprobs:
                num_new = self._within_prompt_rows(seq, start, num_new)
            if seq.images is not None:
                num_new = seq.images.whole_images(start, num_new)
            if not num_new or not self.blocks.can_allocate(seq, start + num_new, prefix):
                break
            self.waiting.popleft()
            self._leader_of.pop(seq, None)
            self.blocks.share_prefix(seq, prefix)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
            seq.num_computed_tokens = start
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule_chunk(plan, seq, num_new, seq.num_tokens)
        return plan

    def _reusable_prefix(self, seq: Sequence) -> list[int]:
        """Written blocks `seq` can start from: cached ones, or its leader's prompt blocks if longer."""
        prefix = self.blocks.match_prefix(seq)
        if seq.wants_prompt_logprobs and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            # computing from block k needs the entry of position k * block_size known already
            prefix = prefix[: (len(seq.prompt_logprobs) - 1) // self.blocks.block_size]
        leader = self._leader_of.get(seq)
        # (a leader that has grown past longrope's bound holds long blocks; its followers' prompts rotate short)
        if leader is not None and leader.status == SeqStatus.RUNNING and leader.long_rope == seq.long_rope:
            num_blocks = min((seq.num_tokens - 1) // self.blocks.block_size, leader.num_committed_blocks)
            if num_blocks > len(prefix):
                prefix = leader.block_table[:num_blocks]
        return prefix

    def _within_prompt_rows(self, seq: Sequence, start: int, num_new: int) -> int:
        """`num_new` positions from `start`, shortened so that this step's prompt rows stay within the bound (0:
        none fit); the rows are counted as taken."""
        first, end = rows_of_chunk(start, num_new, seq.num_prompt_tokens, len(seq.prompt_logprobs))
        num_rows = max(0, end - first)
        if num_rows > self._prompt_rows_left:
            num_new = max(0, first + self._prompt_rows_left - start)
            num_rows = self._prompt_rows_left if num_new else 0
        self._prompt_rows_left -= num_rows
        return num_new

    def _schedule_chunk(self, plan: StepPlan, seq: Sequence, num_new: int, num_tokens: int) -> int:
        """Schedule positions [computed, computed + num_new) of `seq` (`num_tokens` long); blocks checked."""
        start, end, block_size = (
            seq.num_computed_tokens,
            seq.num_computed_tokens + num_new,
            self.blocks.block_size,
        )
        assert start >= seq.num_committed_blocks * block_size, (
            f"{seq.request_id}: would write a committed (shareable) block"
        )
        if end > len(seq.block_table) * block_size:  # else allocate has nothing to do
            self.blocks.allocate(seq, end)
        chunk = ScheduledChunk(seq, start, num_new, end == num_tokens, seq.num_preemptions)
        plan.chunks.append(chunk)
        if end // block_size > start // block_size or seq in self._followers:
            plan.committing_chunks.append(chunk)
        seq.num_computed_tokens = end
        if chunk.samples:
            seq.num_inflight_samples += 1
        return num_new

    def _passes_long_rope(self, seq: Sequence, num_tokens: int) -> bool:
        """`seq`, `num_tokens` long, is longer than longrope's original context but rotates with the short table."""
        return self.long_rope_after is not None and not seq.long_rope and num_tokens > self.long_rope_after

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it first in the queue, to be recomputed from its known tokens. Its epoch
        (`num_preemptions`) moves on, so chunks scheduled before never commit the freed blocks."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_processed(self, plan: StepPlan) -> None:
        """A launched step has completed and its tokens are known: the K/V it wrote can be shared. Call
        before its tokens are applied, so a sequence that they finish still registers its blocks."""
        for chunk in plan.committing_chunks:
            seq = chunk.seq
            if seq.status != SeqStatus.RUNNING or seq.num_preemptions != chunk.epoch:
                continue  # finished or preempted since: the blocks it wrote were released
            end = chunk.start + chunk.num_tokens
            self.blocks.commit(seq, end)
            if end >= seq.num_prompt_tokens and seq in self._followers:
                self._release_followers(seq)

    def _release_followers(self, leader: Sequence) -> None:
        # At the front: they belong to a request already running. They keep `_leader_of` until admitted.
        self.waiting.extendleft(reversed(self._followers.pop(leader)))

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
        leader = self._leader_of.pop(seq, None)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif leader is not None and seq in self._followers.get(leader, ()):
            self._followers[leader].remove(seq)  # still waiting for its leader's prompt
            if not self._followers[leader]:
                del self._followers[leader]
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq in self._followers:
            self._release_followers(seq)  # they compute the prompt themselves
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)
