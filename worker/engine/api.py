"""The engine's public types: what goes in (`EngineRequest`), what comes out (`EngineResult`), and the two
seams other code relies on: `EngineProtocol` (what the queue worker and `cbq run` use of an engine) and
`TokenizerProtocol` (what the engine, `stop.py` and admission use of a tokenizer).

Plain dataclasses and protocols, no torch, redis or pydantic: the worker converts schemas at its edge into these.
The bounds checked here come from `schemas.limits` (plain constants, the one home the schemas also read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from schemas.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_PROMPT_LOGPROBS, MAX_SAMPLES


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context length
    ERROR = "error"  # rejected or failed; `EngineResult.error` says why
    CANCELLED = "cancelled"  # aborted by the caller


class ErrorCode(str, Enum):
    """Why a request was refused before it ran: an invalid request, not a failure (OpenAI answers 400)."""

    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt leaves no room in the context
    INVALID_PROMPT = "invalid_prompt"  # empty, or token ids outside the vocabulary
    INVALID_VALUE = "invalid_value"  # a field the model cannot honour (an embedding's `dimensions`)


# What a field left as None means when the model's generation_config does not set it either.
BUILTIN_SAMPLING_DEFAULTS = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}


class ConstraintKind(str, Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec unused
    REGEX = "regex"  # spec: the pattern (Rust `regex` syntax), matched against the whole output
    CHOICE = "choice"  # spec: a JSON list of strings; the output is exactly one of them


@dataclass(frozen=True)
class Constraint:
    """What the output must match. JSON is compact: no whitespace between tokens (see grammar.py)."""

    kind: ConstraintKind
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling. None means "the model's default": the checkpoint's generation_config value
    (unless the engine was told to ignore it), else `BUILTIN_SAMPLING_DEFAULTS`, and for max_new_tokens the
    rest of the context. The engine resolves every None when it admits a request (`with_defaults`)."""

    max_new_tokens: int | None = None
    temperature: float | None = None  # 0 means greedy
    top_p: float | None = None
    top_k: int | None = None  # 0 means no top-k cut
    seed: int | None = None  # None: derived from the request id, so still reproducible
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Per output token: the chosen token's log-probability and this many top alternatives (0..20), from
    # the model's raw distribution (logits before the constraint mask, temperature, top-k and top-p).
    logprobs: int | None = None  # None: no logprobs
    # Per prompt token (vLLM's `prompt_logprobs`): its log-probability given the tokens before it, its rank and
    # this many top alternatives (0..20), computed in the prefill (prompt_logprobs.py). None: not computed.
    prompt_logprobs: int | None = None
    # OpenAI's penalties, over the tokens this sample has generated (not the prompt): a token's logit loses
    # presence_penalty once it has appeared, and frequency_penalty per appearance (sampler.apply_penalties).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    constraint: Constraint | None = None
    # vLLM's SamplingParams, with vLLM's meaning. Applied on the device in vLLM's order (sampler.py): allowed
    # tokens, bad words, min_tokens, logit_bias, then the repetition, frequency and presence penalties; min_p
    # after the temperature, before top-k and top-p.
    repetition_penalty: float | None = None  # > 0; over prompt and output tokens: positive logits / r, negative * r
    min_p: float | None = None  # in [0, 1]: drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # EOS and stop_token_ids are banned (and stop strings ignored) until this many are out
    logit_bias: dict[int, float] | None = None  # model token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be sampled
    bad_words: tuple[str, ...] = ()  # never generated: a word's last token is banned after the rest of it
    include_stop_str_in_output: bool = False  # the text keeps the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # detokenization: special tokens are left out of the text
    spaces_between_special_tokens: bool = True  # detokenization (tokenizers that support it)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens

    def __post_init__(self) -> None:
        # NOTE: user-reachable (library callers build these directly): raise, never assert.
        # 0: the prompt is only computed (scoring, with prompt_logprobs); the request finishes with no token.
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name, bound in (("logprobs", MAX_LOGPROBS), ("prompt_logprobs", MAX_PROMPT_LOGPROBS)):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= bound:
                raise ValueError(f"{name} must be in [0, {bound}] or None, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens):
            raise ValueError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _token_biases(self.logit_bias))
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")

    def with_defaults(self, model_defaults: dict[str, Any], rest_of_context: int) -> ResolvedSampling:
        """Every None replaced: by `model_defaults` (generation_config values, by cbq field name), then by
        `BUILTIN_SAMPLING_DEFAULTS`; max_new_tokens by the model's default, else `rest_of_context`."""
        fallback = {**BUILTIN_SAMPLING_DEFAULTS, "max_new_tokens": rest_of_context, **model_defaults}
        resolved: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        resolved.update({name: value for name, value in fallback.items() if resolved[name] is None})
        return ResolvedSampling(**resolved)


