"""The sampling fields have one definition (`schemas.sampling.Sampling`): the engine's SamplingParams, the CLI
flags and admission all follow it, so a field cannot be half-added."""

import dataclasses
import functools
import json

import click
import pytest
from click.testing import CliRunner
from pydantic import Field

from producer.options import sampling_options
from schemas.limits import MAX_LOGPROBS, MAX_PENALTY
from schemas.lines import parse_request_line
from schemas.sampling import Sampling
from worker.admission import to_engine_request, to_sampling_params
from worker.engine.api import Constraint, ConstraintKind, SamplingParams


def test_engine_sampling_params_and_the_schema_name_the_same_fields_with_the_same_defaults():
    engine_fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(engine_fields) == set(Sampling.model_fields)
    assert to_sampling_params(Sampling()) == SamplingParams()
    # Both sides read their bounds from schemas.limits: what a line may give, the engine takes.
    at_bounds = {"logprobs": MAX_LOGPROBS, "presence_penalty": -MAX_PENALTY, "frequency_penalty": MAX_PENALTY}
    assert to_sampling_params(Sampling(**at_bounds)) == SamplingParams(**at_bounds)
    for name, beyond in {"logprobs": MAX_LOGPROBS + 1, "presence_penalty": MAX_PENALTY + 0.5}.items():
        with pytest.raises(ValueError):
            Sampling(**{name: beyond})
        with pytest.raises(ValueError):
            SamplingParams(**{name: beyond})


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
class _SamplingWithEta(Sampling):
    eta_cutoff: float | None = Field(None, ge=0, le=1, description="Drop tokens below this probability.")


@dataclasses.dataclass(frozen=True)
class _ParamsWithEta(SamplingParams):
    eta_cutoff: float = 0.0


@pytest.fixture
def eta_command():
    seen = {}

    @click.command()
    @functools.partial(sampling_options, overrides=_SamplingWithEta)
    def command(defaults):
        seen["defaults"] = defaults

    return command, seen


def test_a_new_field_gets_a_flag_with_its_help_and_bounds(eta_command):
    command, _ = eta_command
    help_text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    assert "--eta-cutoff FLOAT RANGE Drop tokens below this probability. [0<=x<=1]" in help_text
    assert "--top-k INTEGER RANGE" in help_text
    bad = CliRunner().invoke(command, ["--eta-cutoff", "2"])
    assert bad.exit_code == 2 and "'--eta-cutoff': 2.0 is not in the range 0<=x<=1" in bad.output


def test_a_new_field_reaches_the_engine_from_the_flag_and_from_a_line(eta_command):
    command, seen = eta_command
    result = CliRunner().invoke(command, ["--eta-cutoff", "0.25", "--top-k", "3", "--stop", "a", "--stop", "b"])
    assert result.exit_code == 0, result.output
    defaults = seen["defaults"]
    assert defaults.given() == {"eta_cutoff": 0.25, "top_k": 3, "stop": ["a", "b"]}
    params = to_sampling_params(_SamplingWithEta(**defaults.given()), _ParamsWithEta)
    assert (params.eta_cutoff, params.top_k, params.stop) == (0.25, 3, ("a", "b"))

    line = _SamplingWithEta.model_validate({"eta_cutoff": 0.5})
    assert to_sampling_params(_SamplingWithEta(**line.given()), _ParamsWithEta).eta_cutoff == 0.5
