"""Request lines: the three accepted input shapes, and the normalized request stored in Redis.

Owns the input contract of `cbq submit`:
- simple    `{"prompt": "...", "max_new_tokens": 32, ...}`
- chat      `{"messages": [{"role": "user", "content": "..."}], ...}`
- OpenAI Batch `{"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
  "body": {"prompt" | "messages", "max_tokens", "temperature", ...}}` (`schemas.openai_body`), or
  `"url": "/v1/responses"` with `{"input", "instructions", "max_output_tokens", ...}` (`schemas.responses_body`:
  stored and run as the chat it means)
- embeddings `{"input": ...}` and OpenAI's `/v1/embeddings` lines (`schemas.embeddings`)

An output constraint is spelled `json_schema`, `regex` or `choice` on simple and chat lines, and
`response_format` in OpenAI bodies; logprobs are `logprobs: k` on simple and chat lines and in completions
bodies, `logprobs: true` + `top_logprobs: k` in chat bodies; prompt logprobs are `prompt_logprobs: k` on every
shape, and a completions body's `echo` (with `logprobs: k`, the prompt's logprobs lead the choice's). A constraint that does not compile fails its line.
A chat body that forces a tool call runs as a constraint on the function's arguments (schemas/tools.py).

`parse_request_line` turns one JSONL line into a `ParsedRequest` (sampling fields only where the line gave
them); `ParsedRequest.resolve` applies batch defaults and gives the `Request` that is stored and run.
Blank lines are skipped: `parse_request_line` returns None for them, so editors' trailing newlines are harmless.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from schemas.chat import ChatMessage, ChatTemplateKwargs
from schemas.embeddings import EMBEDDINGS_URL, EmbeddingBody, EmbeddingLine, EmbeddingOptions
from schemas.errors import FieldIssue, InvalidRequest, RequestLineError, issues_from_validation_error
from schemas.json_line import BLANK, LONE_SURROGATE, load_json_line
from schemas.limits import MAX_CHOICES, MAX_EMBEDDING_INPUTS, MAX_PROMPTS
from schemas.media import at_most_images
from schemas.openai_body import (
    COMPLETIONS_URL,
    ChatCompletionBody,
    CompletionBody,
    CustomId,
    OpenAIBatchLine,
    OpenAIUrl,
)
from schemas.prompt import ChatSpelling, PromptOptions, PromptSpelling
from schemas.responses_body import RESPONSES_URL, ResponseEcho, ResponsesBody
from schemas.sampling import (
    N_DESCRIPTION,
    NativeSpelling,
    NumSamples,
    OutputConstraint,
    Sampling,
    SharedSampling,
    check_min_tokens,
    check_scoring,
    json_text,
)
from schemas.strict import StrictModel
from schemas.tools import ForcedToolCall

OPENAI_URLS: tuple[str, ...] = typing.get_args(OpenAIUrl)
Choice = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice")


class _NativeConstraint(StrictModel):
    """cbq's own constraint fields on simple and chat lines; at most one per line."""

    json_schema: dict[str, Any] | None = Field(None, description="A JSON schema the output must follow.")
    regex: str | None = Field(None, min_length=1, description="A regex the whole output must match.")
    choice: Choice | None = Field(None, description="The output is exactly one of these strings.")

    @model_validator(mode="after")
    def _at_most_one_constraint(self):
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one constraint per line, not {' and '.join(given)}")
        return self

    @field_validator(*CONSTRAINT_FIELDS)
    @classmethod
    def _compiles(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            _native_constraint(info.field_name or "", value)
        return value

    def output_constraint(self) -> OutputConstraint | None:
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                return _native_constraint(name, getattr(self, name))
        return None


def _native_constraint(name: str, value: Any) -> OutputConstraint:
    return OutputConstraint.checked(name, value if isinstance(value, str) else json_text(value))


class _NativeLine(SharedSampling, NativeSpelling, _NativeConstraint):
    """What simple and chat lines share: every sampling field by its name, a constraint, and `n`."""

    custom_id: CustomId | None = None
    n: NumSamples = Field(1, description=N_DESCRIPTION)

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_is_max_new_tokens(cls, data: Any) -> Any:
        """`max_tokens` (OpenAI's and vLLM's name) is taken for `max_new_tokens` on cbq's own lines too."""
        if isinstance(data, dict) and "max_tokens" in data:
            if "max_new_tokens" in data:
                raise ValueError("give max_new_tokens or max_tokens, not both")
            data = {**data, "max_new_tokens": data["max_tokens"]}
            del data["max_tokens"]
        return data

    @model_validator(mode="after")
    def _min_tokens_within_max(self):
        check_min_tokens(self.min_tokens, self.max_new_tokens, "max_new_tokens")
        check_scoring(self.max_new_tokens, self.prompt_logprobs is not None, "max_new_tokens", "prompt_logprobs")
        return self

    def overrides(self) -> Sampling:
        given = {name: getattr(self, name) for name in Sampling.model_fields if name != "constraint"}
        return Sampling(**given, constraint=self.output_constraint())


class PromptLine(_NativeLine, PromptSpelling):
    prompt: str


class ChatLine(_NativeLine, ChatSpelling):
    messages: Annotated[list[ChatMessage], Field(min_length=1), AfterValidator(at_most_images)]
    chat_template_kwargs: ChatTemplateKwargs | None = None


Shape = Literal["prompt", "chat", "openai"]


class ChoiceGroup(StrictModel):
    """One prompt of a completions request that gives several (`"prompt": [...]`, as OpenAI takes it). Each
    prompt is stored and run as its own request, at consecutive indices; OpenAI output merges them back into
    the request's one line, its choices grouped by prompt (choice i*n + j is sample j of prompt i)."""

    position: int = Field(ge=0)
    size: int = Field(ge=2, le=max(MAX_PROMPTS, MAX_EMBEDDING_INPUTS))  # an embeddings request's inputs too


def _one_prompt(prompt: str | list[int]) -> dict[str, Any]:
    return {"prompt": prompt, "prompt_token_ids": None} if isinstance(prompt, str) else {
        "prompt": None,
        "prompt_token_ids": prompt,
    }


class Request(StrictModel):
    """One request as stored in Redis (`cbq:batch:{id}:requests`) and read back by the worker."""

    index: int = Field(ge=0)  # position in the batch: results come back in this order
    line_no: int = Field(ge=1)
    custom_id: CustomId | None = None
    shape: Shape
    url: OpenAIUrl | None = None  # OpenAI Batch lines only
    model: str | None = None  # OpenAI Batch lines only: body.model, echoed in the output
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # a completions prompt given as token ids
    messages: list[ChatMessage] | None = None
    prompt_options: PromptOptions | None = None
    choice_group: ChoiceGroup | None = None  # one prompt of a request with several
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI chat bodies: shown to the chat template
    tool_call: ForcedToolCall | None = None  # the tool use the body asks for (schemas/tools.py)
    responses: ResponseEcho | None = None  # /v1/responses lines: what their Response repeats of the body
    sampling: Sampling = Sampling()
    n: NumSamples = 1
    return_token_ids: bool = False
    echo: bool = False  # completions bodies: the output text (and logprobs) start with the prompt's
    embedding: EmbeddingOptions | None = None  # set exactly for an embedding request (schemas/embeddings.py)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prompt blocks

    @model_validator(mode="after")
    def _prompt_xor_messages(self):
        if [self.prompt, self.prompt_token_ids, self.messages].count(None) != 2:
            raise ValueError("a request has exactly one of prompt, prompt_token_ids or messages")
        return self

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def is_embedding(self) -> bool:
        return self.embedding is not None


class ParsedRequest(StrictModel):
    """A validated line before batch defaults are applied."""

    line_no: int
    custom_id: str | None
    shape: Shape
    url: OpenAIUrl | None = None
    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    prompt_options: PromptOptions | None = None
    group_prompts: list[str | list[int]] | None = None  # a completions request's prompts, when several
    choice_group: ChoiceGroup | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_call: ForcedToolCall | None = None
    responses: ResponseEcho | None = None
    overrides: Sampling = Sampling()
    n: NumSamples = 1
    echo: bool = False
    embedding: EmbeddingOptions | None = None
    return_token_ids: bool = False  # an OpenAI body's (vLLM's field); the batch's flag sets it for every line
    cache_salt: str | None = None

    def members(self) -> list[ParsedRequest]:
        """The requests this line stores: itself, or one per prompt of a completions request with several."""
        if not self.group_prompts:
            return [self]
        size = len(self.group_prompts)
        return [
            self.model_copy(
                update={**_one_prompt(p), "group_prompts": None, "choice_group": ChoiceGroup(position=i, size=size)}
            )
            for i, p in enumerate(self.group_prompts)
        ]

    def resolve(
        self,
        index: int,
        defaults: Sampling | None = None,
        return_token_ids: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Request:
        """The stored request: line values win over batch defaults, which win over the model's.
        `chat_template_kwargs` are the batch's template variables, for chats; the line's win, name by name."""
        merged = (defaults.given() if defaults else {}) | self.overrides.given()
        template_kwargs = None
        if self.messages is not None and (chat_template_kwargs or self.chat_template_kwargs):
            template_kwargs = (chat_template_kwargs or {}) | (self.chat_template_kwargs or {})
        return Request(
            index=index,
            line_no=self.line_no,
            custom_id=self.custom_id,
            shape=self.shape,
            url=self.url,
            model=self.model,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            messages=self.messages,
            prompt_options=self.prompt_options,
            choice_group=self.choice_group,
            chat_template_kwargs=template_kwargs,
            tools=self.tools,
            tool_call=self.tool_call,
            responses=self.responses,
            sampling=Sampling(**merged),
            n=self.n,
            return_token_ids=return_token_ids or self.return_token_ids,
            echo=self.echo,
            embedding=self.embedding,
            cache_salt=self.cache_salt,
        )


_SHAPE_HINT = (
    'expected {"prompt": ...}, {"messages": [...]}, {"input": ...} (embeddings), or an OpenAI Batch line '
    '{"custom_id", "method", "url", "body"}'
)
_OPENAI_KEYS = {"method", "url", "body"}
_custom_id_adapter: TypeAdapter[str | None] = TypeAdapter(CustomId | None)


def parse_request_line(text: str | bytes, line_no: int) -> ParsedRequest | None:
    """Validate one JSONL line (bytes are decoded as UTF-8 here, so a bad byte is an error of its line).
    Returns None for a blank line. Raises `RequestLineError` naming line and field for a format error (the
    file is refused), and its subclass `InvalidRequest` for a well-formed line whose request is invalid (that
    request alone fails): as OpenAI, the format is the JSON object, its custom_id and, for an OpenAI line,
    its method and url; everything else is the request."""
    obj, surrogate_at = load_json_line(text, line_no)
    if obj is BLANK:
        return None
    if not isinstance(obj, dict):
        raise RequestLineError(
            line_no, [FieldIssue("", f"a line must be a JSON object, got {type(obj).__name__}")]
        )
    is_openai = bool(_OPENAI_KEYS & obj.keys())
    _surrogate_in_format(surrogate_at, line_no, is_openai)
    if is_openai:
        url = obj.get("url")
        if isinstance(url, str) and url not in OPENAI_URLS:  # an endpoint cbq does not serve: that line fails
            known = _validate(OpenAIBatchLine, {**obj, "url": COMPLETIONS_URL}, line_no)  # the rest of the format
            message = f"cbq serves {', '.join(OPENAI_URLS[:-1])} and {OPENAI_URLS[-1]}, not {url!r}"
            raise InvalidRequest(line_no, [FieldIssue("url", message)], known.custom_id, url)
        envelope = _validate(OpenAIBatchLine, obj, line_no)
        _surrogate_in_request(surrogate_at, line_no, envelope.custom_id, envelope.url)
        return _parse_openai_body(envelope, line_no)
    if "input" in obj and not {"prompt", "messages"} & obj.keys():
        return _parse_embedding_line(obj, line_no, surrogate_at)
    if ("prompt" in obj) == ("messages" in obj):
        hint = "give either prompt or messages, not both" if "prompt" in obj else _SHAPE_HINT
        raise RequestLineError(line_no, [FieldIssue("", hint)])
    try:
        custom_id = _custom_id_adapter.validate_python(obj.get("custom_id"))
    except ValidationError as exc:
        raise RequestLineError(line_no, issues_from_validation_error(exc, PromptLine, ("custom_id",))) from None
    _surrogate_in_request(surrogate_at, line_no, custom_id)
    if "messages" in obj:
        chat = _validate(ChatLine, obj, line_no, fails_alone=(custom_id, None))
        return ParsedRequest(
            line_no=line_no,
            custom_id=custom_id,
            shape="chat",
            messages=chat.messages,
            prompt_options=chat.prompt_options(),
            chat_template_kwargs=chat.chat_template_kwargs,
            overrides=chat.overrides(),
            n=chat.n,
        )
    line = _validate(PromptLine, obj, line_no, fails_alone=(custom_id, None))
    return ParsedRequest(
        line_no=line_no,
        custom_id=custom_id,
        shape="prompt",
        prompt=line.prompt,
        prompt_options=line.prompt_options(),
        overrides=line.overrides(),
        n=line.n,
    )


# A lone surrogate inside the request's own part of a line (an OpenAI line's body; any field of a cbq line but
# custom_id) fails that request; in the format's fields (custom_id, method, url, a key) it refuses the file.
def _surrogate_in_format(field: str | None, line_no: int, openai: bool) -> None:
    in_request = field is None or (field.startswith("body") if openai else not field.startswith(("custom_id", "(")))
    if not in_request:
        raise RequestLineError(line_no, [FieldIssue(field or "", LONE_SURROGATE)])


def _surrogate_in_request(field: str | None, line_no: int, custom_id: str | None, url: str | None = None) -> None:
    if field is not None:
        raise InvalidRequest(line_no, [FieldIssue(field, LONE_SURROGATE)], custom_id, url)


def _parse_embedding_line(obj: dict[str, Any], line_no: int, surrogate_at: str | None) -> ParsedRequest:
    try:
        custom_id = _custom_id_adapter.validate_python(obj.get("custom_id"))
    except ValidationError as exc:
        raise RequestLineError(line_no, issues_from_validation_error(exc, EmbeddingLine, ("custom_id",))) from None
    _surrogate_in_request(surrogate_at, line_no, custom_id)
    line = _validate(EmbeddingLine, obj, line_no, fails_alone=(custom_id, None))
    return _embedding_request(line_no, custom_id, "prompt", None, None, line.input, line.options())


def _embedding_request(
    line_no: int,
    custom_id: str | None,
    shape: Shape,
    url: OpenAIUrl | None,
    model: str | None,
    inputs: list[str | list[int]],
    options: EmbeddingOptions,
) -> ParsedRequest:
    of_input: dict[str, Any] = _one_prompt(inputs[0]) if len(inputs) == 1 else {"group_prompts": inputs}
    return ParsedRequest(
        line_no=line_no, custom_id=custom_id, shape=shape, url=url, model=model, embedding=options, **of_input
    )


def _parse_openai_body(envelope: OpenAIBatchLine, line_no: int) -> ParsedRequest:
    fails_alone = (envelope.custom_id, envelope.url)
    if envelope.url == EMBEDDINGS_URL:
        embed = _validate(EmbeddingBody, envelope.body, line_no, ("body",), fails_alone)
        return _embedding_request(
            line_no, envelope.custom_id, "openai", envelope.url, embed.model, embed.input, embed.options()
        )
    body: CompletionBody | ChatCompletionBody
    responses = None
    if envelope.url == COMPLETIONS_URL:
        body = _validate(CompletionBody, envelope.body, line_no, ("body",), fails_alone)
        prompts = body.prompt
        of_endpoint: dict[str, Any] = _one_prompt(prompts[0]) if len(prompts) == 1 else {"group_prompts": prompts}
        of_endpoint["echo"] = bool(body.echo)
    else:
        if envelope.url == RESPONSES_URL:  # run as the chat it means; its Response repeats the body's fields
            responses_body = _validate(ResponsesBody, envelope.body, line_no, ("body",), fails_alone)
            body, responses = responses_body.chat_body(), responses_body.echo()
        else:
            body = _validate(ChatCompletionBody, envelope.body, line_no, ("body",), fails_alone)
        of_endpoint = {
            "messages": body.messages,
            "chat_template_kwargs": body.template_kwargs(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            "tool_call": body.tool_call(),
        }
    return ParsedRequest(
        line_no=line_no,
        custom_id=envelope.custom_id,
        shape="openai",
        url=envelope.url,
        model=body.model,
        overrides=body.overrides(),
        n=body.n or 1,
        prompt_options=body.prompt_options(),
        responses=responses,
        return_token_ids=bool(body.return_token_ids),
        cache_salt=body.cache_salt,
        **of_endpoint,
    )


_Model = TypeVar("_Model", bound=StrictModel)


def _validate(
    model: type[_Model],
    obj: Any,
    line_no: int,
    prefix: tuple[str, ...] = (),
    fails_alone: tuple[str | None, str | None] | None = None,
) -> _Model:
    """`obj` as `model`. Invalid: a `RequestLineError`, or with `fails_alone` (the request's custom_id and
    url) an `InvalidRequest`, which fails that request only."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        issues = issues_from_validation_error(exc, model, prefix)
        if fails_alone is not None:
            raise InvalidRequest(line_no, issues, *fails_alone) from None
        raise RequestLineError(line_no, issues) from None
