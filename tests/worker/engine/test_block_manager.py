"""BlockManager: block tables grow by whole blocks, the scratch block is never handed out, and
`check_integrity` catches leaks, reference counts that disagree with the tables, and blocks both free
and owned. Prefix caching: see test_prefix_cache.py."""

from __future__ import annotations

import random

import pytest

from worker.engine.api import SamplingParams
from worker.engine.block_manager import NULL_BLOCK, BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(request_id: str, num_prompt: int = 1, max_new_tokens: int = 16) -> Sequence:
    return Sequence(
        request_id, list(range(num_prompt)), SamplingParams(max_new_tokens=max_new_tokens), seed=0
    )


def test_allocate_grows_block_table_by_ceil_tokens_over_block_size():
    blocks = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    seq = make_seq("a")
    for num_tokens in (1, 3, 4, 5, 8, 9, 16, 17, 30):
        blocks.allocate(seq, num_tokens)
        assert len(seq.block_table) == -(-num_tokens // BLOCK_SIZE), num_tokens
    assert blocks.num_free_blocks == 15 - 8
    # Fewer tokens than already covered never shrinks the table nor takes blocks.
    blocks.allocate(seq, 2)
    assert len(seq.block_table) == 8 and blocks.num_free_blocks == 7
    assert blocks.blocks_needed(seq, 32) == 0 and blocks.blocks_needed(seq, 33) == 1
    assert len(set(seq.block_table)) == 8, "a block was handed out twice"


def test_scratch_block_is_never_handed_out():
    blocks = BlockManager(num_blocks=9, block_size=BLOCK_SIZE)
    seqs = [make_seq(f"s{i}") for i in range(4)]
    for seq in seqs:
        blocks.allocate(seq, 2 * BLOCK_SIZE)
    owned = [b for seq in seqs for b in seq.block_table]
    assert sorted(owned) == list(range(1, 9)), "every usable block once, block 0 never"
    assert blocks.num_free_blocks == 0
    assert not blocks.can_allocate(make_seq("x"), 1)
    with pytest.raises(AssertionError, match="needs 1 blocks, 0 free"):
        blocks.allocate(make_seq("x"), 1)
    # Many random allocate / free rounds: block 0 still never appears.
    rng = random.Random(0)
    for _ in range(200):
        seq = rng.choice(seqs)
        if rng.random() < 0.5:
            blocks.free(seq)
        elif blocks.can_allocate(seq, len(seq.block_table) * BLOCK_SIZE + 1):
            blocks.allocate(seq, len(seq.block_table) * BLOCK_SIZE + 1)
        assert all(NULL_BLOCK not in s.block_table for s in seqs)
        blocks.check_integrity(seqs)


def test_free_returns_blocks_for_reuse():
    blocks = BlockManager(num_blocks=5, block_size=BLOCK_SIZE)
    a, b = make_seq("a"), make_seq("b")
    blocks.allocate(a, 9)  # 3 blocks
    taken = list(a.block_table)
    assert blocks.num_free_blocks == 1
    assert not blocks.can_allocate(b, 5)
    blocks.free(a)
    assert a.block_table == [] and blocks.num_free_blocks == blocks.num_usable_blocks == 4
    assert blocks.can_allocate(b, 16)
    blocks.allocate(b, 16)
    assert set(taken) <= set(b.block_table)
    blocks.check_integrity([a, b])


def test_check_integrity_passes_on_consistent_state():
    blocks = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    seqs = [make_seq(f"s{i}") for i in range(3)]
    blocks.check_integrity(seqs)
    for i, seq in enumerate(seqs):
        blocks.allocate(seq, 3 * i + 2)
    blocks.check_integrity(seqs)
    blocks.free(seqs[1])
    blocks.check_integrity(seqs)


@pytest.fixture
def two_owners():
    blocks = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = make_seq("a"), make_seq("b")
    blocks.allocate(a, 8)
    blocks.allocate(b, 4)
    blocks.check_integrity([a, b])
    return blocks, a, b


def test_check_integrity_detects_a_leaked_block(two_owners):
    blocks, a, b = two_owners
    a.block_table.pop()  # dropped without going back to the free list
    with pytest.raises(AssertionError, match="1 blocks leaked"):
        blocks.check_integrity([a, b])


def test_check_integrity_detects_a_sequence_missing_from_the_list(two_owners):
    blocks, a, b = two_owners
    with pytest.raises(AssertionError, match="1 blocks leaked"):
        blocks.check_integrity([a])  # b's block is owned by nobody the caller knows about


def test_check_integrity_detects_a_block_held_without_a_reference(two_owners):
    blocks, a, b = two_owners
    c = make_seq("c")
    c.block_table.append(a.block_table[0])  # shared without going through the block manager
    with pytest.raises(
        AssertionError, match=rf"block {a.block_table[0]}: ref count 1, held by 2 block tables"
    ):
        blocks.check_integrity([a, b, c])


def test_check_integrity_detects_a_block_both_free_and_owned(two_owners):
    blocks, a, b = two_owners
    kept = list(b.block_table)
    blocks.free(b)
    b.block_table = kept  # freed, but b still believes it owns it
    with pytest.raises(AssertionError, match=rf"blocks both free and owned: \[{kept[0]}\]"):
        blocks.check_integrity([a, b])


def test_a_double_free_is_caught(two_owners):
    blocks, a, b = two_owners
    kept = list(b.block_table)
    blocks.free(b)
    b.block_table = kept
    with pytest.raises(AssertionError, match=rf"b: block {kept[0]} freed twice"):
        blocks.free(b)


def test_check_integrity_detects_a_duplicate_in_the_free_list(two_owners):
    blocks, a, b = two_owners
    blocks._free.append(blocks._free[0])
    with pytest.raises(AssertionError, match="duplicate block in the free list"):
        blocks.check_integrity([a, b])


def test_check_integrity_detects_the_scratch_block_owned(two_owners):
    blocks, a, b = two_owners
    b.block_table.append(NULL_BLOCK)
    with pytest.raises(AssertionError, match="b owns the scratch block"):
        blocks.check_integrity([a, b])


def test_integrity_through_allocate_preempt_and_free():
    """Drive the scheduler over a cache far too small for its load; check integrity after every step."""
    blocks = BlockManager(num_blocks=12, block_size=BLOCK_SIZE)
    scheduler = Scheduler(blocks, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=44)
    rng = random.Random(1)
    seqs = [make_seq(f"s{i}", rng.randint(1, 20), rng.randint(1, 20)) for i in range(12)]
    for seq in seqs:
        scheduler.add(seq)
    num_steps = 0
    while scheduler.has_unfinished():
        num_steps += 1
        assert num_steps < 1000, "no progress"
        plan = scheduler.schedule()
        blocks.check_integrity(scheduler.running + list(scheduler.waiting))
        for chunk in plan.chunks:
            seq = chunk.seq
            assert len(seq.block_table) * BLOCK_SIZE >= chunk.start + chunk.num_tokens, "slots not reserved"
        for chunk in plan.sampling_chunks():
            seq = chunk.seq
            scheduler.on_token(seq)
            seq.output_ids.append(rng.randrange(256))
            if len(seq.output_ids) >= seq.sampling.max_new_tokens:
                scheduler.finish(seq)
                assert seq.block_table == []
        blocks.check_integrity(scheduler.running + list(scheduler.waiting))
    assert scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    assert all(len(s.output_ids) == s.sampling.max_new_tokens for s in seqs)
    blocks.check_integrity([])
    assert blocks.num_free_blocks == blocks.num_usable_blocks
