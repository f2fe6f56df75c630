"""The sampling fields have one definition (`schemas.request.Sampling`): the engine's SamplingParams, the CLI
flags and admission all follow it, so a field cannot be half-added."""

import dataclasses
import functools
import json

import click
import pytest
from click.testing import CliRunner
from pydantic import Field

from producer.options import sampling_options
from schemas.request import Sampling, overrides_model, parse_request_line
from worker.admission import to_engine_request, to_sampling_params
from worker.engine.api import MAX_LOGPROBS, MAX_PENALTY, Constraint, ConstraintKind, SamplingParams


def test_engine_sampling_params_and_the_schema_name_the_same_fields_with_the_same_defaults():
    engine_fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(engine_fields) == set(Sampling.model_fields)
    assert to_sampling_params(Sampling()) == SamplingParams()
    assert Sampling.model_fields["logprobs"].metadata[-1].le == MAX_LOGPROBS
    for name in ("presence_penalty", "frequency_penalty"):
        bounds = Sampling.model_fields[name].metadata
        assert (bounds[0].ge, bounds[-1].le) == (-MAX_PENALTY, MAX_PENALTY), name


class _Tokenizer:
    def encode(self, text):
        return list(text.encode())


def test_every_field_on_a_line_reaches_the_engine():
    values = {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 11,
        "stop": ["x", "yz"],
        "stop_token_ids": [3, 5],
        "ignore_eos": True,
        "logprobs": 3,
        "presence_penalty": -0.5,
        "frequency_penalty": 1.25,
    }
    spelled = {"constraint": ("regex", "[a-z]+")}  # a line spells its constraint as json_schema, regex or choice
    assert set(values) | set(spelled) == set(Sampling.model_fields)
    line = {"prompt": "hi", **values, "regex": "[a-z]+"}
    request = parse_request_line(json.dumps(line), 1).resolve(0)
    engine_request = to_engine_request(request, _Tokenizer(), "b", 0.0)
    expected = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    expected["constraint"] = Constraint(ConstraintKind.REGEX, "[a-z]+")
    assert dataclasses.asdict(engine_request.sampling) == dataclasses.asdict(SamplingParams(**expected))


# A field added to the one definition, and to the engine's dataclass: nothing else changes.
class _SamplingWithMinP(Sampling):
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens below min_p times the top probability.")


@dataclasses.dataclass(frozen=True)
class _ParamsWithMinP(SamplingParams):
    min_p: float = 0.0


@pytest.fixture
def min_p_command():
    seen = {}

    @click.command()
    @functools.partial(sampling_options, overrides=overrides_model(_SamplingWithMinP))
    def command(defaults):
        seen["defaults"] = defaults

    return command, seen


def test_a_new_field_gets_a_flag_with_its_help_and_bounds(min_p_command):
    command, _ = min_p_command
    help_text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    assert "--min-p FLOAT RANGE Drop tokens below min_p times the top probability. [0<=x<=1]" in help_text
    assert "--top-k INTEGER RANGE" in help_text
    bad = CliRunner().invoke(command, ["--min-p", "2"])
    assert bad.exit_code == 2 and "'--min-p': 2.0 is not in the range 0<=x<=1" in bad.output


def test_a_new_field_reaches_the_engine_from_the_flag_and_from_a_line(min_p_command):
    command, seen = min_p_command
    result = CliRunner().invoke(command, ["--min-p", "0.25", "--top-k", "3", "--stop", "a", "--stop", "b"])
    assert result.exit_code == 0, result.output
    defaults = seen["defaults"]
    assert defaults.given() == {"min_p": 0.25, "top_k": 3, "stop": ["a", "b"]}
    params = to_sampling_params(_SamplingWithMinP(**defaults.given()), _ParamsWithMinP)
    assert (params.min_p, params.top_k, params.stop) == (0.25, 3, ("a", "b"))

    line = overrides_model(_SamplingWithMinP).model_validate({"min_p": 0.5})
    assert to_sampling_params(_SamplingWithMinP(**line.given()), _ParamsWithMinP).min_p == 0.5
