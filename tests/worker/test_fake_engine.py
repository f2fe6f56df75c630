import threading
import time

import pytest

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.fake_engine import FakeEngine


def req(rid, prompt="hello world", **sampling) -> EngineRequest:
    return EngineRequest(rid, list(prompt.encode()), SamplingParams(**sampling))


def test_echo_honours_max_new_tokens_and_cycles_the_prompt():
    engine = FakeEngine()
    [short, long] = engine.generate([req("a", max_new_tokens=5), req("b", prompt="ab", max_new_tokens=5)])
    assert (short.text, short.finish_reason, short.usage.completion_tokens) == (
        "hello",
        FinishReason.LENGTH,
        5,
    )
    assert long.text == "ababa" and long.token_ids == list(b"ababa")
    assert short.usage.prompt_tokens == 11 and short.usage.gpu_seconds > 0


def test_stop_strings_and_stop_token_ids_end_generation():
    engine = FakeEngine()
    by_string, by_token = engine.generate(
        [req("a", max_new_tokens=10, stop=("lo",)), req("b", max_new_tokens=10, stop_token_ids=(ord(" "),))]
    )
    assert (by_string.text, by_string.finish_reason) == ("hel", FinishReason.STOP)
    assert (by_token.text, by_token.finish_reason) == ("hello", FinishReason.STOP)


def test_context_length_caps_output_and_too_long_prompts_are_errors():
    engine = FakeEngine(max_model_len=13)
    capped, too_long, empty = engine.generate(
        [req("a", max_new_tokens=10), req("b", prompt="x" * 13), req("c", prompt="")]
    )
    assert capped.usage.completion_tokens == 2 and capped.finish_reason == FinishReason.LENGTH
    assert too_long.finish_reason == FinishReason.ERROR and "the context is 13 tokens" in too_long.error
    assert empty.finish_reason == FinishReason.ERROR and empty.error == "empty prompt"


def test_background_interface_results_capacity_and_abort():
    engine = FakeEngine(max_num_running=2, latency_seconds=60)
    engine.start()
    engine.add_request(req("a"))
    assert engine.has_capacity()
    engine.add_request(req("b"))
    assert not engine.has_capacity() and engine.num_unfinished() == 2
    assert engine.get_results(timeout=0.01) == []
    engine.abort("a")
    [aborted] = engine.get_results(timeout=1)
    assert (aborted.request_id, aborted.finish_reason) == ("a", FinishReason.CANCELLED)
    assert engine.num_unfinished() == 1 and engine.stats().num_running == 1
    engine.abort("unknown")  # harmless
    engine.shutdown()


def test_get_results_blocks_until_a_result_is_ready():
    engine = FakeEngine(latency_seconds=0.05)
    engine.start()
    engine.add_request(req("a"))
    t0 = time.perf_counter()
    [result] = engine.get_results(timeout=5)
    assert result.request_id == "a" and 0.03 < time.perf_counter() - t0 < 2
    threading.Timer(0.05, lambda: engine.add_request(req("b"))).start()
    assert [r.request_id for r in engine.get_results(timeout=None)] == ["b"]


def test_raise_on_prompt_substring():
    engine = FakeEngine(raise_on_prompt_substring="boom")
    with pytest.raises(RuntimeError, match="FakeEngine told to fail"):
        engine.add_request(req("a", prompt="a boom b"))


def test_running_slots_start_waiting_requests_in_arrival_order():
    engine = FakeEngine(max_num_running=6, num_slots=2, latency_seconds=0.2)
    engine.start()
    for name in "abcd":
        engine.add_request(req(name))
    assert engine.num_unstarted() == 2 and engine.has_capacity()
    assert (engine.stats().num_running, engine.stats().num_waiting) == (2, 2)
    first = engine.get_results(timeout=5)
    assert sorted(r.request_id for r in first) == ["a", "b"]
    assert engine.num_unstarted() == 0 and engine.stats().num_running == 2
    engine.abort("d")
    rest = engine.get_results(timeout=5) + engine.get_results(timeout=5)
    assert sorted((r.request_id, r.finish_reason) for r in rest) == [
        ("c", FinishReason.LENGTH),
        ("d", FinishReason.CANCELLED),
    ]
    engine.shutdown()
