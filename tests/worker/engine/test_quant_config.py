"""quantization_config parsing (worker/engine/quant/config.py): the FP8 formats cbq runs become typed
schemes, with the module rules their releases rely on; everything else is one line that names the field and
what cbq runs, without install advice."""

from __future__ import annotations

import copy

import pytest

from tests.fixtures.fp8_checkpoints import quantization_config
from worker.engine.quant import (
    CBQ_RUNS,
    ActivationScale,
    BlockFp8Config,
    CompressedTensorsFp8Config,
    FbgemmFp8Config,
    Fp8Scheme,
    OnlineFp8Config,
    UnsupportedQuantization,
    WeightScale,
    checkpoint_quantization,
    linear_method,
    refuse_gguf,
)
from worker.engine.quant.methods import (
    BlockFp8LinearMethod,
    CompressedTensorsFp8LinearMethod,
    FbgemmFp8LinearMethod,
    OnlineFp8LinearMethod,
)

QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_block_fp8_as_qwen3_and_deepseek_ship_it():
    quant = checkpoint_quantization(QWEN3_FP8)
    assert quant == BlockFp8Config((128, 128))
    scheme = quant.scheme_for("model.layers.3.mlp.down_proj")
    assert scheme == Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=(128, 128))
    assert scheme.group_size == 128
    assert quant.scheme_for("lm_head") is None
    assert quant.weight_scale_name == "weight_scale_inv"
    # HF's FineGrainedFP8Config may list modules to keep dense: a listed name covers the modules under it
    quant = checkpoint_quantization({**QWEN3_FP8, "modules_to_not_convert": ["model.layers.0.self_attn", "gate"]})
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert quant.scheme_for("model.layers.1.mlp.gate") is None  # a bare name matches wherever it sits
    assert quant.scheme_for("model.layers.1.mlp.gate_proj") is not None
    assert quant.scheme_for("model.layers.10.self_attn.q_proj") is not None


def test_transformers_config_objects_read_as_their_dicts():
    from transformers import FbgemmFp8Config as HfFbgemm
    from transformers import FineGrainedFP8Config

    assert checkpoint_quantization(FineGrainedFP8Config(weight_block_size=(128, 64))) == BlockFp8Config((128, 64))
    fbgemm = checkpoint_quantization(HfFbgemm(activation_scale_ub=900.0, modules_to_not_convert=["lm_head"]))
    assert fbgemm == FbgemmFp8Config(900.0, ("lm_head",))


def test_compressed_tensors_dynamic_static_and_block():
    dynamic = checkpoint_quantization(quantization_config("ct-channel-dynamic", 2))
    assert isinstance(dynamic, CompressedTensorsFp8Config)
    assert dynamic.scheme_for("model.layers.0.mlp.gate_proj") == Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
    assert dynamic.scheme_for("model.layers.0.mlp.gate") is None  # "re:.*mlp.gate$", the MoE router
    assert dynamic.scheme_for("lm_head") is None
    static = checkpoint_quantization(quantization_config("ct-tensor-static", 2))
    assert static.scheme_for("model.layers.1.self_attn.o_proj") == Fp8Scheme(WeightScale.TENSOR, ActivationScale.STATIC)
    block = checkpoint_quantization(quantization_config("ct-block", 2))
    assert block.scheme_for("model.layers.1.self_attn.o_proj") == Fp8Scheme(
        WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=(128, 128)
    )


def test_compressed_tensors_groups_target_by_regex_and_name():
    qc = quantization_config("ct-channel-dynamic", 2)
    attention = copy.deepcopy(qc["config_groups"]["group_0"])
    attention["targets"] = ["re:.*self_attn\\.(q|k|v|o)_proj$"]
    attention["weights"]["strategy"] = "tensor"
    mlp = copy.deepcopy(qc["config_groups"]["group_0"])
    mlp["targets"] = ["model.layers.0.mlp.down_proj"]
    quant = checkpoint_quantization({**qc, "config_groups": {"attn": attention, "mlp": mlp}, "ignore": []})
    assert quant.scheme_for("model.layers.5.self_attn.k_proj").weight is WeightScale.TENSOR
    assert quant.scheme_for("model.layers.0.mlp.down_proj").weight is WeightScale.CHANNEL
    assert quant.scheme_for("model.layers.1.mlp.down_proj") is None  # no group targets it


