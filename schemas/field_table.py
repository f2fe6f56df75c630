"""The README's table of request fields, generated from `schemas.limits` and checked against the README by a
test (`python -m schemas.field_table` prints it), so a bound changed in one place cannot go stale in the docs.

Owns the table's wording; the bounds themselves are `schemas.limits`'s.
"""

from __future__ import annotations

from schemas import limits as L
from schemas.lines import CONSTRAINT_FIELDS
from schemas.sampling import Sampling


def _num(value: float) -> str:
    """A bound as the README writes it: 2^20, 2^31-1, 1,000,000, -2."""
    number = int(value) if float(value).is_integer() else value
    if isinstance(number, int) and abs(number) >= 2**16:
        for offset, suffix in ((0, ""), (1, "-1")):
            power = (abs(number) + offset).bit_length() - 1
            if abs(number) + offset == 2**power:
                return f"{'-' if number < 0 else ''}2^{power}{suffix}"
    return f"{number:,}" if isinstance(number, int) else str(number)


# field as the table names it -> (default, bounds).
def _rows() -> dict[str, tuple[str, str]]:
    penalty = f"{_num(-L.MAX_PENALTY)} to {_num(L.MAX_PENALTY)}"
    return {
        "`max_new_tokens` (also `max_tokens`, as vLLM's; OpenAI body: `max_tokens` or `max_completion_tokens`; `null` = not given)": (
            "generation_config's `max_new_tokens`, else the rest of the context (context length minus prompt)",
            f"0 to {_num(L.MAX_NEW_TOKENS_LIMIT)}; 0 (score the prompt, generate nothing) only with `prompt_logprobs` "
            "or a completions body's `echo`",
        ),
        "`temperature`": (
            "generation_config's, else 1 for an OpenAI body (OpenAI's and vLLM's default) and 0 (greedy) for a "
            "cbq line",
            f"0 to {_num(L.MAX_TEMPERATURE)}",
        ),
        "`top_p`": ("generation_config's, else 1", "(0, 1]"),
        "`top_k`": ("generation_config's, else 0 (no cut)", f"0 to {_num(L.MAX_TOP_K)}; -1 (vLLM's no cut) is 0"),
        "`seed`": (
            "none (the request id seeds the draws); the `--seed` flag is every request's default seed (vLLM's "
            "`--seed` seeds the engine instead)", f"any int64: {_num(L.MIN_SEED)} to {_num(L.MAX_SEED)}"),
        "`stop`": (
            "none",
            f"at most {L.MAX_STOP_STRINGS} strings (or one string), each 1 to {L.MAX_STOP_STRING_CHARS} characters",
        ),
        "`stop_token_ids`": ("none", f"at most {L.MAX_STOP_TOKEN_IDS} ids, each 0 to {_num(L.MAX_TOKEN_ID)}"),
        "`ignore_eos`": ("false", "true or false"),
        "`logprobs` (chat body: `logprobs: true` + `top_logprobs`)": (
            "none",
            f"0 to {L.MAX_LOGPROBS} alternatives per token",
        ),
        "`prompt_logprobs`": (
            "none",
            f"0 to {L.MAX_PROMPT_LOGPROBS} alternatives per prompt token (each token's logprob and rank come with "
            "them; the first token's entry is null)",
        ),
        "`echo` (completions body only)": (
            "false",
            "true or false: the choice's text starts with the prompt; with `logprobs`, so do its logprobs",
        ),
        "`presence_penalty`": (
            "0",
            f"{penalty}: subtracted from the logit of every token the output already contains",
        ),
        "`frequency_penalty`": (
            "0",
            f"{penalty}: subtracted from a token's logit once per time the output already contains it",
        ),
        "`repetition_penalty`": (
            "generation_config's, else 1",
            f"(0, {_num(L.MAX_REPETITION_PENALTY)}]: a logit of a token in the prompt or the output is divided by it "
            "(multiplied when negative)",
        ),
        "`min_p`": ("generation_config's, else 0", "0 to 1: drop tokens less likely than min_p times the top one"),
        "`min_tokens`": (
            "0",
            f"0 to {_num(L.MAX_NEW_TOKENS_LIMIT)}, at most the line's max tokens: EOS and stop token ids wait until then",
        ),
        "`logit_bias`": (
            "none",
            f"at most {_num(L.MAX_LOGIT_BIAS_TOKENS)} of the model's token ids, each biased by "
            f"{_num(-L.MAX_LOGIT_BIAS)} to {_num(L.MAX_LOGIT_BIAS)}",
        ),
        "`allowed_token_ids`": ("none (all)", f"1 to {_num(L.MAX_ALLOWED_TOKEN_IDS)} token ids"),
        "`bad_words`": (
            "none",
            f"at most {L.MAX_BAD_WORDS} words, each 1 to {L.MAX_BAD_WORD_CHARS} characters",
        ),
        "`include_stop_str_in_output`": ("false", "true or false"),
        "`skip_special_tokens`": ("true", "true or false"),
        "`spaces_between_special_tokens`": ("true", "true or false"),
        "`truncate_prompt_tokens`": ("none", f"1 to {_num(L.MAX_NEW_TOKENS_LIMIT)}: the prompt's last k tokens are kept"),
        "`json_schema` (OpenAI body: `response_format`)": ("none", "a JSON schema that compiles"),
        "`regex`": ("none", "a pattern (Rust `regex` syntax) that compiles, matched against the whole output"),
        "`choice`": ("none", f"1 to {_num(L.MAX_CHOICES)} non-empty strings; the output is exactly one of them"),
        "`n` (per line or body only, no batch flag)": ("1", f"1 to {L.MAX_SAMPLES} samples of the prompt"),
    }


def documented_fields() -> list[str]:
    """The field names the table documents (its first column's first code span)."""
    return [row.split("`")[1] for row in _rows()]


def field_table() -> str:
    """The markdown table, one row per field a line can give."""
    lines = ["| field | default | bounds |", "|---|---|---|"]
    lines += [f"| {field} | {default} | {bounds} |" for field, (default, bounds) in _rows().items()]
    return "\n".join(lines)


def undocumented_fields() -> list[str]:
    """Fields a line can give that the table leaves out (a test keeps this empty)."""
    wanted = [n for n in Sampling.model_fields if n != "constraint"] + [*CONSTRAINT_FIELDS, "n"]
    return [name for name in wanted if name not in documented_fields()]


if __name__ == "__main__":
    print(field_table())
