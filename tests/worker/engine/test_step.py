"""The step description (step.py, describe.py): plain values only, pickle-able, and what the batch builder
writes from it equals what it writes from the same description after a pickle round trip (what another
tensor-parallel rank would receive)."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from worker.engine.api import SamplingParams
from worker.engine.batch import BatchBuilder
from worker.engine.describe import describe_step
from worker.engine.scheduler import ScheduledChunk, StepPlan
from worker.engine.sequence import Sequence
from worker.engine.step import StepDescription, TokenBan


def make_seq(request_id, prompt_ids, output_ids=(), block_table=(), **sampling) -> Sequence:
    seq = Sequence(request_id, list(prompt_ids), SamplingParams(**sampling).with_defaults({}, 64), seed=3)
    seq.output_ids = list(output_ids)
    seq.block_table = list(block_table)
    return seq


def _plain(value, path="step") -> None:
    """Fails if anything reachable from `value` is not a plain value (a Sequence, a scheduler...)."""
    if isinstance(value, (int, float, str, bool, type(None), np.ndarray, np.generic)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _plain(item, f"{path}[{i}]")
        return
    if hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _plain(getattr(value, name), f"{path}.{name}")
        return
    raise AssertionError(f"{path} is a {type(value).__name__}, not a plain value")


def test_description_is_plain_and_pickles_to_the_same_batch():
    a = make_seq("a", [1, 2, 3, 4, 5], block_table=[4, 6], temperature=0.5, top_k=3, min_p=0.1, logprobs=2)
    a.num_inflight_samples = 1  # its 6th token is still being sampled by the step in flight
    b = make_seq("b", [7, 8], [9], block_table=[1], presence_penalty=1.0, repetition_penalty=1.2)
    c = make_seq("c", list(range(10, 20)), block_table=[2, 3, 5])
    plan = StepPlan([ScheduledChunk(a, 5, 1, True), ScheduledChunk(b, 2, 1, True), ScheduledChunk(c, 4, 4, False)])
    b.num_inflight_samples = c.num_inflight_samples = 0
    a.num_inflight_samples, b.num_inflight_samples = 2, 1  # as the scheduler leaves them after this plan
    step, rows = describe_step(plan, {a: 1}, frozenset({99}), extras=True)
    _plain(step)
    assert rows == {a: 0, b: 1}
    assert (step.carry_seqs, step.carry_rows, step.input_ids) == ([0], [1], [0, 9, 14, 15, 16, 17])
    assert step.min_p == [0.1, 0.0] and step.top_k == [3, 0] and step.temperature == [0.5, 0.0]
    assert step.extras is not None and step.extras.logprob_rows == (0,) and step.extras.num_top_logprobs == 2
    (penalty,) = step.extras.penalty_rows
    assert (penalty.row, penalty.repetition, penalty.prompt_ids, penalty.input_is_generated) == (1, 1.2, (7, 8), True)
    copy = pickle.loads(pickle.dumps(step))
    assert isinstance(copy, StepDescription)
    hosts = []
    for description in (step, copy):
        builder = BatchBuilder(32, 8, 4, 4, torch.device("cpu"))
        meta = builder.build(description, 0)
        hosts.append((meta, {k: v.copy() for k, v in builder.slots[0].host.items()}))
    (meta0, host0), (meta1, host1) = hosts
    assert meta0 == meta1 and meta0.has_carry and meta0.any_min_p
    for name in host0:
        assert np.array_equal(host0[name], host1[name]), name
    assert host0["carry_src"][:6].tolist() == [1, -1, -1, -1, -1, -1]


def test_only_describes_one_sequence_alone():
    a = make_seq("a", [1, 2, 3], [4], block_table=[7], temperature=1.0)
    b = make_seq("b", list(range(10, 16)), block_table=[5, 8])
    c = make_seq("c", [5, 6], block_table=[9], top_p=0.5)
    a.num_inflight_samples = 1
    plan = StepPlan([ScheduledChunk(a, 4, 1, True), ScheduledChunk(b, 0, 4, False), ScheduledChunk(c, 0, 2, True)])
    step, _ = describe_step(plan, {a: 0})
    alone = step.only(2)
    assert alone.input_ids == [5, 6] and alone.top_p == [0.5] and alone.block_tables == [[9]]
    assert step.only(1).input_ids == [10, 11, 12, 13] and step.only(1).num_sample_rows == 0
    first = step.only(0)
    assert (first.carry_seqs, first.carry_rows, first.is_decode_only) == ([0], [0], True)


def test_bad_words_and_min_tokens_become_bans():
    # generated so far: 40, 41 known, and the input token (the third) in flight
    seq = make_seq("s", [1, 2], [40, 41], block_table=[1], bad_words=(), min_tokens=5, stop_token_ids=(7,))
    seq.sampling = seq.sampling.__class__(**{**seq.sampling.__dict__, "bad_words_token_ids": (
        (50,), (41, 60, 61), (40, 60, 62), (60, 63))})  # fmt: skip
    seq.num_inflight_samples = 2  # the input token, and this step's sample
    plan = StepPlan([ScheduledChunk(seq, 4, 1, True)])
    step, _ = describe_step(plan, {seq: 0}, frozenset({99}), extras=True)
    assert step.extras is not None
    bans = set(step.extras.bans)
    assert TokenBan(0, 50) in bans  # one-token word: always
    assert TokenBan(0, 61, 60) in bans  # 41 ends the known output; banned if the input token is 60
    assert TokenBan(0, 63, 60) in bans
    assert not any(b.token_id == 62 for b in bans)  # 40 does not end the known output
    assert {TokenBan(0, 7), TokenBan(0, 99)} <= bans  # min_tokens: 3 generated before this sample, 5 asked
