"""Embedding requests at the worker's edge: which kind of model a line needs, the engine request of an embedding
line, and the result line of an embedding result. Owns `ModelTask` (what admission knows of the served model).

A worker serves one model: a generation model given an embedding line, or an embedding model given a
completions or chat line, fails that line alone with a 400 (`invalid_value` on `model`) naming the model's
kind; the batch's other lines run. Imports no torch: admission runs in the worker's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas import keys
from schemas.embeddings import encode_embedding
from schemas.lines import Request
from schemas.result import ResultLine, Usage
from worker.embedding.checkpoint import EMBED, GENERATE, ModelKind
from worker.engine.api import EngineResult, ErrorCode, TokenizerProtocol

_PARAM_OF_CODE = {
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: "input",
    ErrorCode.INVALID_PROMPT: "input",
    ErrorCode.INVALID_VALUE: "dimensions",
}


@dataclass(frozen=True)
class ModelTask:
    """What admission needs to know of the served model: its kind and, for an embedding model, the prompt its
    checkpoint puts before every text input (config_sentence_transformers.json's default prompt)."""

    kind: ModelKind = GENERATE
    text_prefix: str = ""

    @classmethod
    def of(cls, engine: Any) -> ModelTask:
        kind = getattr(engine, "model_kind", GENERATE)
        spec = getattr(engine, "spec", None)
        return cls(kind, getattr(spec, "prompt", "") if kind == EMBED else "")


def kind_refusal(request: Request, task: ModelTask) -> ResultLine | None:
    """The 400 of a line this worker's model cannot run by kind, or None."""
    if request.is_embedding == (task.kind == EMBED):
        return None
    if task.kind == EMBED:
        asked = request.url or ("chat" if request.is_chat else "prompt") + " lines"
        message = (
            f"this worker serves an embedding model: it runs /v1/embeddings and {{\"input\": ...}} lines, not {asked}"
        )
    else:
        message = (
            "this worker serves a generation model: it runs completions and chat lines, not /v1/embeddings "
            "(embedding lines need a worker of an embedding model)"
        )
    return ResultLine(
        custom_id=request.custom_id,
        index=request.index,
        finish_reason="error",
        error=message,
        error_code="invalid_value",
        error_param="model",
    )


def to_embedding_request(
    request: Request, tokenizer: TokenizerProtocol, task: ModelTask, batch_id: str, arrival_time: float
) -> Any:
    """The engine request of an embedding line: a text input tokenized after the checkpoint's prompt (with the
    tokenizer's special tokens, as sentence-transformers' `encode`), token ids as given."""
    from worker.embedding.engine import EmbeddingRequest  # torch: only in a worker that runs a model

    assert request.embedding is not None, "an embedding request has its options"
    if request.prompt_token_ids is not None:
        prompt_ids = list(request.prompt_token_ids)
    else:
        assert request.prompt is not None, "a stored embedding request has a text or token ids"
        prompt_ids = tokenizer.encode(task.text_prefix + request.prompt, add_special_tokens=True)
    return EmbeddingRequest(
        request_id=keys.engine_request_id(batch_id, request.index),
        prompt_ids=prompt_ids,
        arrival_time=arrival_time,
        dimensions=request.embedding.dimensions,
    )


def embedding_result_line(request: Request, result: EngineResult, one_line: Any) -> ResultLine:
    """The result line of an embedding result: its vector in the request's encoding, prompt tokens as usage."""
    assert request.embedding is not None, "an embedding result answers an embedding request"
    reason = result.finish_reason.value
    usage = Usage(
        prompt_tokens=result.usage.prompt_tokens if reason != "cancelled" else 0,
        gpu_seconds=result.usage.gpu_seconds,
        queue_seconds=result.usage.queue_seconds,
        ttft_seconds=result.usage.ttft_seconds,
        latency_seconds=result.usage.latency_seconds,
    )
    if reason == "error":
        code = result.error_code
        return ResultLine(
            custom_id=request.custom_id,
            index=request.index,
            finish_reason="error",
            usage=usage,
            error=one_line(result.error or "the engine reported an error"),
            error_code=code.value if code is not None else None,
            error_param=_PARAM_OF_CODE.get(code) if code is not None else None,
        )
    if reason == "cancelled":
        return ResultLine(custom_id=request.custom_id, index=request.index, finish_reason="cancelled", usage=usage)
    vector = getattr(result, "embedding", None)
    assert vector is not None, f"{type(result).__name__} carries no embedding"
    return ResultLine(
        custom_id=request.custom_id,
        index=request.index,
        finish_reason="stop",
        usage=usage,
        embedding=encode_embedding(vector, request.embedding.encoding_format),
    )