def _token_biases(logit_bias: dict) -> dict[int, float]:
    """logit_bias with int keys (JSON objects key token ids by strings: "50256" is accepted), checked."""
    out = {}
    for token, bias in logit_bias.items():
        try:
            token_id, value = int(token), float(bias)
        except (TypeError, ValueError):
            token_id, value = -1, 0.0
        if isinstance(token, bool) or token_id < 0 or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {token!r}: {bias!r}"
            )
        out[token_id] = value
    return out


@dataclass(frozen=True)
class ResolvedSampling(SamplingParams):
    """A request's sampling as the engine runs it (`SamplingParams.with_defaults`): no field is None."""

    max_new_tokens: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # bad_words as token id sequences, by the engine at admission (each word as is and after a space)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_extras(self) -> bool:
        """Whether its sample rows need work beyond plain sampling (`step.SamplingExtras`) on some step."""
        return (
            self.logprobs is not None
            or self.constraint is not None
            or self.has_penalties
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )


MAX_SAMPLES_PER_REQUEST = MAX_SAMPLES  # bound on `EngineRequest.n` (schemas.limits: OpenAI's own limit)


@dataclass(frozen=True)
class EngineImage:
    """One image of a request, decoded on the worker (`worker/media/`): its RGB pixels (a PIL image, which the
    model's own processor sizes) and a hash of them, by which the encoder and prefix caches know it."""

    content_hash: str
    image: Any


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None  # time.time() when the request entered the system; default: now
    # Parallel samples of this prompt. They share its KV blocks; sample i draws from a stream derived from
    # (seed, i) (`sampler.sample_seed`), sample 0 from the seed itself, so n = 1 gives sample 0.
    n: int = 1
    # OpenAI's and vLLM's servers: a token limit that does not fit the context after the prompt refuses the
    # request (400, context_length_exceeded). Otherwise the limit is capped by the context.
    max_tokens_within_context: bool = False
    # vLLM's: requests share cached prompt blocks only with requests of the same salt (None: no salt).
    cache_salt: str | None = None
    # The chat's images in the order its template renders them; only an engine whose `accepts_images` takes any.
    images: tuple[EngineImage, ...] = ()


def context_length_error(req: EngineRequest, max_model_len: int) -> str | None:
    """Why `req` cannot run in a context of `max_model_len` tokens (ErrorCode.CONTEXT_LENGTH_EXCEEDED), or
    None: a prompt that leaves no token to generate, or a strict token limit past the context."""
    n = len(req.prompt_ids)
    if n >= max_model_len:
        return (
            f"prompt has {n} tokens; the context is {max_model_len} tokens and at least one must be left for "
            "generation"
        )
    wanted = req.sampling.max_new_tokens
    if req.max_tokens_within_context and wanted is not None and n + wanted > max_model_len:
        return (
            f"the model's context length is {max_model_len} tokens, and the request asks for {n + wanted} "
            f"({n} in the prompt, max_tokens {wanted}): lower max_tokens or shorten the prompt"
        )
    return None


@dataclass
class Usage:
    """Per request: the prompt counts once however many samples share it; completion tokens of all samples."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache instead of being computed
    gpu_seconds: float = 0.0  # this request's share (by tokens processed) of each step's device time
    queue_seconds: float = 0.0  # arrival -> first scheduled
    ttft_seconds: float = 0.0  # arrival -> first token known on the host
    latency_seconds: float = 0.0  # arrival -> finished


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the model's raw distribution, and its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (vLLM's `prompt_logprobs` entry): its rank
    in that distribution (1: the most likely) and the top alternatives, whose ranks are 1, 2, ... in order."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class SampleOutput:
    """One of a request's n parallel samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    # When the request asked: one per token of the text, i.e. per token id but a final stop token (EOS or a
    # stop token id), which has none.
    logprobs: list[TokenLogprob] | None = None


