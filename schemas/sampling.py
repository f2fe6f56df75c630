"""The sampling fields: their one definition (names, types, bounds, descriptions) and the output constraint.

`Sampling` is what a line, a batch flag or a stored request says about sampling; None means "not given
here". Its fields come from three bases, by how the input shapes spell them:
- `SharedSampling`: every shape (cbq lines, OpenAI bodies, batch flags) uses the field's own name;
- `NativeSpelling`: `max_new_tokens` and `logprobs`, which OpenAI bodies spell their own way
  (`max_tokens`/`max_completion_tokens`; `logprobs` + `top_logprobs` in chat bodies);
- `Sampling.constraint`: cbq lines spell it `json_schema`/`regex`/`choice`, bodies `response_format`.

Everything else is derived from these classes: the line and body models (`schemas.lines`,
`schemas.openai_body`), the `cbq submit`/`cbq run` flags (`producer.options.sampling_options`) and the
engine's `SamplingParams` (`worker.admission`, by field name; a test checks both sides name the same fields).
To add a field, add it to `SharedSampling` (or `NativeSpelling`) and to `SamplingParams`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from schemas.constraint import compile_error
from schemas.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS_LIMIT,
    MAX_PENALTY,
    MAX_PROMPT_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_SEED,
)
from schemas.strict import StrictModel


def _one_string_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _minus_one_keeps_all(value: Any) -> Any:
    """top_k -1 is vLLM's (and transformers') "no top-k", cbq's 0."""
    return 0 if value == -1 and not isinstance(value, bool) else value


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[
    list[StopString], Field(max_length=MAX_STOP_STRINGS), BeforeValidator(_one_string_is_a_list)
]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
# 0 scores the prompt and generates nothing: a line may give it only with prompt_logprobs (or `echo`,
# completions bodies), `check_scoring` says so.
MaxNewTokens = Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS_LIMIT)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NumPromptLogprobs = Annotated[int, Field(ge=0, le=MAX_PROMPT_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


def _token_ids_as_ints(value: Any) -> Any:
    """JSON object keys are strings: logit_bias's token ids come as "50256" and become ints here."""
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.lstrip("-").isdecimal() else k: v for k, v in value.items()}
    return value


LogitBias = Annotated[
    dict[TokenId, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(max_length=MAX_LOGIT_BIAS_TOKENS),
    BeforeValidator(_token_ids_as_ints),
]
AllowedTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
BadWords = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]], Field(max_length=MAX_BAD_WORDS)
]
# Not a sampling field: the engine takes it on the request (`EngineRequest.n`), and batch flags do not set it.
NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
N_DESCRIPTION = (
    "Independent samples of this prompt (they share its prefill); sample i of a seeded request draws from (seed, i)."
)


def json_text(value: Any) -> str:
    """`value` as compact JSON text (how a constraint's spec is stored)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class OutputConstraint(StrictModel):
    """What the output must match: the engine's `Constraint`. `spec` is the schema as JSON text (`json_schema`),
    the pattern (`regex`) or a JSON list of strings (`choice`); `json_object` has none (`schemas.constraint`)."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    spec: str = ""

    @classmethod
    def checked(cls, kind: str, spec: str = "") -> OutputConstraint:
        """The constraint, if llguidance compiles it (no tokenizer needed); else ValueError with the reason."""
        error = compile_error(kind, spec)
        if error:
            raise ValueError(f"does not compile: {error}")
        return cls(kind=kind, spec=spec)  # type: ignore[arg-type]


