"""The Response object of a `/v1/responses` line's output: owns how a finished chat result becomes one.

`output` holds, in this order: a `reasoning` item (the text the reasoning parser split off, as
`content[].reasoning_text`; `summary` is empty), a `message` item with the answer as `output_text` (left out when
the model only called tools), and one `function_call` item per call (parsed from the model's own format, or the
forced call whose arguments are the output). A result cut by its token limit is `incomplete` with
`incomplete_details.reason` "max_output_tokens". The request's own fields are repeated from its
`ResponseEcho` (schemas/responses_body.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.output_parts import Sample, TokenLogprob, Usage

if TYPE_CHECKING:
    from schemas.lines import Request


def response_body(
    samples: list[Sample], usage: Usage, request: Request, request_id: str, model: str, created_at: int
) -> dict[str, Any]:
    """The Response for a request that finished (stop or length): its samples and usage (`ResultLine.all_samples`,
    `.usage`); `model` is the served name."""
    assert request.responses is not None, "a /v1/responses request keeps its echo"
    echo = request.responses
    [sample] = samples  # a Responses body has no n
    status = "completed" if sample.finish_reason == "stop" else "incomplete"
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": created_at,
        "completed_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": _output_items(sample, request, request_id, status, echo.output_logprobs),
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
        **echo.model_dump(exclude={"output_logprobs"}),
    }


def _output_items(
    sample: Sample, request: Request, request_id: str, status: str, with_logprobs: bool
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if sample.reasoning_content is not None:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{request_id}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": sample.reasoning_content}],
                "status": status,
            }
        )
    content = sample.message_content(sample.text)
    calls = [(call.id, call.function.name, call.function.arguments) for call in sample.tool_calls or ()]
    plan = request.tool_call
    if not calls and plan is not None and plan.is_forced and plan.name is not None:  # the output is the arguments
        calls, content = [(f"call_{request_id}_{sample.index}", plan.name, content or "")], None
    if content is not None or not calls and sample.reasoning_content is None:
        text: dict[str, Any] = {"type": "output_text", "text": content or "", "annotations": []}
        if with_logprobs:
            text["logprobs"] = _output_logprobs(sample.logprobs)
        items.append(
            {"type": "message", "id": f"msg_{request_id}", "role": "assistant", "status": status, "content": [text]}
        )
    for k, (call_id, name, arguments) in enumerate(calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{request_id}_{k}",
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    return items


def _output_logprobs(logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """`output_text.logprobs`: cbq's records are already their shape (token, bytes, logprob, top_logprobs)."""
    return [lp.model_dump() for lp in logprobs or ()]
