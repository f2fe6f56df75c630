"""Prefix caching in the block manager and scheduler: hash chains, reference counts, cached-free blocks
and LRU eviction, sharing only committed (written) blocks, and parallel-sample groups. No model."""

from __future__ import annotations

import random

import pytest

from worker.engine.api import SamplingParams
from worker.engine.block_manager import BlockManager, block_hash
from worker.engine.scheduler import Scheduler, StepPlan
from worker.engine.sequence import SeqStatus, Sequence

BS = 4


def make_seq(request_id: str, prompt: list[int], max_new_tokens: int = 16, **fields) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), seed=0, **fields)


def prefilled(blocks: BlockManager, request_id: str, prompt: list[int]) -> Sequence:
    """A sequence admitted with whatever the cache holds, its prompt computed and committed."""
    seq = make_seq(request_id, prompt)
    blocks.share_prefix(seq, blocks.match_prefix(seq))
    blocks.allocate(seq, len(prompt))
    blocks.commit(seq, len(prompt))
    return seq


# -- hash chains ----------------------------------------------------------------------------------
def test_block_hashes_chain_on_the_whole_prefix():
    blocks = BlockManager(16, BS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8])
    c = make_seq("c", [0, 2, 3, 4, 5, 6, 7, 8])  # second block equal to a's, first differs
    d = make_seq("d", [1, 2, 3, 4, 5, 6, 7, 8], kv_namespace=b"adapter-1")
    ha, hb, hc, hd = (blocks._hashes(s, 2) for s in (a, b, c, d))
    assert ha == hb, "same leading blocks, same names"
    assert ha[0] != hc[0] and ha[1] != hc[1], "a block's name depends on every token before it"
    assert hd[0] != ha[0] and hd[1] != ha[1], "the namespace is the root of the chain"
    assert ha[1] == block_hash(ha[0], [5, 6, 7, 8])
    with pytest.raises(AssertionError, match="naming a block of unknown tokens"):
        blocks._hashes(a, 3)  # only full blocks are named
    a.output_ids += [10, 11, 12]  # generated tokens fill the third block
    assert len(blocks._hashes(a, 3)) == 3 and a.block_hashes[:2] == ha


def test_match_prefix_leaves_at_least_one_token_to_compute():
    blocks = BlockManager(16, BS)
    prefilled(blocks, "a", list(range(12)))  # three full blocks committed
    for prompt_len, expected_blocks in [(12, 2), (13, 3), (9, 2), (8, 1), (4, 0), (20, 3)]:
        seq = make_seq(
            "b", list(range(prompt_len)) if prompt_len <= 12 else list(range(12)) + [99] * (prompt_len - 12)
        )
        hits = blocks.match_prefix(seq)
        assert len(hits) == expected_blocks, prompt_len
        assert len(hits) * BS < seq.num_tokens


def test_match_stops_at_the_first_missing_block():
    blocks = BlockManager(16, BS)
    a = prefilled(blocks, "a", list(range(12)))
    seq = make_seq("b", [0, 1, 2, 3, 9, 9, 9, 9] + list(range(8, 12)) + [5])
    assert blocks.match_prefix(seq) == a.block_table[:1]