class SharedSampling(StrictModel):
    """The sampling fields every input shape spells by their own name. None: not given here (the batch's
    default, else the model's generation_config, else the built-in default applies)."""

    temperature: float | None = Field(
        None,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature; 0 is greedy (default: the model's generation_config, else 0).",
    )
    top_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Keep the most likely tokens up to this total probability; 1 keeps all "
        "(default: the model's generation_config, else 1).",
    )
    top_k: Annotated[int | None, BeforeValidator(_minus_one_keeps_all)] = Field(
        None,
        ge=0,
        le=MAX_TOP_K,
        description="Keep the k most likely tokens; 0 (or -1, vLLM's spelling) keeps all (default: the model's "
        "generation_config, else 0).",
    )
    seed: Seed | None = Field(
        None,
        description="Random seed; without one, the request id seeds the draws. As a batch flag it is every "
        "request's default seed, so a request's draws depend only on it and the request (vLLM's --seed seeds "
        "the engine's one random state instead): lines with the same prompt and seed draw the same tokens.",
    )
    stop: StopStrings | None = Field(None, description="Strings that end the output (the text is cut before them).")
    stop_token_ids: StopTokenIds | None = Field(None, description="Token ids that end the output.")
    ignore_eos: bool | None = Field(None, description="Keep generating after the end-of-sequence token.")
    presence_penalty: Penalty | None = Field(
        None,
        description="Subtracted from the logit of every token the output already contains, as OpenAI's (default 0).",
    )
    frequency_penalty: Penalty | None = Field(
        None,
        description="Subtracted from a token's logit once per time the output already contains it, as OpenAI's "
        "(default 0).",
    )
    # vLLM's SamplingParams beyond OpenAI's, under vLLM's names and bounds.
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=MAX_REPETITION_PENALTY,
        description="As vLLM and transformers: the logit of a token the prompt or the output already contains is "
        "divided by it (multiplied when negative); 1 changes nothing (default: the model's generation_config, "
        "else 1).",
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Drop tokens less likely than min_p times the most likely one; 0 keeps all (default: the "
        "model's generation_config, else 0).",
    )
    min_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_NEW_TOKENS_LIMIT,
        description="Generate at least this many tokens before EOS or a stop token id may end the output "
        "(default 0).",
    )
    logit_bias: LogitBias | None = Field(
        None,
        description="Added to the logits of these token ids, the model's own (as vLLM takes them), before sampling.",
    )
    allowed_token_ids: AllowedTokenIds | None = Field(None, description="Only these token ids may be generated.")
    bad_words: BadWords | None = Field(
        None, description="Words never generated: the last token of each word's tokens is blocked after the others."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="Keep the stop string that ended the output in the text (default: cut before it)."
    )
    skip_special_tokens: bool | None = Field(
        None, description="Leave special tokens out of the text (default: true)."
    )
    spaces_between_special_tokens: bool | None = Field(
        None, description="Put spaces around special tokens kept in the text (default: true)."
    )
    prompt_logprobs: NumPromptLogprobs | None = Field(
        None,
        description="Return each prompt token's log-probability given the tokens before it (the first token has "
        "none), its rank, and this many most likely alternatives (vLLM's field; with max_new_tokens 0 the request "
        "only scores its prompt).",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_NEW_TOKENS_LIMIT,
        description="Keep only the last k tokens of the prompt (default: the whole prompt).",
    )


# The value of a field that asks for nothing: what the engine does without it. A worker whose engine does not
# know a field yet runs a request that gives it at this value, and fails one that asks for more.
NEUTRAL_VALUES: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": {},
    "bad_words": [],
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def check_scoring(max_tokens: int | None, scores_prompt: bool, max_name: str, scoring_fields: str) -> None:
    """A token limit of 0 generates nothing: only a request that scores its prompt may give it."""
    if max_tokens == 0 and not scores_prompt:
        raise ValueError(f"{max_name} 0 generates nothing: it is for scoring the prompt, with {scoring_fields}")


def check_min_tokens(min_tokens: int | None, max_tokens: int | None, max_name: str) -> None:
    """vLLM's rule, for a line that gives both: min_tokens may not exceed the token limit."""
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) is more than {max_name} ({max_tokens})")


class NativeSpelling(StrictModel):
    """The sampling fields that cbq lines and batch flags spell by their name and OpenAI bodies do not."""

    max_new_tokens: MaxNewTokens | None = Field(
        None,
        description="Most tokens to generate (default: the model's generation_config, else the rest of the "
        "context); 0 with prompt_logprobs scores the prompt only. As a batch flag it is a default: a line's "
        "own max_new_tokens (or max_tokens) wins, as in vLLM.",
    )
    logprobs: NumLogprobs | None = Field(
        None, description="Return each output token's log-probability and this many most likely alternatives."
    )


class Sampling(SharedSampling, NativeSpelling):
    """A request's sampling fields, as a line, a batch's flags or the stored request give them; None means
    "not given": the worker's engine fills it from the checkpoint's generation_config.json, else from its
    built-in default (`SamplingParams.with_defaults`), so the model's own defaults apply."""

    constraint: OutputConstraint | None = Field(
        None, description="What the output must match (lines give json_schema, regex or choice)."
    )

    def given(self) -> dict[str, Any]:
        """The fields given here, by name: what wins over the layer below (line over batch over model)."""
        return {name: value for name, value in self if value is not None}
