"""The family seam (worker/engine/models/): every registry line has its family module and a tiny preset in the
exactness matrix; a config value a family does not implement, a run-time rope and custom code fail the load
with one line; the owned decoder's gate refuses what it does not implement; and every knob a family reads
changes the fixtures' output (so the exactness tests would catch a knob left out)."""

from __future__ import annotations

import dataclasses
import json
from unittest.mock import patch

import pytest
import torch

from tests.fixtures.checkpoints import gemma3_multimodal_model
from tests.fixtures.deepseek_checkpoints import SHAPES as DEEPSEEK_SHAPES
from worker.engine.config import EngineConfig
from worker.engine.decoder import build_decoder, unimplemented, unsupported_reason
from worker.engine.engine import Engine
from worker.engine.families.registry import MODULES, family_of
from worker.engine.models import PRESETS, ModelLoadError, family_for, load_model, preset_config

from .conftest import TINY_FAMILIES, TINY_MOE_FAMILIES, hf_greedy, make_requests

CPU = torch.device("cpu")


@pytest.mark.parametrize("model_type", list(MODULES))
def test_every_registry_line_has_its_family_and_a_preset_in_the_exactness_matrix(model_type):
    family = family_of(model_type)
    assert family is not None and (model_type in family.model_types or model_type in family.wrappers)
    if model_type in {shape["model_type"] for shape in DEEPSEEK_SHAPES.values()}:
        return  # exact from release-shaped checkpoints instead (test_engine_exact_deepseek.py)
    if family.vision is not None:  # a vision-language family: its own checkpoint fixture (test_engine_vision.py)
        return
    # The mixtures of experts have their own exactness matrix (test_engine_exact_moe.py)
    matrix = [*TINY_FAMILIES, *TINY_MOE_FAMILIES]
    assert any(PRESETS[name][0] in family.model_types for name in matrix), f"no tiny preset of {family.name}"


