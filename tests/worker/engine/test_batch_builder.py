"""BatchBuilder: the flattened ragged batch a step plan becomes in an IO slot's host arrays, the
carry-over map for tokens still in flight, and CUDA-graph bucket padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine.api import SamplingParams
from worker.engine.batch import BatchBuilder
from worker.engine.block_manager import BlockManager
from worker.engine.describe import describe_step
from worker.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from worker.engine.sequence import Sequence

BS = 4
CPU = torch.device("cpu")


def make_builder(graph_buckets: tuple[int, ...] = (), max_num_seqs: int = 16) -> BatchBuilder:
    return BatchBuilder(
        64, max_num_seqs, max_blocks_per_seq=8, block_size=BS, device=CPU, graph_buckets=graph_buckets
    )


def make_seq(request_id, prompt_ids, output_ids=(), block_table=(), seed=0, **sampling) -> Sequence:
    params = SamplingParams(**sampling).with_defaults({}, rest_of_context=16)  # as the engine admits it
    seq = Sequence(request_id, list(prompt_ids), params, seed=seed)
    seq.output_ids = list(output_ids)
    seq.block_table = list(block_table)
    return seq


def build(builder: BatchBuilder, plan: StepPlan, slot: int, prev_rows: dict[Sequence, int]):
    """The plan's description (what the runner gets) built into `slot`."""
    return builder.build(describe_step(plan, prev_rows)[0], slot)


def ints(array: np.ndarray, n: int) -> list[int]:
    return array[:n].tolist()


@pytest.fixture
def mixed_plan():
    """A decode, a middle prefill chunk (no sample) and a whole short prompt, over scattered blocks."""
    a = make_seq("a", [10, 11, 12, 13, 14], [15], block_table=[7, 3], seed=5, temperature=0.5, top_k=3)
    b = make_seq("b", list(range(20, 30)), block_table=[5, 8], seed=6)
    c = make_seq("c", [30, 31, 32], block_table=[2], seed=9, temperature=0.7, top_p=0.8)
    plan = StepPlan(
        [ScheduledChunk(a, 5, 1, True), ScheduledChunk(b, 4, 3, False), ScheduledChunk(c, 0, 3, True)]
    )
    return plan, (a, b, c)


def test_mixed_plan_host_arrays(mixed_plan):
    plan, (a, b, c) = mixed_plan
    builder = make_builder()
    meta = build(builder, plan, 0, prev_rows={})
    h = builder.slots[0].host
    assert ints(h["input_ids"], 7) == [15, 24, 25, 26, 30, 31, 32]
    assert ints(h["positions"], 7) == [5, 4, 5, 6, 0, 1, 2]
    # slot = block_table[pos // bs] * bs + pos % bs
    assert ints(h["slot_mapping"], 7) == [
        3 * 4 + 1,
        8 * 4 + 0,
        8 * 4 + 1,
        8 * 4 + 2,
        2 * 4 + 0,
        2 * 4 + 1,
        2 * 4 + 2,
    ]
    assert ints(h["carry_src"], 7) == [-1] * 7
    assert ints(h["cu_seqlens_q"], 4) == [0, 1, 4, 7]
    assert ints(h["context_lens"], 3) == [6, 7, 3]
    assert h["block_tables"][0, :2].tolist() == [7, 3]
    assert h["block_tables"][1, :2].tolist() == [5, 8]
    assert h["block_tables"][2, :1].tolist() == [2]
    # One sampling row per sampling chunk, in order: a's only token and c's last token.
    assert ints(h["logits_indices"], 2) == [0, 6]
    assert h["temperature"][:2].tolist() == pytest.approx([0.5, 0.7])
    assert h["top_p"][:2].tolist() == pytest.approx([1.0, 0.8])
    assert ints(h["top_k"], 2) == [3, 0]
    assert ints(h["seeds"], 2) == [5, 9]
    assert ints(h["sample_positions"], 2) == [6, 3]  # position of the token being sampled
    assert (meta.slot, meta.num_tokens, meta.num_seqs, meta.num_real_seqs, meta.num_sample_rows) == (
        0,
        7,
        3,
        3,
        2,
    )
    assert (meta.max_query_len, meta.max_context_len) == (3, 7)
    assert not meta.is_decode_only and meta.any_random and meta.any_top_k_top_p and not meta.has_carry


