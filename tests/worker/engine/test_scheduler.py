"""Scheduler: decode-first ordering, the token budget and chunked prefill, admission limits, preemption,
and async scheduling with tokens in flight. Plain `Sequence` objects, no model."""

from __future__ import annotations

from worker.engine.api import SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler, StepPlan
from worker.engine.sequence import SeqStatus, Sequence

BS = 4  # block size


def make_seq(request_id: str, num_prompt: int, max_new_tokens: int = 16) -> Sequence:
    return Sequence(request_id, [1] * num_prompt, SamplingParams(max_new_tokens=max_new_tokens), seed=0)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 200):
    return Scheduler(BlockManager(num_blocks, BS), budget, max_num_seqs, max_model_len)


def layout(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in plan.chunks]


def land(scheduler: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does when a step's tokens reach the host (no stop checks)."""
    for chunk in plan.sampling_chunks():
        scheduler.on_token(chunk.seq)
        chunk.seq.output_ids.append(token)


def step(scheduler: Scheduler) -> StepPlan:
    """One synchronous step: schedule, then land its tokens."""
    plan = scheduler.schedule()
    land(scheduler, plan)
    return plan


def add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)


def test_decodes_are_scheduled_before_new_prompts():
    sched = make_scheduler(budget=8)
    a, b = make_seq("a", 5), make_seq("b", 3)
    add(sched, a, b)
    assert layout(step(sched)) == [("a", 0, 5, True), ("b", 0, 3, True)]
    c = make_seq("c", 20)
    add(sched, c)  # arrives before the decodes are scheduled, still goes after them
    plan = step(sched)
    assert layout(plan) == [("a", 5, 1, True), ("b", 3, 1, True), ("c", 0, 6, False)]
    assert plan.num_tokens == 8 and not plan.is_decode_only
    assert [s.request_id for s in sched.running] == ["a", "b", "c"]


def test_long_prompt_is_chunked_within_the_token_budget():
    sched = make_scheduler(budget=8)
    a = make_seq("a", 21)
    add(sched, a)
    plans = [step(sched) for _ in range(4)]
    assert [layout(p) for p in plans] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 5, True)],  # only the final chunk samples
        [("a", 21, 1, True)],
    ]
    assert a.num_computed_tokens == 22 and a.output_ids == [7, 7]
    assert len(a.block_table) == 6  # 22 tokens / 4 per block, rounded up


def test_token_budget_is_shared_by_decodes_and_prefill_chunks():
    sched = make_scheduler(budget=6)
    seqs = [make_seq(f"s{i}", n) for i, n in enumerate([3, 2, 9, 4])]
    add(sched, *seqs)
    plans = []
    for _ in range(8):
        plan = sched.schedule()
        assert 0 < plan.num_tokens <= 6
        for c in plan.chunks:
            num_known = c.seq.num_prompt_tokens + len(c.seq.output_ids)
            # A chunk samples exactly when it reaches the end of the known tokens.
            assert (c.start + c.num_tokens == num_known) == c.samples
            assert c.start + c.num_tokens <= num_known
        land(sched, plan)
        plans.append(layout(plan))
    assert plans[:4] == [
        [("s0", 0, 3, True), ("s1", 0, 2, True), ("s2", 0, 1, False)],
        [("s0", 3, 1, True), ("s1", 2, 1, True), ("s2", 1, 4, False)],
        [("s0", 4, 1, True), ("s1", 3, 1, True), ("s2", 5, 4, True)],
        [("s0", 5, 1, True), ("s1", 4, 1, True), ("s2", 9, 1, True), ("s3", 0, 3, False)],
    ]
    assert plans[4] == [("s0", 6, 1, True), ("s1", 5, 1, True), ("s2", 10, 1, True), ("s3", 3, 1, True)]
    assert plans[-1] == [("s0", 9, 1, True), ("s1", 8, 1, True), ("s2", 13, 1, True), ("s3", 6, 1, True)]


def test_admission_stops_when_blocks_run_out_in_arrival_order():
    sched = make_scheduler(num_blocks=6)  # 5 usable blocks
    a, b, c, d = make_seq("a", 8), make_seq("b", 8), make_seq("c", 8), make_seq("d", 1)
    add(sched, a, b, c, d)
    plan = sched.schedule()
    # a and b take 2 blocks each; c needs 2 but 1 is free, and d (which would fit) waits behind c.
    assert layout(plan) == [("a", 0, 8, True), ("b", 0, 8, True)]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert c.status == SeqStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert sched.blocks.num_free_blocks == 1
    land(sched, plan)
    sched.finish(a)
    assert a.status == SeqStatus.FINISHED and a.block_table == []
    # b's decode takes a third block first, then c takes the last two: d still waits.
    assert layout(sched.schedule()) == [("b", 8, 1, True), ("c", 0, 8, True)]
    assert list(sched.waiting) == [d] and sched.blocks.num_free_blocks == 0


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=3)
    seqs = [make_seq(f"s{i}", 2) for i in range(5)]
    add(sched, *seqs)
    plan = step(sched)
    assert [c.seq.request_id for c in plan.chunks] == ["s0", "s1", "s2"]
    for _ in range(3):
        assert len(step(sched).chunks) == 3 and len(sched.running) == 3
    sched.finish(seqs[1])
    plan = sched.schedule()
    assert layout(plan) == [("s0", 5, 1, True), ("s2", 5, 1, True), ("s3", 0, 2, True)]
    assert [s.request_id for s in sched.waiting] == ["s4"]