def test_fbgemm_as_llama_3_1_fp8_ships_it():
    quant = checkpoint_quantization(quantization_config("fbgemm", 2))
    assert isinstance(quant, FbgemmFp8Config) and quant.activation_scale_ub == 1200.0
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert quant.scheme_for("model.layers.0.mlp.up_proj") is None
    assert quant.scheme_for("model.layers.1.mlp.up_proj") == Fp8Scheme(
        WeightScale.CHANNEL, ActivationScale.TOKEN, activation_scale_ub=1200.0
    )


def test_quantization_fp8_on_an_unquantized_checkpoint_and_on_an_fp8_one():
    assert checkpoint_quantization(None) is None
    assert checkpoint_quantization({}) is None
    online = checkpoint_quantization(None, requested="fp8")
    assert isinstance(online, OnlineFp8Config) and not online.is_serialized
    assert online.scheme_for("model.layers.0.mlp.down_proj") == Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
    assert online.scheme_for("lm_head") is None
    assert checkpoint_quantization(QWEN3_FP8, requested="fp8") == BlockFp8Config((128, 128))  # its own format
    with pytest.raises(UnsupportedQuantization, match="--quantization 'int8' is not supported"):
        checkpoint_quantization(None, requested="int8")


@pytest.mark.parametrize(
    ("config", "method"),
    [
        (QWEN3_FP8, BlockFp8LinearMethod),
        (quantization_config("ct-tensor-static", 2), CompressedTensorsFp8LinearMethod),
        (quantization_config("fbgemm", 2), FbgemmFp8LinearMethod),
        (None, OnlineFp8LinearMethod),
    ],
)
def test_each_format_has_its_method(config, method):
    quant = checkpoint_quantization(config, requested=None if config else "fp8")
    found = linear_method(quant, "model.layers.1.mlp.down_proj")
    assert type(found) is method and found.scheme == quant.scheme_for("model.layers.1.mlp.down_proj")
    assert linear_method(quant, "lm_head") is None


def _ct(**group_changes) -> dict:
    qc = quantization_config("ct-channel-dynamic", 2)
    group = qc["config_groups"]["group_0"]
    for key, value in group_changes.items():
        if isinstance(value, dict) and isinstance(group.get(key), dict):
            group[key] = {**group[key], **value}
        else:
            group[key] = value
    return qc


REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "quant_method 'bitsandbytes'"),
    "unknown": ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
    "no method": ({"bits": 4}, "quant_method None"),
    "int8 W8A8": (
        {**_ct(weights={"type": "int"}, input_activations={"type": "int"}), "format": "int-quantized"},
        "format 'int-quantized'",
    ),
    "FP8 weight-only": (_ct(input_activations=None), "FP8 weights without activation quantization (W8A16)"),
    "FP8 static per token": (_ct(input_activations={"dynamic": False}), "float 8-bit, static per token"),
    "FP8 group weights": (_ct(weights={"strategy": "group", "group_size": 128}), "weights.strategy 'group'"),
    "FP8 per-tensor fp8": ({"quant_method": "fp8", "activation_scheme": "static"},
                           "quant_method 'fp8' without weight_block_size (per-tensor FP8)"),
    "FP8 static blocks": ({**QWEN3_FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    "e5m2": ({**QWEN3_FP8, "fmt": "e5m2"}, "fmt 'e5m2'"),
    "bad block": ({**QWEN3_FP8, "weight_block_size": [128]}, "weight_block_size [128]"),
    "FP8 embeddings": ({**QWEN3_FP8, "modules_to_convert": ["embed_tokens"]}, "modules_to_convert ['embed_tokens']"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_everything_else_is_one_clear_line(case):
    config, field = REFUSED[case]
    with pytest.raises(UnsupportedQuantization) as info:
        checkpoint_quantization(config)
    message = str(info.value)
    assert field in message and message.endswith(f" is not supported; {CBQ_RUNS}"), message
    assert "\n" not in message and "install" not in message.lower()
    assert "bf16, fp16 and fp32" in message and "fbgemm_fp8" in message


def test_gguf_is_refused_by_name_and_by_folder(tmp_path):
    with pytest.raises(UnsupportedQuantization, match="model.Q4_K_M.gguf: GGUF is not supported; cbq runs"):
        refuse_gguf(str(tmp_path / "model.Q4_K_M.gguf"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(UnsupportedQuantization, match="GGUF"):
        refuse_gguf(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    refuse_gguf(str(tmp_path))  # a checkpoint folder that also holds a GGUF file is read as a checkpoint
