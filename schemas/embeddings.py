"""Embedding lines: OpenAI's `/v1/embeddings` body and cbq's own `{"input": ...}` line, and their output.

Owns the input and output contract of embeddings:
- OpenAI Batch `{"custom_id", "method": "POST", "url": "/v1/embeddings", "body": {"model", "input",
  "dimensions"?, "encoding_format"?, "user"?}}`;
- cbq's own `{"custom_id"?, "input": ..., "dimensions"?, "encoding_format"?}`.
`input` is a string, a list of strings, a list of token ids or a list of such lists, as OpenAI takes it. Each
input is stored and run as its own request (a `ChoiceGroup` when there are several, as a completions body's
prompts); the OpenAI output merges them back into one `list` object whose `data[i]` is input i.
An embedding is returned as floats or, with `encoding_format: "base64"`, as the base64 of its little-endian
float32 bytes (OpenAI's encoding). Usage counts prompt tokens only.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from schemas.limits import MAX_EMBEDDING_DIMENSIONS, MAX_EMBEDDING_INPUTS, MAX_PROMPT_TOKEN_IDS, MAX_TOKEN_ID
from schemas.strict import StrictModel

EMBEDDINGS_URL = "/v1/embeddings"
EncodingFormat = Literal["float", "base64"]
TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)
]
OneInput = Annotated[str, Field(min_length=1)] | TokenIds
_INPUT_HINT = "input is a non-empty string, a list of strings, a list of token ids, or a list of such lists"


class EmbeddingOptions(StrictModel):
    """What an embedding request asks besides its input: stored with the request (`Request.embedding`)."""

    dimensions: int | None = Field(
        None, ge=1, le=MAX_EMBEDDING_DIMENSIONS,
        description="Matryoshka truncation: the first `dimensions` values, normalized again; only on models that "
        "declare Matryoshka support, and at most the model's dimension.",
    )
    encoding_format: EncodingFormat | None = Field(
        None, description='"float" (default) or "base64": the little-endian float32 bytes, base64-encoded.'
    )


def embedding_inputs(value: Any) -> Any:
    """An `input` as the list of its inputs: a string or a list of token ids is one input."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if isinstance(value, list) and not value:
        raise ValueError(_INPUT_HINT)
    return value


class _Inputs(StrictModel):
    input: list[OneInput] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        return embedding_inputs(value)


class EmbeddingBody(_Inputs, EmbeddingOptions):
    """OpenAI's `/v1/embeddings` request body. `model` is echoed as the served name; `user` is accepted and
    ignored."""

    model: str | None = None
    user: str | None = None

    def options(self) -> EmbeddingOptions:
        return EmbeddingOptions(dimensions=self.dimensions, encoding_format=self.encoding_format)


class EmbeddingLine(_Inputs, EmbeddingOptions):
    """cbq's own embedding line."""

    custom_id: str | None = None

    def options(self) -> EmbeddingOptions:
        return EmbeddingOptions(dimensions=self.dimensions, encoding_format=self.encoding_format)


def encode_embedding(values: list[float], encoding_format: EncodingFormat | None) -> list[float] | str:
    """An embedding as a result carries it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def decode_embedding(encoded: list[float] | str) -> list[float]:
    """The floats of an embedding in either encoding (the inverse of `encode_embedding`)."""
    if isinstance(encoded, str):
        raw = base64.b64decode(encoded)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return encoded


def embedding_list_body(embeddings: list[list[float] | str], model: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's `CreateEmbeddingResponse` body: one `embedding` object per input, in input order."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