@dataclass
class EngineResult:
    """One per request, when all its samples are done. `text`, `token_ids` and a STOP/LENGTH
    `finish_reason` are sample 0's; ERROR or CANCELLED apply to the whole request. For n > 1, `samples`
    holds every sample in index order (it is empty for n = 1: use `all_samples`)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    error: str | None = None
    error_code: ErrorCode | None = None  # set for requests refused before they ran
    logprobs: list[TokenLogprob] | None = None  # sample 0's (see `SampleOutput.logprobs`)
    samples: list[SampleOutput] = field(default_factory=list)
    # When `SamplingParams.prompt_logprobs` is set and the request did not fail: one per prompt token, None for
    # the first (nothing precedes it), as vLLM's `RequestOutput.prompt_logprobs`.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    prompt_ids: list[int] | None = None  # with prompt_logprobs: the prompt they score (after any truncation)

    @property
    def all_samples(self) -> list[SampleOutput]:
        return self.samples or [SampleOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (recomputed ones after preemption count again)
    output_tokens: int = 0
    busy_seconds: float = 0.0  # device time of all steps
    cpu_prep_seconds: float = 0.0  # scheduling + batch building, summed over steps
    wall_seconds: float = 0.0  # since the loop started
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0  # paged KV blocks held by requests when the snapshot was taken
    num_kv_blocks_total: int = 0  # usable blocks (the scratch block excluded)
    mask_seconds: float = 0.0  # host time computing constraint masks, summed over steps
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there (their prefill was skipped)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def busy_fraction(self) -> float:
        return min(1.0, self.busy_seconds / self.wall_seconds) if self.wall_seconds > 0 else 0.0

    @property
    def cpu_prep_ms_per_step(self) -> float:
        return 1000 * self.cpu_prep_seconds / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered, as vLLM's chat requests say it. Default: the template opens the assistant's turn,
    and adds its own BOS (no special tokens are added on top)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("give add_generation_prompt or continue_final_message, not both")


@runtime_checkable
class TokenizerProtocol(Protocol):
    """What the engine, `stop.py` and admission use of a tokenizer (`tokenizer.ByteTokenizer`, `HFTokenizer`)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = ...,
    ) -> list[int]: ...

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str: ...

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (one that `decode` drops), or None."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes, for logprobs (a special token: its name)."""
        ...


@runtime_checkable
class EngineProtocol(Protocol):
    """What the queue worker (`CbqWorker`) and `cbq run` use of an engine; `Engine` and `FakeEngine` satisfy it.

    `add_request`, `abort`, `get_results`, `has_capacity`, `num_unstarted` and `stats` are called from another thread than the
    step loop's, so an implementation makes them thread-safe.
    """

    @property
    def tokenizer(self) -> TokenizerProtocol: ...

    # The defaults the checkpoint's generation_config sets, by cbq field name (what None resolves to first).
    sampling_defaults: dict[str, Any]
    # Whether requests may carry images (`EngineRequest.images`): a vision-language model's engine.
    accepts_images: bool

    def start(self) -> None:
        """Start the step loop in a background thread."""
        ...

    def shutdown(self) -> None:
        """Stop the step loop; requests still in flight get no result."""
        ...

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; a bad one comes back as an ERROR result."""
        ...

    def abort(self, request_id: str) -> None:
        """Finish a request as CANCELLED (ignored if unknown or already finished)."""
        ...

    def get_results(self, timeout: float | None = 0) -> list[EngineResult]:
        """Results finished since the last call, waiting up to `timeout` seconds for the first (0: no wait)."""
        ...

    def has_capacity(self) -> bool:
        """Whether more requests would be useful now."""
        ...

    def num_unstarted(self) -> int:
        """How many added requests (samples) no running slot holds yet: they wait inside the engine."""
        ...

    def stats(self) -> EngineStats: ...