# -- reference counts, cached-free blocks, eviction ----------------------------------------------
def test_shared_blocks_are_reference_counted_and_cached_after_release():
    blocks = BlockManager(10, BS)
    a = prefilled(blocks, "a", list(range(10)))  # blocks: 2 full (committed) + 1 partial
    b = prefilled(blocks, "b", list(range(8)) + [50, 51, 52])
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [blocks.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert b.num_committed_blocks == 2
    assert blocks.num_free_blocks == 9 - 4
    blocks.check_integrity([a, b])
    a_table = list(a.block_table)
    blocks.free(a)
    blocks.check_integrity([b])
    blocks.free(b)
    blocks.check_integrity([])
    assert blocks.num_free_blocks == blocks.num_usable_blocks, "cached blocks count as free"
    assert blocks.num_cached_blocks == 2, "the two full blocks keep their K/V after release"
    c = make_seq("c", list(range(8)) + [7])
    assert blocks.match_prefix(c) == a_table[:2], "hit after every holder finished"
    assert blocks.can_allocate(c, 9, blocks.match_prefix(c))


def test_free_blocks_are_used_before_cached_ones_are_evicted():
    blocks = BlockManager(7, BS)  # 6 usable
    a = prefilled(blocks, "a", list(range(8)))  # 2 blocks, both cached after release
    blocks.free(a)
    x = make_seq("x", [9])
    blocks.allocate(x, 4 * BS)  # exactly the 4 never-hashed blocks
    assert not set(x.block_table) & set(a.block_table)
    assert blocks.num_cached_blocks == 2 and blocks.num_evictions == 0
    y = make_seq("y", [9])
    blocks.allocate(y, BS)  # the free list is dry: evict one
    assert blocks.num_evictions == 1 and blocks.num_cached_blocks == 1
    blocks.check_integrity([x, y])


def test_eviction_is_least_recently_used_and_tail_first():
    blocks = BlockManager(9, BS)  # 8 usable
    a = prefilled(blocks, "a", list(range(12)))  # 3 blocks
    b = prefilled(blocks, "b", list(range(100, 112)))  # 3 blocks
    a_table, b_table = list(a.block_table), list(b.block_table)
    blocks.free(a)
    blocks.free(b)
    # A hit on a's prefix makes those blocks the most recently used once released again.
    c = make_seq("c", list(range(8)) + [1])
    blocks.share_prefix(c, blocks.match_prefix(c))
    blocks.free(c)
    # LRU order now: a's tail block, then b's blocks (tail first), then a's first two blocks.
    filler = make_seq("f", [0])
    blocks.allocate(filler, 2 * BS)  # the 2 never-hashed blocks first
    assert blocks.num_evictions == 0
    evicted = []
    for num_blocks in range(3, 7):
        blocks.allocate(filler, num_blocks * BS)  # one eviction each
        evicted.append(filler.block_table[-1])
    assert evicted == [a_table[2], b_table[2], b_table[1], b_table[0]]
    assert blocks.match_prefix(make_seq("a2", list(range(12)) + [0])) == a_table[:2]
    blocks.check_integrity([filler])


def test_can_allocate_does_not_count_a_hit_on_a_cached_block_as_room():
    blocks = BlockManager(4, BS)  # 3 usable
    a = prefilled(blocks, "a", list(range(8)))  # 2 blocks
    blocks.free(a)
    assert blocks.num_free_blocks == 3
    b = make_seq("b", list(range(8)) + [1, 2, 3, 4, 5])  # 13 tokens: 4 blocks, 2 of them hits
    hits = blocks.match_prefix(b)
    assert len(hits) == 2
    assert not blocks.can_allocate(b, 13, hits), "the hits leave 1 free block, 2 are needed"
    assert blocks.can_allocate(b, 12, hits)


def test_a_duplicate_block_stays_private_and_is_freed_not_cached():
    blocks = BlockManager(10, BS)
    prompt = list(range(9))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    for seq in (a, b):  # both admitted before either committed: both compute the prefix
        blocks.share_prefix(seq, blocks.match_prefix(seq))
        blocks.allocate(seq, len(prompt))
    blocks.commit(a, 9)
    blocks.commit(b, 9)
    assert blocks.num_cached_blocks == 2
    assert blocks.match_prefix(make_seq("c", prompt)) == a.block_table[:2]
    blocks.free(b)
    assert blocks.num_cached_blocks == 2 and len(blocks._free) == 9 - 3
    blocks.check_integrity([a])


def test_caching_off_shares_nothing_and_counts_nothing():
    blocks = BlockManager(10, BS, enable_prefix_caching=False)
    a = prefilled(blocks, "a", list(range(9)))
    b = prefilled(blocks, "b", list(range(9)))
    assert not set(a.block_table) & set(b.block_table)
    assert blocks.num_cached_blocks == 0 and blocks.num_cache_queries == 0
    blocks.free(a)
    blocks.free(b)
    assert len(blocks._free) == blocks.num_usable_blocks
    blocks.check_integrity([])


def test_check_integrity_detects_cache_state_that_disagrees():
    blocks = BlockManager(10, BS)
    blocks.free(prefilled(blocks, "a", list(range(8))))
    blocks.check_integrity([])
    first = next(iter(blocks._evictable))
    name = blocks._hash_of[first]
    del blocks._block_of[name]
    with pytest.raises(AssertionError, match="a hashed block is missing from the hash map"):
        blocks.check_integrity([])
    blocks._block_of[name] = first
    blocks._hash_of[first] = None
    with pytest.raises(AssertionError, match="a cached block has no hash"):
        blocks.check_integrity([])


def test_random_share_commit_free_keeps_integrity():
    """Many random admissions over a small vocabulary of prefixes, in a cache that must evict."""
    rng = random.Random(3)
    blocks = BlockManager(24, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 14))] for _ in range(4)]
    live: list[Sequence] = []
    for i in range(400):
        if live and (rng.random() < 0.45 or blocks.num_free_blocks < 6):
            blocks.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            seq = make_seq(f"s{i}", prompt)
            hits = blocks.match_prefix(seq)
            if not blocks.can_allocate(seq, len(prompt), hits):
                continue
            blocks.share_prefix(seq, hits)
            blocks.allocate(seq, len(prompt))
            blocks.commit(seq, len(prompt))
            live.append(seq)
            # Every shared block holds exactly this sequence's tokens (by its name).
            names = blocks._hashes(seq, seq.num_committed_blocks)
            assert [blocks._hash_of[b] for b in seq.block_table[: len(hits)]] == names[: len(hits)]
        blocks.check_integrity(live)
    assert blocks.num_evictions > 0 and blocks.num_cache_hits > 0


