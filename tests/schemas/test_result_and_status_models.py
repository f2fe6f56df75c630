import json

import pytest
from pydantic import ValidationError

from schemas import keys
from schemas.chunk import ChunkPayload
from schemas.lines import Request
from schemas.result import OpenAIBatchOutputLine, ResultLine, Sample, Usage, to_openai_output
from schemas.status import BatchStatus, WorkerStats


def result(**kw) -> ResultLine:
    base = {
        "custom_id": "c",
        "index": 3,
        "text": "out",
        "finish_reason": "length",
        "usage": Usage(prompt_tokens=4, completion_tokens=2),
    }
    return ResultLine(**{**base, **kw})


def test_result_line_error_is_set_exactly_for_failures():
    assert result(finish_reason="error", error="too long").error == "too long"
    with pytest.raises(ValidationError, match="error is set exactly when finish_reason is 'error'"):
        result(finish_reason="error")
    with pytest.raises(ValidationError, match="error is set exactly"):
        result(finish_reason="stop", error="x")
    with pytest.raises(ValidationError, match="Input should be 'stop', 'length', 'error' or 'cancelled'"):
        result(finish_reason="eos")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        result(extra=1)


def test_openai_output_for_a_completion():
    req = Request(
        index=3, line_no=4, custom_id="c", shape="openai", url="/v1/completions", model="m", prompt="p"
    )
    out = to_openai_output(result(), req, "b1", model="worker-model", created_at=100)
    assert out.custom_id == "c" and out.error is None
    assert out.response.status_code == 200 and out.response.request_id == "b1-3"
    body = out.response.body
    assert body["object"] == "text_completion" and body["model"] == "worker-model" and body["created"] == 100
    assert body["choices"] == [{"index": 0, "text": "out", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    OpenAIBatchOutputLine.model_validate_json(out.model_dump_json())


def test_openai_output_for_chat_uses_the_worker_model_and_a_generated_custom_id():
    req = Request(index=3, line_no=4, shape="chat", messages=[{"role": "user", "content": "q"}])
    out = to_openai_output(result(custom_id=None), req, "b1", model="worker-model", created_at=1)
    assert out.custom_id == "request-3"
    assert out.response.body["object"] == "chat.completion" and out.response.body["model"] == "worker-model"
    assert out.response.body["choices"][0]["message"] == {"role": "assistant", "content": "out"}


@pytest.mark.parametrize("shape", ["chat", "completion"])
def test_openai_output_for_n_samples_has_one_choice_each_and_the_prompt_counted_once(shape):
    if shape == "chat":
        req = Request(index=3, line_no=4, shape="chat", messages=[{"role": "user", "content": "q"}], n=2)
    else:
        req = Request(index=3, line_no=4, shape="prompt", prompt="p", n=2)
    samples = [Sample(index=0, text="a", finish_reason="stop"), Sample(index=1, text="bb", finish_reason="length")]
    usage = Usage(prompt_tokens=4, completion_tokens=5, cached_tokens=3)
    body = to_openai_output(result(text="a", finish_reason="stop", samples=samples, usage=usage), req, "b", "m", 1)
    body = body.response.body
    texts = [c["message"]["content"] if shape == "chat" else c["text"] for c in body["choices"]]
    assert texts == ["a", "bb"] and [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_openai_output_for_failures_has_an_error_and_no_response():
    req = Request(index=3, line_no=4, shape="prompt", prompt="p")
    failed = to_openai_output(result(finish_reason="error", error="prompt too long"), req, "b", "m", 1)
    assert failed.response is None and failed.error.model_dump() == {
        "code": "generation_error",
        "message": "prompt too long",
    }
    cancelled = to_openai_output(result(finish_reason="cancelled"), req, "b", "m", 1)
    assert cancelled.error.code == "cancelled"


def status(**kw) -> BatchStatus:
    base = dict(
        batch_id="b",
        queue="q",
        created_at=1.0,
        num_total=10,
        num_queued=2,
        num_running=3,
        num_completed=4,
        num_failed=1,
        num_cancelled=0,
    )
    return BatchStatus(**{**base, **kw})


def test_batch_status_counts_must_add_up_and_state_follows_them():
    assert status().state == "queued" and not status().is_done
    assert status(first_started_at=2.0).state == "running"
    assert status(num_queued=0, num_running=0, num_completed=9).state == "done"
    assert (
        status(num_queued=0, num_running=0, num_completed=4, num_cancelled=5, cancelled_at=3.0).state
        == "cancelled"
    )
    with pytest.raises(ValidationError, match="counts add up to 11, not num_total=10"):
        status(num_queued=3)


def test_worker_stats_round_trip():
    ws = WorkerStats(
        worker_name="w",
        hostname="h",
        pid=1,
        model="m",
        queues=["q"],
        started_at=1,
        updated_at=2,
        state="idle",
    )
    assert WorkerStats.model_validate_json(ws.model_dump_json()) == ws
    assert ws.prefix_cache_hit_rate == 0.0


def test_keys_share_one_prefix_and_ids_round_trip():
    assert all(
        k.startswith("cbq:")
        for k in keys.all_batch_keys("b1") + [keys.BATCHES, keys.WORKERS, keys.name_index("n")]
    )
    assert keys.split_engine_request_id(keys.engine_request_id("b1", 42)) == ("b1", 42)
    assert keys.chunk_job_id("b1", 3) == "cbq-b1-000003"


def test_chunk_payload_is_strict():
    assert list(ChunkPayload(batch_id="b", start=2, stop=4).indices) == [2, 3]
    with pytest.raises(ValidationError, match="empty chunk range"):
        ChunkPayload(batch_id="b", start=4, stop=4)
    with pytest.raises(ValidationError, match="String should match pattern"):
        ChunkPayload(batch_id="b:x", start=0, stop=1)
    with pytest.raises(ValidationError, match="Input should be a valid integer"):
        ChunkPayload.model_validate({"batch_id": "b", "start": "0", "stop": 1})


def test_every_finish_reason_counts_as_one_batch_outcome():
    from typing import get_args

    from schemas.keys import BatchField
    from schemas.result import OUTCOME_OF_REASON, OUTCOMES, FinishReason

    assert set(OUTCOME_OF_REASON) == set(get_args(FinishReason))
    assert set(OUTCOME_OF_REASON.values()) == set(OUTCOMES)
    assert [BatchField.counter_of(o) for o in OUTCOMES] == [
        BatchField.NUM_COMPLETED,
        BatchField.NUM_FAILED,
        BatchField.NUM_CANCELLED,
    ]


@pytest.mark.parametrize("choice, finish", [({"type": "function", "function": {"name": "f"}}, "stop"), ("required", "tool_calls")])
def test_a_forced_tool_call_answers_with_tool_calls_as_openai_does(choice, finish):
    from openai.types.chat import ChatCompletion

    from schemas.lines import parse_request_line

    body = {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": choice,
    }
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    req = parse_request_line(json.dumps(line), 4).resolve(3)
    assert req.tools == body["tools"] and req.tool_call.name == "f"
    for finish_reason, want in (("stop", finish), ("length", "length")):
        out = to_openai_output(result(text='{"a": 1}', finish_reason=finish_reason), req, "b1", "m", 1)
        parsed = ChatCompletion.model_validate(out.response.body)
        [choice_out] = parsed.choices
        assert choice_out.finish_reason == want and choice_out.message.content is None
        [call] = choice_out.message.tool_calls
        assert (call.id, call.type, call.function.name, call.function.arguments) == ("call_b1-3_0", "function", "f", '{"a": 1}')
