"""The engine's threaded API: start / add_request / get_results / abort / shutdown, request validation,
stats and usage accounting."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from worker.engine.api import EngineRequest, EngineResult, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

MODES = ["sync", "async"]
NUM_BLOCKS = 96  # a lone sequence may use 95 * 16 = 1520 > 1024 tokens: max_model_len stays 1024


@pytest.fixture(scope="module")
def llama():
    """This module's own tiny-llama (fp32, CPU): an Engine switches its model's attention to the paged
    kernel, so the shared `tiny_models` instances, which other tests run through HF generate, stay out."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def make_engine(llama, mode: str, **config) -> Engine:
    model, tok = llama
    return Engine(model, tok, EngineConfig(mode=mode, **{"num_kv_blocks": NUM_BLOCKS, **config}))


def small_requests(tok, num: int, max_new_tokens: int = 12, prefix: str = "r") -> list[EngineRequest]:
    return [
        EngineRequest(
            f"{prefix}{i}", tok.encode(f"request {i} " * (1 + i % 4)), SamplingParams(max_new_tokens)
        )
        for i in range(num)
    ]


def collect(engine: Engine, num: int, timeout: float = 30.0) -> dict[str, EngineResult]:
    results: dict[str, EngineResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < num:
        assert time.monotonic() < deadline, f"only {len(results)} of {num} results after {timeout} s"
        for res in engine.get_results(timeout=1.0):
            assert res.request_id not in results, f"two results for {res.request_id}"
            results[res.request_id] = res
    return results


def assert_all_blocks_free(engine: Engine) -> None:
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("mode", MODES)
def test_threaded_api_matches_generate(llama, mode):
    _, tok = llama
    reqs = small_requests(tok, 8)
    expected = {r.request_id: r.token_ids for r in make_engine(llama, mode).generate(reqs)}
    engine = make_engine(llama, mode)
    assert engine.num_unfinished() == 0 and engine.get_results() == []
    engine.add_request(reqs[0])  # counted at once, before the loop even runs
    assert engine.num_unfinished() == 1
    engine.start()
    try:
        adder = threading.Thread(target=lambda: [engine.add_request(r) for r in reqs[1:]])
        adder.start()
        adder.join()
        results = collect(engine, len(reqs))
        assert engine.num_unfinished() == 0
        assert engine.get_results(timeout=0.05) == [], "no extra results"
    finally:
        engine.shutdown()
    assert {rid: res.token_ids for rid, res in results.items()} == expected
    assert_all_blocks_free(engine)
    engine.start()
    with pytest.raises(RuntimeError, match="already started"):
        engine.start()
    with pytest.raises(RuntimeError, match="cannot run while the loop thread is started"):
        engine.generate(reqs[:1])
    engine.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_abort_running_request(llama, mode):
    _, tok = llama
    engine = make_engine(llama, mode)
    long = EngineRequest("long", tok.encode("abort me"), SamplingParams(max_new_tokens=1000, ignore_eos=True))
    others = small_requests(tok, 4)
    engine.start()
    try:
        engine.add_request(long)
        deadline = time.monotonic() + 30
        while engine.stats().output_tokens < 5:  # "long", alone, is running: some of its tokens came out
            assert time.monotonic() < deadline, "no tokens generated"
            time.sleep(0.001)
        for req in others:
            engine.add_request(req)
        engine.abort("long")
        engine.abort("no-such-request")  # ignored
        results = collect(engine, 5)
        assert engine.num_unfinished() == 0
    finally:
        engine.shutdown()
    aborted = results["long"]
    assert aborted.finish_reason == FinishReason.CANCELLED and aborted.error is None
    assert 5 <= len(aborted.token_ids) < 1000
    assert aborted.usage.completion_tokens == len(aborted.token_ids)
    assert all(
        results[r.request_id].finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in others
    )
    assert_all_blocks_free(engine)


def test_abort_waiting_request(llama):
    """Aborted before it ever ran: cancelled, no tokens, and the others are unaffected."""
    _, tok = llama
    engine = make_engine(llama, "async", max_num_seqs=1)
    reqs = small_requests(tok, 3)
    expected = {r.request_id: r.token_ids for r in make_engine(llama, "async").generate(reqs)}
    for req in reqs:
        engine.add_request(req)
    engine.abort("r2")  # read after its add; with one running slot r2 cannot have started
    engine.start()
    try:
        results = collect(engine, 3)
    finally:
        engine.shutdown()
    assert results["r2"].finish_reason == FinishReason.CANCELLED and results["r2"].token_ids == []
    assert {rid: results[rid].token_ids for rid in ("r0", "r1")} == {
        rid: expected[rid] for rid in ("r0", "r1")
    }
    assert engine.num_unfinished() == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", MODES)
def test_bad_requests_come_back_as_errors_without_disturbing_others(llama, mode):
    model, tok = llama
    good = small_requests(tok, 6)
    expected = {r.request_id: r.token_ids for r in make_engine(llama, mode).generate(good)}
    engine = make_engine(llama, mode, max_model_len=64)
    vocab = model.config.vocab_size
    bad = {
        "too_long": (
            EngineRequest("too_long", [tok.bos_token_id] * 64),
            "prompt has 64 tokens; the context is 64",
        ),
        "empty": (EngineRequest("empty", []), "empty prompt"),
        "oov": (EngineRequest("oov", [tok.bos_token_id, vocab]), f"prompt token ids must be in [0, {vocab})"),
        "negative": (EngineRequest("negative", [-1, 5]), f"prompt token ids must be in [0, {vocab})"),
    }
    engine.start()
    try:
        for i, req in enumerate(good):
            engine.add_request(req)
            if i < len(bad):
                engine.add_request(list(bad.values())[i][0])
        results = collect(engine, len(good) + len(bad))
        assert engine.num_unfinished() == 0
    finally:
        engine.shutdown()
    for rid, (req, message) in bad.items():
        res = results[rid]
        assert res.finish_reason == FinishReason.ERROR and res.token_ids == [] and res.text == ""
        assert message in res.error, res.error
        assert res.usage.prompt_tokens == len(req.prompt_ids)
    assert {r.request_id: results[r.request_id].token_ids for r in good} == expected
    assert_all_blocks_free(engine)


def test_the_cache_is_sized_again_once_the_decoder_is_built(llama, monkeypatch):
    """What building the decoder keeps on the device (the MoE workspace, a weight not taken as a view) comes out of
    the KV cache: the runner measures again, and the engine's blocks and context follow its count."""
    from worker.engine import model_runner

    model, tok = llama
    monkeypatch.setattr(model_runner, "num_blocks_from_memory", lambda *args: 9)  # less than the engine's 96
    engine = Engine(model, tok, EngineConfig(mode="sync", kv_cache_bytes_cpu=96 * _block_bytes(model.config)))
    assert engine.runner.num_kv_blocks == engine.blocks.num_blocks == 9
    assert engine.max_model_len == engine.runner.max_model_len == 8 * 16
    assert engine.runner.kv_caches[0][0].shape[0] == 9
    [res] = engine.generate([EngineRequest("fits", tok.encode("hello there"), SamplingParams(8, ignore_eos=True))])
    assert len(res.token_ids) == 8 and res.finish_reason == FinishReason.LENGTH


def _block_bytes(model_config) -> int:
    from worker.engine.kv_cache import kv_bytes_per_block

    return kv_bytes_per_block(model_config, 16, torch.float32)


def test_longest_valid_prompt_is_accepted(llama):
    _, tok = llama
    engine = make_engine(llama, "sync", max_model_len=64)
    [res] = engine.generate(
        [EngineRequest("edge", [tok.bos_token_id] * 63, SamplingParams(10, ignore_eos=True))]
    )
    assert res.finish_reason == FinishReason.LENGTH and len(res.token_ids) == 1


def test_duplicate_request_id_is_rejected_while_the_first_runs(llama):
    _, tok = llama
    engine = make_engine(llama, "sync")
    engine.add_request(EngineRequest("same", tok.encode("one"), SamplingParams(8, ignore_eos=True)))
    engine.add_request(EngineRequest("same", tok.encode("two"), SamplingParams(8)))
    engine.start()
    try:
        both = engine.get_results(timeout=30)
        while len(both) < 2:
            both += engine.get_results(timeout=30)
    finally:
        engine.shutdown()
    assert sorted(r.finish_reason for r in both) == [FinishReason.ERROR, FinishReason.LENGTH]
    error = next(r for r in both if r.finish_reason == FinishReason.ERROR)
    assert "duplicate request id 'same'" in error.error
    assert engine.num_unfinished() == 0


@pytest.mark.parametrize("mode", MODES)
def test_stats_and_usage_are_consistent(llama, mode):
    _, tok = llama
    engine = make_engine(llama, mode)
    assert engine.stats().steps == 0 and engine.stats().wall_seconds == 0
    reqs = small_requests(tok, 10, max_new_tokens=16)
    results = engine.generate(reqs)
    stats = engine.stats()
    num_output = sum(len(r.token_ids) for r in results)
    assert stats.output_tokens == num_output
    assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in reqs)  # no preemption here
    assert stats.num_preemptions == 0 and stats.num_running == 0 and stats.num_waiting == 0
    # Steps: at least one per token of the longest request; async may run one speculative step more.
    assert max(len(r.token_ids) for r in results) <= stats.steps <= num_output + len(reqs)
    assert 0 < stats.busy_seconds <= stats.wall_seconds
    assert 0 < stats.cpu_prep_seconds < stats.wall_seconds
    assert 0 < stats.busy_fraction <= 1 and stats.output_tok_s > 0 and stats.cpu_prep_ms_per_step > 0
    total_gpu = 0.0
    for req, res in zip(reqs, results, strict=True):
        u = res.usage
        assert u.prompt_tokens == len(req.prompt_ids)
        assert u.completion_tokens == len(res.token_ids) > 0
        assert u.latency_seconds >= u.ttft_seconds >= u.queue_seconds >= 0
        assert u.gpu_seconds > 0
        total_gpu += u.gpu_seconds
    # Every step's time is split among its sequences; async steps may include a finished one's extra token.
    assert total_gpu <= stats.busy_seconds * (1 + 1e-6)
    if mode == "sync":
        assert total_gpu == pytest.approx(stats.busy_seconds, rel=1e-6)
    else:
        assert total_gpu >= 0.5 * stats.busy_seconds