# -- scheduler: only written blocks are shared ----------------------------------------------------
def land(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """The engine's processing of a step: commit its K/V, then apply its tokens."""
    sched.on_step_processed(plan)
    for chunk in plan.sampling_chunks():
        sched.on_token(chunk.seq)
        chunk.seq.output_ids.append(token)


def layout(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in plan.chunks]


def make_scheduler(num_blocks: int = 64, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, **kw), budget, 16, 200)


def test_a_cached_prefix_skips_its_prefill_and_counts_as_cached_tokens():
    sched = make_scheduler()
    prompt = list(range(10))
    a = make_seq("a", prompt)
    sched.add(a)
    land(sched, sched.schedule())
    b = make_seq("b", prompt + [42, 43])
    sched.add(b)
    plan = sched.schedule()
    assert layout(plan) == [("a", 10, 1, True), ("b", 8, 4, True)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert sched.blocks.num_cache_hits == 8 and sched.blocks.num_cache_queries == 10 + 12


def test_blocks_of_a_step_in_flight_are_not_shared():
    """Async: b is admitted while a's prefill chunk that fills the blocks is launched but not processed."""
    sched = make_scheduler(budget=12)
    prompt = list(range(20))
    a, b = make_seq("a", prompt), make_seq("b", prompt + [1])
    sched.add(a)
    plan1 = sched.schedule()  # a[0:12]: blocks 0-2 full when written
    sched.add(b)
    plan2 = sched.schedule()  # a[12:20]; b admitted with 4 tokens of budget, nothing processed yet
    assert layout(plan2) == [("a", 12, 8, True), ("b", 0, 4, False)]
    assert not set(a.block_table) & set(b.block_table)
    land(sched, plan1)  # a's first 12 tokens are written: its first 3 blocks can be shared from now on
    assert a.num_committed_blocks == 3 and sched.blocks.num_cached_blocks == 3
    sched.finish(b)  # room in the budget for c
    c = make_seq("c", prompt + [2])
    sched.add(c)
    plan3 = sched.schedule()  # plan2 is still in flight
    assert layout(plan3) == [("a", 20, 1, True), ("c", 12, 9, True)], "c shares only the 3 written blocks"
    assert c.block_table[:3] == a.block_table[:3] and c.block_table[3] != a.block_table[3]


def test_a_chunk_from_before_a_preemption_is_not_committed():
    sched = make_scheduler(num_blocks=6, budget=64)  # 5 usable
    a, b = make_seq("a", list(range(8))), make_seq("b", list(range(100, 112)))
    sched.add(a)
    sched.add(b)
    plan1 = sched.schedule()  # a: 2 blocks, b: 3 blocks; full
    land(sched, plan1)
    plan2 = sched.schedule()  # a needs a third block: b (newest) is preempted; its step-1 blocks are cached
    assert layout(plan2) == [("a", 8, 1, True)] and b.status == SeqStatus.WAITING
    stale = StepPlan([plan1.chunks[1]])
    sched.on_step_processed(stale)  # b's old chunk arriving late must not commit b's (now empty) table
    assert b.num_committed_blocks == 0
    sched.blocks.check_integrity([a, b])


def test_a_preempted_sequence_recomputes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=6)  # 5 usable
    a, b = make_seq("a", list(range(8))), make_seq("b", list(range(100, 111)))
    sched.add(a)
    sched.add(b)
    land(sched, sched.schedule())  # a: 2 blocks, b: 3 blocks (2 full, committed); the cache is full
    plan = sched.schedule()  # a needs a third block: b is preempted, its full blocks stay cached
    assert layout(plan) == [("a", 8, 1, True)] and b.status == SeqStatus.WAITING
    land(sched, plan)
    sched.finish(a)
    hits_before = sched.blocks.num_cache_hits
    plan = sched.schedule()
    # b's 11 prompt tokens + 1 output: its 2 full blocks come back from the cache, 4 tokens are computed.
    assert layout(plan) == [("b", 8, 4, True)]
    assert sched.blocks.num_cache_hits - hits_before == 8
    assert b.num_cached_tokens == 0, "cached_tokens counts the first admission's hits only"
    sched.blocks.check_integrity([b])