def save_config(tmp_path, preset: str, **changes) -> str:
    config = preset_config(preset)
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("preset", "changes", "message"),
    [
        ("tiny-llama", dict(attn_logit_softcapping=30.0), "sets attn_logit_softcapping=30.0, which cbq does not"),
        ("tiny-llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("tiny-qwen3", dict(residual_multiplier=0.5), "residual_multiplier=0.5"),
        ("tiny-gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        ("tiny-gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (
            "tiny-llama",
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type='dynamic'",
        ),
    ],
)
def test_a_config_value_the_family_does_not_implement_fails_the_load_in_one_line(tmp_path, preset, changes, message):
    path = save_config(tmp_path, preset, **changes)  # config only: refused before any weights are read
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(path, CPU, torch.float32)
    assert "\n" not in str(info.value)


def test_custom_code_checkpoints_are_refused(tmp_path):
    config = {"model_type": "my_lm", "architectures": ["MyLM"], "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="needs custom code .*auto_map.*'my_lm'"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_the_owned_decoder_gate_refuses_what_it_does_not_implement(tiny_models):
    """Each property alone, declared on a family the decoder otherwise runs: the gate names it, `owned` refuses the
    model and `auto` keeps transformers' forward."""
    family, args = family_for(preset_config("tiny-llama"))
    assert unimplemented(family, args) is None
    layer = family.layer
    refused = {
        "post-norms on parallel attention and MLP blocks": dataclasses.replace(
            family, layer=dataclasses.replace(layer, parallel_blocks=True, mlp_out_norm="post_feedforward_layernorm")
        ),
    }
    for reason, declared in refused.items():
        assert reason in (unimplemented(declared, args) or ""), reason
    parallel = dataclasses.replace(family, layer=dataclasses.replace(layer, parallel_blocks=True))
    assert unimplemented(parallel, args) is None
    scaled = dataclasses.replace(args, residual_scale=0.22)
    assert "residual multiplier on parallel" in (unimplemented(parallel, scaled) or "")
    model, _ = tiny_models("tiny-llama")
    declared = refused["post-norms on parallel attention and MLP blocks"]
    with patch("worker.engine.decoder.family_for", return_value=(declared, args)):
        assert unsupported_reason(model) is not None
        with pytest.raises(ValueError, match="does not support"):
            build_decoder(model, "owned", CPU, 64, False)
        assert build_decoder(model, "auto", torch.device("cuda"), 64, False) is None  # transformers' forward


# (preset, DecoderArgs field, a value that leaves it out): each must change the fixture's greedy output.
GREEDY_KNOBS = [
    ("tiny-gemma2", "attn_softcap", None),
    ("tiny-gemma2", "embed_scale", None),
    ("tiny-gemma2", "attention_scale", 16**-0.5),
    ("tiny-granite", "residual_scale", None),
    ("tiny-granite", "embed_scale", None),
    ("tiny-granite", "attention_scale", 16**-0.5),
    ("tiny-smollm3", "nope_layers", ()),
]
# Knobs that keep the argmax (monotonic in the logits): they must show in the logprobs.
LOGIT_KNOBS = [("tiny-gemma2", "final_softcap", None), ("tiny-granite", "logits_divisor", None)]


def leave_out(decoder, field: str, neutral) -> None:
    decoder.args = dataclasses.replace(decoder.args, **{field: neutral})
    if field == "embed_scale":
        decoder.embed_scale = None
    if field == "nope_layers":
        decoder.layer_rope = [decoder.layer_rope[0]] * len(decoder.layers)


@pytest.mark.parametrize(("preset", "field", "neutral"), GREEDY_KNOBS)
def test_every_knob_a_family_reads_changes_the_output(tiny_models, preset, field, neutral):
    model, tok = tiny_models(preset)
    reqs = make_requests(tok, 8, seed=11, max_prompt=120, max_new=24)
    expected = [hf_greedy(model, tok, r) for r in reqs]
    engine = Engine(model, tok, EngineConfig(decoder="owned", num_kv_blocks=96))
    assert [r.token_ids for r in engine.generate(reqs)] == expected
    leave_out(engine.runner.decoder, field, neutral)
    assert [r.token_ids for r in engine.generate(reqs)] != expected, f"{preset}: {field} changes nothing here"


@pytest.mark.parametrize(("preset", "field", "neutral"), LOGIT_KNOBS)
def test_logit_knobs_show_in_the_logprobs(tiny_models, preset, field, neutral):
    model, tok = tiny_models(preset)
    reqs = make_requests(tok, 3, seed=12, max_prompt=40, max_new=8, logprobs=0)
    engine = Engine(model, tok, EngineConfig(decoder="owned", num_kv_blocks=64))

    def max_logprob_error() -> float:
        worst = 0.0
        for req, result in zip(reqs, engine.generate(reqs), strict=True):
            token_ids = result.token_ids[: len(result.logprobs)]  # an eos ending the output has none
            ids = torch.tensor([req.prompt_ids + token_ids])
            with torch.inference_mode():
                logprobs = model(ids).logits[0].log_softmax(-1)
            rows = logprobs[len(req.prompt_ids) - 1 : -1]
            ref = rows.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
            got = torch.tensor([t.logprob for t in result.logprobs])
            worst = max(worst, (got - ref).abs().max().item())
        return worst

    assert max_logprob_error() < 1e-4
    leave_out(engine.runner.decoder, field, neutral)
    assert max_logprob_error() > 1e-2, f"{preset}: {field} changes nothing here"


@pytest.mark.parametrize("decoder", ["hf", "owned"])
def test_the_language_model_of_a_gemma3_multimodal_checkpoint_runs_text_lines(tmp_path, decoder):
    """A Gemma3ForConditionalGeneration checkpoint (4B-27B's layout): cbq loads its language model only, and
    greedy text output equals the whole model's `generate`."""
    whole = gemma3_multimodal_model()
    whole.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), CPU, torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)
    reqs = make_requests(tok, 4, seed=13, max_prompt=60, max_new=16)
    expected = [hf_greedy(whole, tok, r) for r in reqs]
    assert len({t for ids in expected for t in ids}) > 10, "random weights must give varied text"
    engine = Engine(model, tok, EngineConfig(decoder=decoder, num_kv_blocks=64))
    assert [r.token_ids for r in engine.generate(reqs)] == expected


def test_a_checkpoint_without_tokenizer_files_keeps_its_generation_config_eos_ids(tmp_path):
    """The loader joins the checkpoint's eos ids into the tokenizer once; the engine reads them from there."""
    model, _ = load_model("tiny-llama", CPU, torch.float32)
    model.generation_config.eos_token_id = [257, 300]
    model.save_pretrained(tmp_path)  # weights, config and generation_config: no tokenizer files
    loaded, tok = load_model(str(tmp_path), CPU, torch.float32)
    assert tok.eos_token_ids == {257, 300}
    assert Engine(loaded, tok, EngineConfig(num_kv_blocks=8)).eos_token_ids == {257, 300}