def test_decode_without_a_block_preempts_the_newest_running_sequence():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 8)
    add(sched, a, b, c)
    step(sched)  # a: 1 block, b: 1 block, c: 2 blocks; the cache is full
    assert sched.blocks.num_free_blocks == 0
    c_blocks = list(c.block_table)
    plan = sched.schedule()  # a and b each need a second block for position 4
    assert layout(plan) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert c.status == SeqStatus.WAITING
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.output_ids == [7], "known tokens survive preemption; only the cache is recomputed"
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert sorted(a.block_table[1:] + b.block_table[1:]) == sorted(c_blocks)
    sched.blocks.check_integrity([a, b, c])


def test_preempted_sequence_goes_to_the_front_and_recomputes_all_known_tokens():
    sched = make_scheduler(num_blocks=5, budget=32)
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 8)
    late = make_seq("late", 1)
    add(sched, a, b, c)
    step(sched)
    add(sched, late)
    land(sched, sched.schedule())  # c preempted, goes in front of "late"
    assert [s.request_id for s in sched.waiting] == ["c", "late"]
    sched.finish(a)
    sched.finish(b)
    plan = sched.schedule()
    # c's recompute covers prompt + the token it already generated, and samples the next one.
    assert layout(plan) == [("c", 0, 9, True), ("late", 0, 1, True)]


def test_a_sequence_can_preempt_itself():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    add(sched, a, b, c)
    step(sched)  # one block each: full
    plan = sched.schedule()
    # a takes c's block; then b is the newest running sequence and preempts itself.
    assert layout(plan) == [("a", 4, 1, True)]
    assert sched.running == [a]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.status == SeqStatus.WAITING
    assert sched.num_preemptions == 2
    sched.blocks.check_integrity([a, b, c])


def test_async_in_flight_sample_extends_the_sequence_and_schedules_the_next_decode():
    sched = make_scheduler()
    a = make_seq("a", 4)
    add(sched, a)
    assert layout(sched.schedule()) == [("a", 0, 4, True)]
    assert a.num_inflight_samples == 1 and a.num_tokens == 5 and a.output_ids == []
    # Step N+1 is planned before step N's token is known: the decode's input is the in-flight token.
    assert layout(sched.schedule()) == [("a", 4, 1, True)]
    assert a.num_inflight_samples == 2 and a.num_tokens == 6 and a.num_computed_tokens == 5
    assert len(a.block_table) == 2, "slot for position 4 (the in-flight token) reserved"
    sched.on_token(a)
    a.output_ids.append(11)
    assert a.num_inflight_samples == 1 and a.num_tokens == 6
    assert layout(sched.schedule()) == [("a", 5, 1, True)]


def test_waiting_sequence_with_a_token_in_flight_is_not_admitted():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    a, x, b = make_seq("a", 4), make_seq("x", 4), make_seq("b", 8)
    add(sched, a, x, b)
    sched.schedule()  # all prefilled, tokens in flight, cache full
    assert sched.blocks.num_free_blocks == 0
    plan = sched.schedule()  # async: a's and x's decodes need blocks; b is preempted with its token in flight
    assert layout(plan) == [("a", 4, 1, True), ("x", 4, 1, True)]
    assert b.status == SeqStatus.WAITING and b.num_inflight_samples == 1 and b.block_table == []
    c = make_seq("c", 1)
    add(sched, c)
    sched.finish(a)
    sched.finish(x)
    assert sched.blocks.num_free_blocks == 4  # room for b (3 blocks) and c (1)
    assert sched.schedule().chunks == [], "b must wait for its token; c waits behind b"
    sched.on_token(b)
    b.output_ids.append(9)
    assert layout(sched.schedule()) == [("b", 0, 9, True), ("c", 0, 1, True)]


def test_sequences_done_by_length_are_not_scheduled_again():
    sched = make_scheduler(max_model_len=8)
    a = make_seq("a", 3, max_new_tokens=2)
    b = make_seq("b", 6, max_new_tokens=100)  # limited by max_model_len = 8
    add(sched, a, b)
    assert layout(sched.schedule()) == [("a", 0, 3, True), ("b", 0, 6, True)]
    # Async: the second decode is scheduled before the first token is known.
    assert layout(sched.schedule()) == [("a", 3, 1, True), ("b", 6, 1, True)]
    assert a.num_generated == 2 and b.num_tokens == 8
    assert sched.is_done_generating(a) and sched.is_done_generating(b)
    assert sched.schedule().chunks == [], "both finish by length once their in-flight tokens land"
    assert a.num_inflight_samples == 2 and b.num_inflight_samples == 2


def test_done_sequences_do_not_use_the_token_budget():
    sched = make_scheduler(budget=4)
    a = make_seq("a", 2, max_new_tokens=1)
    b = make_seq("b", 3)
    add(sched, a)
    sched.schedule()  # a's single token is in flight
    add(sched, b)
    assert layout(sched.schedule()) == [("b", 0, 3, True)]


def test_a_one_token_chunk_never_starts_a_bidirectional_image():
    """With one token of budget left, a prompt standing at a bidirectional image's first pad waits for a step that
    computes the image whole (seen on an H100: Gemma 3 at a 270-token budget ran a 1-token chunk of its image,
    whose rows then reached keys the step had not written)."""
    import numpy as np

    from worker.engine.multimodal import PromptImage, SequenceImages

    sched = make_scheduler(budget=4)
    a, c, d, b = make_seq("a", 1), make_seq("c", 1), make_seq("d", 1), make_seq("b", 20)
    image = PromptImage("h", None, None, start=1, num_tokens=2, layout=None)
    b.images = SequenceImages((image,), np.zeros((3, 20), dtype=np.int64), 0, bidirectional=True)
    add(sched, a, c, d, b)
    assert layout(step(sched)) == [("a", 0, 1, True), ("c", 0, 1, True), ("d", 0, 1, True), ("b", 0, 1, False)]
    assert layout(step(sched)) == [("a", 1, 1, True), ("c", 1, 1, True), ("d", 1, 1, True)]