# -- parallel samples ------------------------------------------------------------------------------
def test_followers_wait_for_the_leaders_prompt_then_share_its_full_blocks():
    sched = make_scheduler(budget=8, enable_prefix_caching=False)
    prompt = list(range(14))
    group = [make_seq("g", prompt, sample_index=i) for i in range(3)]
    sched.add_group(group)
    assert sched.has_unfinished() and list(sched.waiting) == [group[0]]
    plan1 = sched.schedule()
    plan2 = sched.schedule()  # async: the leader's last prompt chunk is launched, nothing processed
    assert layout(plan1) == [("g", 0, 8, False)] and layout(plan2) == [("g", 8, 6, True)]
    land(sched, plan1)
    assert list(sched.waiting) == [], "followers wait for the whole prompt"
    land(sched, plan2)
    assert list(sched.waiting) == group[1:]
    plan3 = sched.schedule()
    # Each follower shares the 3 full prompt blocks and computes the partial fourth (tokens 12, 13).
    assert layout(plan3) == [("g", 14, 1, True), ("g", 12, 2, True), ("g", 12, 2, True)]
    leader = group[0]
    for f in group[1:]:
        assert f.block_table[:3] == leader.block_table[:3] and f.block_table[3] != leader.block_table[3]
        assert f.num_cached_tokens == 12
    assert [sched.blocks.ref_counts[b] for b in leader.block_table[:4]] == [3, 3, 3, 1]
    sched.blocks.check_integrity(group)
    for seq in group:
        sched.finish(seq)
    assert not sched.has_unfinished()
    sched.blocks.check_integrity([])


def test_finishing_a_group_before_its_prompt_is_written_leaves_nothing_behind():
    sched = make_scheduler(budget=8)
    group = [make_seq("g", list(range(14)), sample_index=i) for i in range(3)]
    sched.add_group(group)
    sched.schedule()
    sched.finish(group[2])  # a waiting follower
    sched.finish(group[0])  # the leader: the remaining follower is queued to compute the prompt itself
    assert list(sched.waiting) == [group[1]]
    plan = sched.schedule()
    assert layout(plan) == [("g", 0, 8, False)]
    sched.finish(group[1])
    assert not sched.has_unfinished()
    sched.blocks.check_integrity([])


@pytest.mark.parametrize("prompt_len", [1, 4, 5])
def test_short_prompts_fork_at_most_their_full_blocks(prompt_len):
    sched = make_scheduler()
    group = [make_seq("g", list(range(prompt_len)), sample_index=i) for i in range(2)]
    sched.add_group(group)
    land(sched, sched.schedule())
    plan = sched.schedule()
    shared = (prompt_len - 1) // BS * BS
    assert layout(plan) == [("g", prompt_len, 1, True), ("g", shared, prompt_len - shared, True)]