def test_slot_mapping_formula_on_scheduler_plans():
    """Plans from the real scheduler (chunked prefill, decodes): every token's slot follows its block table."""
    blocks = BlockManager(40, BS)
    sched = Scheduler(blocks, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    seqs = [make_seq(f"s{i}", list(range(n))) for i, n in enumerate([3, 9, 14, 1, 6])]
    for seq in seqs:
        sched.add(seq)
    builder = make_builder()
    for step in range(8):
        plan = sched.schedule()
        meta = build(builder, plan, step % 2, prev_rows={})
        h = builder.slots[step % 2].host
        t = 0
        for b, chunk in enumerate(plan.chunks):
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                table = chunk.seq.block_table
                assert h["positions"][t] == pos
                assert h["slot_mapping"][t] == table[pos // BS] * BS + pos % BS
                t += 1
            assert h["cu_seqlens_q"][b + 1] == t
            assert h["context_lens"][b] == chunk.start + chunk.num_tokens
            assert h["block_tables"][b, : len(chunk.seq.block_table)].tolist() == chunk.seq.block_table
        assert meta.num_tokens == t == plan.num_tokens
        rows = [int(h["cu_seqlens_q"][b + 1]) - 1 for b, c in enumerate(plan.chunks) if c.samples]
        assert ints(h["logits_indices"], len(rows)) == rows and meta.num_sample_rows == len(rows)
        for chunk in plan.sampling_chunks():  # land the tokens, as the engine would
            sched.on_token(chunk.seq)
            chunk.seq.output_ids.append(1)
    blocks.check_integrity(seqs)


def test_in_flight_decode_input_is_carried_over_from_the_previous_step():
    builder = make_builder()
    a = make_seq("a", [1, 2, 3, 4, 5], block_table=[4, 6])  # its 6th token is still being sampled
    a.num_inflight_samples = 1
    b = make_seq("b", [7, 8], [9], block_table=[1])  # its newest token is known
    c = make_seq("c", [1, 2, 3], block_table=[2])
    plan = StepPlan(
        [ScheduledChunk(a, 5, 1, True), ScheduledChunk(c, 0, 3, True), ScheduledChunk(b, 2, 1, True)]
    )
    meta = build(builder, plan, 1, prev_rows={a: 2, b: 0})
    h = builder.slots[1].host
    assert ints(h["input_ids"], 5) == [0, 1, 2, 3, 9]  # placeholder 0 for a's in-flight token
    assert ints(h["carry_src"], 5) == [2, -1, -1, -1, -1]  # b's token is known: no carry even though listed
    assert meta.has_carry
    # The next build into the same slot has no carry: stale entries must be cleared.
    plan = StepPlan([ScheduledChunk(c, 3, 1, True)])
    c.output_ids = [5]
    meta = build(builder, plan, 1, prev_rows={})
    assert ints(h["carry_src"], 1) == [-1] and ints(h["input_ids"], 1) == [5] and not meta.has_carry


def test_in_flight_token_without_a_source_row_is_an_error():
    builder = make_builder()
    a = make_seq("a", [1, 2, 3], block_table=[1])
    a.num_inflight_samples = 1
    with pytest.raises(AssertionError, match="only a decode's single input token can be in flight"):
        build(builder, StepPlan([ScheduledChunk(a, 3, 1, True)]), 0, prev_rows={})


def test_decode_only_plan_is_padded_to_the_graph_bucket():
    builder = make_builder(graph_buckets=(8, 4))
    # First fill the slot with a wider batch, so stale values would show in the padding rows.
    wide = [make_seq(f"w{i}", [i + 1] * 6, block_table=[i + 1, i + 9], temperature=0.9) for i in range(6)]
    build(builder, StepPlan([ScheduledChunk(s, 0, 6, True) for s in wide]), 0, prev_rows={})
    seqs = [make_seq(f"s{i}", [1] * (3 + i), [40 + i], block_table=[10 + i, 20 + i]) for i in range(3)]
    plan = StepPlan([ScheduledChunk(s, s.num_prompt_tokens, 1, True) for s in seqs])
    meta = build(builder, plan, 0, prev_rows={})
    h = builder.slots[0].host
    assert (meta.num_seqs, meta.num_tokens, meta.num_real_seqs, meta.num_sample_rows) == (4, 4, 3, 4)
    assert meta.is_decode_only and not meta.any_random
    assert ints(h["input_ids"], 4) == [40, 41, 42, 0]
    assert ints(h["positions"], 4) == [3, 4, 5, 0]
    assert ints(h["slot_mapping"], 4) == [
        10 * 4 + 3,
        21 * 4 + 0,
        22 * 4 + 1,
        0,
    ]  # padding writes the scratch block
    assert ints(h["cu_seqlens_q"], 5) == [0, 1, 2, 3, 4]
    assert ints(h["context_lens"], 4) == [4, 5, 6, 0]
    assert h["block_tables"][3, 0] == 0
    assert ints(h["logits_indices"], 4) == [0, 1, 2, 3]
    assert h["temperature"][:4].tolist() == [0.0] * 4, "padding rows must sample greedily"
    assert ints(h["carry_src"], 4) == [-1] * 4


def test_bucket_choice_and_no_padding_for_mixed_steps():
    builder = make_builder(graph_buckets=(4, 8))
    assert [builder.bucket_for(n) for n in (1, 3, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, None]
    decodes = [make_seq(f"s{i}", [1, 2], [3], block_table=[i + 1]) for i in range(5)]
    meta = build(builder, StepPlan([ScheduledChunk(s, 2, 1, True) for s in decodes]), 0, prev_rows={})
    assert (meta.num_seqs, meta.num_tokens, meta.num_sample_rows) == (8, 8, 8)
    assert ints(builder.slots[0].host["context_lens"], 8) == [3] * 5 + [0] * 3
    # A step with a prefill chunk is never padded (no graph replay for it).
    prefill = make_seq("p", [1, 2], block_table=[9])
    plan = StepPlan([ScheduledChunk(decodes[0], 2, 1, True), ScheduledChunk(prefill, 0, 2, True)])
    meta = build(builder, plan, 0, prev_rows={})
    assert (meta.num_seqs, meta.num_tokens, meta.num_sample_rows) == (2, 3, 2) and not meta.is_decode_only
    # Without buckets (CPU), decode-only steps are not padded either.
    meta = build(make_builder(), StepPlan([ScheduledChunk(s, 2, 1, True) for s in decodes[:3]]), 0, {})
    assert (meta.num_seqs, meta.num_sample_rows) == (3, 3)


def test_the_two_slots_are_independent_buffers(mixed_plan):
    plan, _ = mixed_plan
    builder = make_builder()
    s0, s1 = builder.slots
    build(builder, plan, 0, prev_rows={})
    before = {name: array.copy() for name, array in s0.host.items()}
    other = make_seq("o", [99, 98], block_table=[11], temperature=1.0, seed=3)
    build(builder, StepPlan([ScheduledChunk(other, 0, 2, True)]), 1, prev_rows={})
    for name, array in s0.host.items():
        np.testing.assert_array_equal(
            array, before[name], err_msg=f"slot 0 {name} changed by a build into slot 1"
        )
    assert ints(s1.host["input_ids"], 2) == [99, 98]
    for name in s0.host:
        assert not np.shares_memory(s0.host[name], s1.host[name]), name
        assert s0.dev[name].data_ptr() != s1.dev[name].data_ptr(), name
    assert s0.sampled_host.data_ptr() != s1.sampled_host.data_ptr()


def test_fields_of_a_slot_do_not_overlap_and_device_views_match_host_offsets(mixed_plan):
    plan, _ = mixed_plan
    builder = make_builder()
    slot = builder.slots[0]
    names = list(slot.host)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            assert not np.shares_memory(slot.host[x], slot.host[y]), (x, y)
    build(builder, plan, 0, prev_rows={})
    slot.int_dev.copy_(slot.int_host)
    slot.float_dev.copy_(slot.float_host)
    slot.tables_dev.copy_(slot.tables_host)
    for name in names:
        np.testing.assert_array_equal(slot.dev[name].numpy(), slot.host[name], err_msg=name)


def test_block_table_rows_follow_appends_replacements_and_row_changes():
    """A slot copies only the new entries of a row whose block-table list it copied before; a list the block
    manager replaced (preemption frees it, re-admission builds a new one, perhaps as long), a sequence that
    moved to another row and graph-padding rows are written whole."""
    builder = make_builder(graph_buckets=(4,))
    a = make_seq("a", [1, 2, 3], [4], block_table=[7])
    b = make_seq("b", [5, 6, 7], [8], block_table=[9])

    def build_tables(*seqs):
        chunks = [ScheduledChunk(s, len(s.prompt_ids) + len(s.output_ids) - 1, 1, True) for s in seqs]
        build(builder, StepPlan(chunks), 0, prev_rows={})
        return builder.slots[0].host["block_tables"]

    tables = build_tables(a, b)
    assert tables[0, :1].tolist() == [7] and tables[1, :1].tolist() == [9]
    assert tables[2, 0] == 0 and tables[3, 0] == 0  # padding rows: the scratch block
    a.block_table.append(11)  # a decode crossed a block boundary: the same list, one entry longer
    a.output_ids += [5, 6, 7, 8]
    tables = build_tables(a, b)
    assert tables[0, :2].tolist() == [7, 11] and tables[1, :1].tolist() == [9]
    a.block_table = [12, 13]  # preempted and re-admitted on other blocks: a new list of the same length
    tables = build_tables(a, b)
    assert tables[0, :2].tolist() == [12, 13]
    tables = build_tables(b, a)  # a finished sequence before them: rows shift
    assert tables[0, :1].tolist() == [9] and tables[1, :2].tolist() == [12, 13]
    tables[2, 0] = 99  # scribble a padding row; the next build writes the scratch block again
    c = make_seq("c", [1], [2], block_table=[14])
    tables = build_tables(b, a, c)
    assert tables[2, :1].tolist() == [14] and tables[3, 0] == 0
    tables = build_tables(b, a)
    assert tables[2, 0] == 0, "a row that became padding is not left with c's block"
    tables = build_tables(b, a, c)
    assert tables[2, :1].tolist() == [14], "c's row is rewritten after padding overwrote it"


def test_a_failed_block_table_write_forgets_the_slots_rows():
    builder = make_builder()
    a = make_seq("a", [1, 2, 3], [4], block_table=[7])
    c = make_seq("c", [1, 2, 3], [4], block_table=[8])
    bad = make_seq("bad", [1, 2, 3], [4], block_table=[2**40])  # does not fit the int32 table
    build(builder, StepPlan([ScheduledChunk(a, 3, 1, True)]), 0, prev_rows={})
    # c's table goes into row 0, then bad's fails in row 1: the slot must not still believe row 0 holds a's
    with pytest.raises(OverflowError):
        build(builder, StepPlan([ScheduledChunk(c, 3, 1, True), ScheduledChunk(bad, 3, 1, True)]), 0, prev_rows={})
    build(builder, StepPlan([ScheduledChunk(a, 3, 1, True)]), 0, prev_rows={})
    assert builder.slots[0].host["block_tables"][0, 0] == 7, "row 0 was rewritten, not trusted from before"


def test_block_table_rows_match_a_full_rewrite_over_random_steps():
    """Against writing every row whole: random batches (sequences join, finish, reorder), tables that grow or are
    replaced, graph padding, and a failed write now and then."""
    import random

    from worker.engine.batch import IOSlot

    rng = random.Random(0)
    slot = IOSlot(max_num_tokens=64, max_num_seqs=12, max_blocks_per_seq=40, device=CPU)
    host = slot.host["block_tables"]
    pool = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 8))] for _ in range(20)]
    for step in range(400):
        for i in rng.sample(range(len(pool)), 5):
            if rng.random() < 0.2:
                pool[i] = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 8))]  # freed, then re-admitted
            elif len(pool[i]) < 40:
                pool[i].append(rng.randrange(1, 1000))  # a new block
        tables = rng.sample(pool, rng.randrange(0, 11))
        num_rows = len(tables) + rng.randrange(0, 2)
        if step % 37 == 5 and tables:
            with pytest.raises(OverflowError):
                slot.write_block_tables([*tables, [2**40]], num_rows + 1)
            host[: len(tables) + 1] = -7  # whatever a half-done write left
        slot.write_block_tables(tables, num_rows)
        for b, table in enumerate(tables):
            assert host[b, : len(table)].tolist() == table, (step, b)
        assert (host[len(tables) : num_rows, 0] == 0).all(), step
