"""Every numeric sampling value is bounded at validation, and the README lists the fields."""

import json
from pathlib import Path

import pytest

from schemas import limits
from schemas.errors import RequestLineError
from schemas.field_table import field_table, undocumented_fields
from schemas.lines import parse_request_line
from schemas.sampling import OutputConstraint, Sampling

# A line spells its output constraint as one of these fields (an OpenAI body as `response_format`).
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice")


def error_of(obj, line_no=7) -> str:
    with pytest.raises(RequestLineError) as info:
        parse_request_line(json.dumps(obj), line_no)
    return str(info.value)


def openai(body):
    return {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **body}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"max_new_tokens": 2**20 + 1},
            "line 7: max_new_tokens: Input should be less than or equal to 1048576",
        ),
        ({"temperature": 100.5}, "line 7: temperature: Input should be less than or equal to 100"),
        ({"top_k": 2**31}, "line 7: top_k: Input should be less than or equal to 1000000"),
        ({"seed": 2**63}, "line 7: seed: Input should be less than or equal to 9223372036854775807"),
        ({"seed": -(2**63) - 1}, "line 7: seed: Input should be greater than or equal to -9223372036854775808"),
        ({"repetition_penalty": 0}, "line 7: repetition_penalty: Input should be greater than 0"),
        ({"min_p": 1.5}, "line 7: min_p: Input should be less than or equal to 1"),
        ({"min_tokens": -1}, "line 7: min_tokens: Input should be greater than or equal to 0"),
        ({"min_tokens": 5, "max_new_tokens": 4}, "line 7: min_tokens (5) is more than max_new_tokens (4)"),
        ({"logit_bias": {"5": 101}}, "line 7: logit_bias[5]: Input should be less than or equal to 100"),
        ({"logit_bias": {"x": 1}}, "line 7: logit_bias.x.[key]: Input should be a valid integer"),
        ({"allowed_token_ids": []}, "line 7: allowed_token_ids: List should have at least 1 item"),
        ({"bad_words": [""]}, "line 7: bad_words[0]: String should have at least 1 character"),
        ({"truncate_prompt_tokens": 0}, "line 7: truncate_prompt_tokens: Input should be greater than or equal to 1"),
        ({"prompt_logprobs": 21}, "line 7: prompt_logprobs: Input should be less than or equal to 20"),
        ({"prompt_logprobs": -1}, "line 7: prompt_logprobs: Input should be greater than or equal to 0"),
        ({"max_new_tokens": -1}, "line 7: max_new_tokens: Input should be greater than or equal to 0"),
        ({"stop": ["s"] * 17}, "line 7: stop: List should have at most 16 items after validation, not 17"),
        ({"stop": "s" * 257}, "line 7: stop[0]: String should have at most 256 characters"),
        ({"stop_token_ids": list(range(257))}, "line 7: stop_token_ids: List should have at most 256 items"),
        (
            {"stop_token_ids": [1, 2**31]},
            "line 7: stop_token_ids[1]: Input should be less than or equal to 2147483647",
        ),
        ({"logprobs": 21}, "line 7: logprobs: Input should be less than or equal to 20"),
        ({"choice": ["c"] * 1025}, "line 7: choice: List should have at most 1024 items after validation"),
        ({"choice": ["a", ""]}, "line 7: choice[1]: String should have at least 1 character"),
        ({"regex": ""}, "line 7: regex: String should have at least 1 character"),
    ],
)
def test_out_of_bounds_values_name_the_line_and_the_field(fields, expected):
    assert error_of({"prompt": "x", **fields}).startswith(expected)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 2**20 + 1}, "line 7: body.max_tokens: Input should be less than or equal to 1048576"),
        (
            {"max_completion_tokens": 0},
            "line 7: body: max_completion_tokens 0 generates nothing: it is for scoring the prompt, with echo or "
            "prompt_logprobs",
        ),
        ({"top_k": 10**7}, "line 7: body.top_k: Input should be less than or equal to 1000000"),
        (
            {"stop_token_ids": [-1]},
            "line 7: body.stop_token_ids[0]: Input should be greater than or equal to 0",
        ),
        ({"logprobs": 21}, "line 7: body.logprobs: Input should be less than or equal to 20"),
    ],
)
def test_openai_body_has_the_same_bounds(body, expected):
    assert error_of(openai(body)) == expected


def test_values_at_the_bounds_are_accepted():
    at_bounds = {
        "max_new_tokens": 2**20,
        "temperature": 100,
        "top_p": 1.0,
        "top_k": 1_000_000,
        "seed": -(2**63),
        "stop": ["s" * 256] * 16,
        "stop_token_ids": [2**31 - 1] * 256,
        "ignore_eos": True,
        "logprobs": 20,
        "presence_penalty": -2.0,
        "frequency_penalty": 2.0,
        "repetition_penalty": 100.0,
        "min_p": 1.0,
        "min_tokens": 2**20,
        "logit_bias": {str(2**31 - 1): -100.0, "0": 100.0, **{str(i): 1.0 for i in range(1, 1023)}},
        "allowed_token_ids": [2**31 - 1] * 2**18,
        "bad_words": ["w" * 256] * 256,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "truncate_prompt_tokens": 2**20,
        "prompt_logprobs": 20,
    }
    choices = [f"c{i}" for i in range(1024)]
    parsed = parse_request_line(json.dumps({"prompt": "x", **at_bounds, "choice": choices}), 1)
    constraint = OutputConstraint(kind="choice", spec=json.dumps(choices, separators=(",", ":")))
    assert parsed.resolve(0).sampling == Sampling(**at_bounds, constraint=constraint)
    assert parse_request_line(json.dumps({"prompt": "x", "seed": 2**63 - 1}), 1).overrides.seed == 2**63 - 1
    # a new field needs its bounds tested here
    assert set(at_bounds) | {"constraint"} == set(Sampling.model_fields)


def test_the_docs_have_the_generated_field_table_and_it_lists_every_field():
    doc = (Path(__file__).parents[2] / "docs" / "input.md").read_text()
    section = doc[doc.index("<!-- fields:begin") : doc.index("<!-- fields:end")]
    assert field_table() in section, "regenerate it: python docs/generate.py"
    assert undocumented_fields() == []


def test_the_field_table_reads_its_bounds_from_the_limits(monkeypatch):
    monkeypatch.setattr(limits, "MAX_TOP_K", 12_345)
    assert "| `top_k` | generation_config's, else 0 (no cut) | 0 to 12,345; -1 (vLLM's no cut) is 0 |" in field_table()