def test_usage_queue_time_counts_from_arrival(llama):
    _, tok = llama
    engine = make_engine(llama, "sync")
    arrival = time.time() - 5.0  # entered the system 5 s ago (e.g. waited in the job queue)
    req = EngineRequest("late", tok.encode("hi"), SamplingParams(4), arrival_time=arrival)
    [res] = engine.generate([req])
    assert 5.0 <= res.usage.queue_seconds <= res.usage.ttft_seconds <= res.usage.latency_seconds < 30


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),  # 0: score the prompt only
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ],
)
def test_bad_sampling_params_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "turbo"}, "mode must be one of"),
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be >= 2"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"decode_gemm": "cutlass"}, "decode_gemm must be one of"),
    ],
)
def test_bad_engine_config_raises_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_num_unstarted_counts_what_no_running_slot_holds(llama):
    """The worker admits a chunk only while fewer requests than a chunk wait unstarted (fair sharing)."""
    _, tok = llama
    engine = make_engine(llama, "async", max_num_seqs=2)
    for req in small_requests(tok, 5, max_new_tokens=200):
        engine.add_request(req)
    assert engine.num_unstarted() == 5  # queued for the loop: not started yet
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.stats().num_running < 2:
            assert time.monotonic() < deadline, "nothing started"
            time.sleep(0.01)
        assert engine.num_unstarted() == 3
        collect(engine, 5)
    finally:
        engine.shutdown()
    assert engine.num_unstarted() == 0
