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
from schemas.chunk import ChunkPayload
from schemas.limits import MAX_LOGPROBS, MAX_PENALTY
from schemas.lines import parse_request_line
from schemas.sampling import NEUTRAL_VALUES, Sampling
from worker.admission import ChunkWork, UnsupportedField, _expand_one, to_engine_request, to_sampling_params
from worker.engine.api import Constraint, ConstraintKind, SamplingParams

ENGINE_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def test_engine_sampling_params_name_schema_fields_with_the_same_defaults():
    assert ENGINE_FIELDS <= set(Sampling.model_fields)
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
    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


# A value for every field a line can give, not the neutral one (vLLM's names).
LINE_VALUES = {
    "max_new_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 4,
    "seed": -11,
    "stop": ["x", "yz"],
    "stop_token_ids": [3, 5],
    "ignore_eos": True,
    "logprobs": 3,
    "presence_penalty": -0.5,
    "frequency_penalty": 1.25,
    "repetition_penalty": 1.3,
    "min_p": 0.05,
    "min_tokens": 2,
    "logit_bias": {"65": 5.0},
    "allowed_token_ids": [65, 66],
    "bad_words": ["no"],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 1,
    "prompt_logprobs": 2,
}
_SPELLED = {"constraint"}  # a line spells its constraint as json_schema, regex or choice


def _engine_request(fields: dict, model_defaults=None, shape="prompt"):
    if shape == "prompt":
        line = {"prompt": "hi", **fields}
    else:
        line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", **fields}}
    request = parse_request_line(json.dumps(line), 1).resolve(0)
    return to_engine_request(request, _Tokenizer(), "b", 0.0, model_defaults or {})


def test_every_field_on_a_line_reaches_the_engine_or_fails_its_request():
    assert set(LINE_VALUES) | _SPELLED == set(Sampling.model_fields)  # a new field needs a value here
    known = {name: v for name, v in LINE_VALUES.items() if name in ENGINE_FIELDS}
    engine_request = _engine_request({**known, "regex": "[a-z]+"})
    expected = {name: tuple(v) if isinstance(v, list) else v for name, v in known.items()}
    if "logit_bias" in expected:
        expected["logit_bias"] = {65: 5.0}
    expected["constraint"] = Constraint(ConstraintKind.REGEX, "[a-z]+")
    assert dataclasses.asdict(engine_request.sampling) == dataclasses.asdict(SamplingParams(**expected))

    # What the engine does not know yet fails the request by name, unless it asks for nothing.
    for name in set(LINE_VALUES) - ENGINE_FIELDS - {"truncate_prompt_tokens"}:
        with pytest.raises(UnsupportedField, match=f"^{name}=.* is not supported by this worker's engine yet"):
            _engine_request({name: LINE_VALUES[name]})
        if name in NEUTRAL_VALUES:
            _engine_request({name: NEUTRAL_VALUES[name]})


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_prompt():
    assert _engine_request({"truncate_prompt_tokens": 1}).prompt_ids == [ord("i")]
    assert _engine_request({"truncate_prompt_tokens": 9}).prompt_ids == list(b"hi")


def test_a_field_the_engine_lacks_fails_that_request_in_the_worker():
    unknown = next((n for n in NEUTRAL_VALUES if n not in ENGINE_FIELDS), None)
    if unknown is None:
        pytest.skip("the engine knows every field")
    request = parse_request_line(json.dumps({"prompt": "hi", unknown: LINE_VALUES[unknown]}), 1).resolve(3)
    work = ChunkWork(ChunkPayload(batch_id="b", start=3, stop=4), 0.0, 60, False)
    _expand_one(work, 3, request.model_dump_json().encode(), _Tokenizer(), {})
    assert not work.to_run
    (result,) = work.finished_now
    assert (result.finish_reason, result.error_code, result.error_param) == ("error", "unsupported_parameter", unknown)


def test_openai_bodies_default_as_vllm_and_cbq_lines_stay_greedy():
    # Left out: the model's generation_config, else OpenAI's temperature 1 for an OpenAI body.
    assert _engine_request({}, shape="openai").sampling.temperature == 1.0
    assert _engine_request({}, {"temperature": 0.6}, shape="openai").sampling.temperature is None  # the model's
    assert _engine_request({"temperature": 0.0}, shape="openai").sampling.temperature == 0.0
    assert _engine_request({}).sampling.temperature is None  # cbq's lines: the engine's default (greedy)


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


def test_generation_config_defaults_say_greedy_explicitly_when_do_sample_is_false():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from worker.engine.models import GENERATION_CONFIG_FIELDS, generation_defaults

    greedy = SimpleNamespace(generation_config=GenerationConfig(do_sample=False, temperature=0.7, max_new_tokens=9))
    assert generation_defaults(greedy) == {"max_new_tokens": 9, "temperature": 0.0}  # an OpenAI body stays greedy
    sampled = SimpleNamespace(generation_config=GenerationConfig(do_sample=True, temperature=0.7, repetition_penalty=1.3))
    assert generation_defaults(sampled) == {"temperature": 0.7} | (
        {"repetition_penalty": 1.3} if "repetition_penalty" in GENERATION_CONFIG_FIELDS else {}
    )
    # what the checkpoint's generation_config may set is what the engine can apply
    assert set(GENERATION_CONFIG_FIELDS) <= ENGINE_FIELDS


def test_n_samples_of_an_openai_body_without_temperature_differ_as_in_vllm(tmp_path):
    """The issue's case: `n: 3` and no temperature gave one distinct choice of 3. A checkpoint without
    generation_config (the tiny preset): an OpenAI body samples at temperature 1, a cbq line stays greedy."""
    from producer.cli import main

    body = {"model": "tiny-llama", "prompt": "the water is", "max_tokens": 12, "n": 3}
    lines = [
        {"custom_id": "openai", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "native", "prompt": "the water is", "max_new_tokens": 12, "n": 3},
    ]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ran = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--device", "cpu"])
    assert ran.exit_code == 0, ran.output
    openai, native = (json.loads(line) for line in out.read_text().splitlines())
    assert len({s["text"] for s in openai["samples"]}) > 1
    assert len({s["text"] for s in native["samples"]}) == 1
