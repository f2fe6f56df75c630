"""Prompt logprobs (prompt_logprobs.py): every prompt token's logprob, rank and top-k equal log_softmax of a
transformers forward over the prompt (fp32, CPU, within 1e-4), with the first entry None; through both decoders,
sync and async, with chunked prefill, a prefix-cache hit, preemption, `n` > 1 and max_new_tokens 0; requests
that do not ask are unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine import scheduler as scheduler_module
from worker.engine.api import EngineRequest, EngineResult, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model


@pytest.fixture(scope="module")
def llama():
    """The engine's own tiny-llama; the reference runs on the shared, untouched instance (same weights)."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def prompt(seed: int, length: int, bos: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [bos] + [rng.randrange(3, 256) for _ in range(length - 1)]


def reference(ref_model, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the prompt: row q is the distribution of token q + 1."""
    with torch.no_grad():
        logits = ref_model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(ref_model, req: EngineRequest, result: EngineResult) -> None:
    assert result.finish_reason != FinishReason.ERROR, result.error
    k = req.sampling.prompt_logprobs
    assert k is not None
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(req.prompt_ids), req.request_id
    assert entries[0] is None
    expected = reference(ref_model, req.prompt_ids)
    for p, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        row = expected[p - 1]
        assert entry.token_id == req.prompt_ids[p]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4, (req.request_id, p)
        # rank: 1 + tokens more likely (within the tolerance, so near-ties may count either way)
        lo, hi = (row > row[entry.token_id] + 1e-4).sum().item() + 1, (row > row[entry.token_id] - 1e-4).sum().item()
        assert lo <= entry.rank <= max(lo, hi), (req.request_id, p, entry.rank, lo, hi)
        assert len(entry.top) == k
        if k:
            values, ids = row.topk(k)
            assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=1e-4)
            for (token, value), ref_id in zip(entry.top, ids.tolist(), strict=True):
                assert token == ref_id or abs(value - row[ref_id].item()) < 1e-4  # a near-tie may swap


def run(llama, reqs: list[EngineRequest], **config) -> dict[str, EngineResult]:
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(**{"num_kv_blocks": 256, **config}))
    return {r.request_id: r for r in engine.generate(reqs)}


def scoring_requests() -> list[EngineRequest]:
    return [
        EngineRequest("k0", prompt(1, 37), SamplingParams(5, prompt_logprobs=0)),
        EngineRequest("k3", prompt(2, 70), SamplingParams(5, prompt_logprobs=3, logprobs=2)),
        EngineRequest("k20", prompt(3, 20), SamplingParams(3, temperature=1.0, seed=1, prompt_logprobs=20)),
        EngineRequest("plain", prompt(4, 33), SamplingParams(6)),
        EngineRequest("one_token", [1], SamplingParams(2, prompt_logprobs=4)),
    ]


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prompt_logprobs_equal_a_transformers_forward(llama, tiny_models, mode, decoder):
    ref_model, _ = tiny_models("tiny-llama")
    reqs = scoring_requests()
    results = run(llama, reqs, mode=mode, decoder=decoder)
    for req in reqs:
        if req.sampling.prompt_logprobs is None:
            assert results[req.request_id].prompt_logprobs is None
        else:
            check_prompt_logprobs(ref_model, req, results[req.request_id])
    assert results["one_token"].prompt_logprobs == [None]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunked_prefill_and_a_small_row_bound(llama, tiny_models, mode, monkeypatch):
    """Chunks of 16 tokens, and at most 5 prompt rows a step: the entries accumulate across chunks, once each."""
    ref_model, _ = tiny_models("tiny-llama")
    monkeypatch.setattr(scheduler_module, "MAX_ROWS_PER_STEP", 5)
    reqs = scoring_requests()
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=256, max_num_batched_tokens=16))
    real_launch, rows_per_step = engine.runner.launch, []

    def launch(step):
        rows_per_step.append(step.prompt_rows.num_rows if step.prompt_rows else 0)
        return real_launch(step)

    engine.runner.launch = launch
    results = {r.request_id: r for r in engine.generate(reqs)}
    # a chunk of one token is not shortened (the bound is soft by one row)
    assert max(rows_per_step) <= 6 and sum(rows_per_step) == 36 + 69 + 19
    for req in reqs:
        if req.sampling.prompt_logprobs is not None:
            check_prompt_logprobs(ref_model, req, results[req.request_id])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cached_prefix_still_returns_its_logprobs(llama, tiny_models, mode):
    """The prompt's blocks are cached by an earlier request: a request that wants prompt logprobs computes them
    again (cached_tokens 0) and gets every entry; one that does not reuses them as before."""
    ref_model, _ = tiny_models("tiny-llama")
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=256))
    ids = prompt(5, 90)
    [warm] = engine.generate([EngineRequest("warm", ids, SamplingParams(2))])
    scored = EngineRequest("scored", ids, SamplingParams(2, prompt_logprobs=2))
    [again] = engine.generate([scored])
    check_prompt_logprobs(ref_model, scored, again)
    assert again.usage.cached_tokens == 0
    assert again.token_ids == warm.token_ids
    [plain] = engine.generate([EngineRequest("plain", ids, SamplingParams(2))])
    assert plain.usage.cached_tokens == 80  # five full blocks of 16, from the cache


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preemption_recompute_does_not_duplicate_entries(llama, tiny_models, mode):
    ref_model, _ = tiny_models("tiny-llama")
    model, tok = llama
    reqs = [
        EngineRequest(f"r{i}", prompt(10 + i, 40 + 7 * i), SamplingParams(30, ignore_eos=True, prompt_logprobs=1))
        for i in range(6)
    ]
    engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=24, max_num_batched_tokens=32))
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert engine.stats().num_preemptions > 0
    for req in reqs:
        check_prompt_logprobs(ref_model, req, results[req.request_id])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_max_new_tokens_zero_scores_the_prompt_only(llama, tiny_models, mode):
    ref_model, _ = tiny_models("tiny-llama")
    reqs = [
        EngineRequest("score", prompt(6, 50), SamplingParams(0, prompt_logprobs=1)),
        EngineRequest("score_n2", prompt(7, 30), SamplingParams(0, prompt_logprobs=0), n=2),
        EngineRequest("gen", prompt(8, 12), SamplingParams(4)),
    ]
    results = run(llama, reqs, mode=mode, max_num_batched_tokens=24)
    for req in reqs[:2]:
        r = results[req.request_id]
        assert (r.finish_reason, r.token_ids, r.text, r.usage.completion_tokens) == (FinishReason.LENGTH, [], "", 0)
        check_prompt_logprobs(ref_model, req, r)
    assert len(results["score_n2"].all_samples) == 2
    assert len(results["gen"].token_ids) == 4


def test_parallel_samples_share_one_list(llama, tiny_models):
    ref_model, _ = tiny_models("tiny-llama")
    req = EngineRequest("n3", prompt(9, 45), SamplingParams(5, temperature=1.0, seed=2, prompt_logprobs=2), n=3)
    r = run(llama, [req])["n3"]
    check_prompt_logprobs(ref_model, req, r)
    assert len(r.samples) == 3


def test_requests_that_do_not_ask_are_unchanged(llama):
    plain = [
        EngineRequest(f"p{i}", prompt(20 + i, 10 + 9 * i), SamplingParams(8, temperature=0.8, seed=i, logprobs=1))
        for i in range(4)
    ]
    scoring = [EngineRequest("s", prompt(30, 60), SamplingParams(8, prompt_logprobs=5))]
    alone = run(llama, plain)
    mixed = run(llama, plain + scoring)
    for req in plain:
        a, b = alone[req.request_id], mixed[req.request_id]
        assert (a.token_ids, a.prompt_logprobs, b.prompt_logprobs) == (b.token_ids, None, None)
        # the values within float rounding: another batch composition may round the last bits otherwise
        assert all(abs(x.logprob - y.logprob) < 1e-5 for x, y in zip(a.logprobs, b.logprobs, strict=True))


def test_prompt_logprobs_bound_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)


def test_record_keeps_each_position_once():
    from worker.engine.api import PromptLogprob
    from worker.engine.prompt_logprobs import record

    def entries(first: int, num: int) -> list[PromptLogprob]:
        return [PromptLogprob(p, -float(p), 1) for p in range(first, first + num)]

    known: list = [None]
    record(known, 1, entries(1, 4))  # positions 1..4
    record(known, 3, entries(3, 4))  # a recompute from position 3: 3 and 4 are dropped
    assert [e.token_id for e in known[1:]] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(AssertionError, match="arrived before"):
        record(known, 9, entries(9, 1))  # a gap is a bug, never silently kept


def test_description_names_the_rows_not_recorded_yet():
    """Rows score positions the sequence lacks, within the chunk, up to the prompt's second-to-last position."""
    from worker.engine.describe import describe_step
    from worker.engine.scheduler import ScheduledChunk, StepPlan
    from worker.engine.sequence import Sequence

    def seq(name: str, ids: list[int], k: int | None) -> Sequence:
        s = Sequence(name, ids, SamplingParams(4, prompt_logprobs=k).with_defaults({}, 64), seed=0)
        s.prompt_logprobs = [None] if k is not None else []
        return s

    a, b, c = seq("a", list(range(100, 110)), 2), seq("b", list(range(200, 206)), None), seq("c", list(range(300, 308)), 0)
    c.prompt_logprobs += [None] * 4  # positions 1..4 recorded already (a recompute after preemption)
    plan = StepPlan([ScheduledChunk(a, 4, 6, True), ScheduledChunk(b, 0, 6, True), ScheduledChunk(c, 0, 6, False)])
    step, _ = describe_step(plan, {}, prompt_logprobs=True)
    rows = step.prompt_rows
    assert rows is not None
    # a: positions 4..8 score tokens 5..9 (position 9 is the sample row); c: positions 4, 5 score tokens 5, 6
    assert rows.token_indices == (0, 1, 2, 3, 4, 16, 17)
    assert rows.target_ids == (105, 106, 107, 108, 109, 305, 306)
    assert [(g.seq_index, g.first_position, g.num_rows, g.num_top) for g in rows.groups] == [(0, 5, 5, 2), (2, 5, 2, 0)]
    assert describe_step(plan, {}, prompt_logprobs=False)[0].prompt_rows is None


def test_rows_in_flight_at_a_preemption_are_recorded_once(llama, tiny_models, monkeypatch):
    """Async mode with the CPU runner computing at `wait`, as a GPU does: a sequence preempted while its prompt
    rows are in flight computes some of them again; each position keeps one entry, and the values are right."""
    from worker.engine import engine as engine_module
    from worker.engine.prompt_logprobs import record

    from .test_engine_prefix_cache import defer_compute

    ref_model, _ = tiny_models("tiny-llama")
    model, tok = llama
    dropped = []

    def counting_record(known, first_position, entries):
        dropped.append(max(0, len(known) - first_position))
        record(known, first_position, entries)

    monkeypatch.setattr(engine_module, "record_prompt_logprobs", counting_record)
    rng = random.Random(14)
    reqs = [
        EngineRequest(
            f"r{i}", [1] + [rng.randrange(3, 256) for _ in range(30 + 11 * i)],
            SamplingParams(20, ignore_eos=True, prompt_logprobs=1),
        )
        for i in range(6)
    ]  # fmt: skip
    engine = Engine(model, tok, EngineConfig(mode="async", num_kv_blocks=14, max_num_batched_tokens=24))
    violations = defer_compute(engine)
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert not violations and engine.stats().num_preemptions > 0
    assert sum(dropped) > 0  # positions computed twice reached the record, which kept the first
    for req in reqs:
        check_prompt_logprobs(ref_model, req, results[req.request_id])


@pytest.mark.parametrize("family", ["tiny-gemma2", "tiny-qwen3", "tiny-phi3"])
def test_other_families_through_the_owned_decoder(tiny_models, family):
    """Soft-capped (Gemma 2), q/k-normed (Qwen3) and fused-projection (Phi-3) logits score the prompt alike."""
    ref_model, _ = tiny_models(family)
    model, tok = load_model(family, torch.device("cpu"), torch.float32)
    req = EngineRequest("r", prompt(40, 45, bos=tok.bos_token_id or 1), SamplingParams(3, prompt_logprobs=3))
    engine = Engine(model, tok, EngineConfig(decoder="owned", num_kv_blocks=64, max_num_batched_tokens=16))
    [result] = engine.generate([req])
    check_prompt_logprobs(ref_model, req, result)
