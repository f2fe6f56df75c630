"""gpt-oss as released (experts in MXFP4) through the one-process loader (`load_model`: models/shard_model.py
`load_whole_model`, the experts by layers/experts.py's reader at a world of one), on the CPU in fp32: the loaded
experts are exactly the dequantized codes and every other parameter exactly the saved tensor; the engine's greedy
output equals `model.generate` of the loaded model token for token (owned and hf decoders, sync and async, chunked
prefill); what cbq does not run is refused in one line. test_engine_moe_gpu.py checks the same load on CUDA in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.fixtures.checkpoints import save_experts_as_mxfp4
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import ModelLoadError, load_model, preset_config
from worker.engine.models.loader import check_moe_fit
from worker.engine.moe.mxfp4 import dequantize_mxfp4

from .conftest import hf_greedy, make_requests
from .test_engine_exact import assert_diverse
from .test_parallel_families import randomize_biases

CPU = torch.device("cpu")
EXPERT_MATRICES = ("gate_up_proj", "down_proj")


def save_tiny_gpt_oss_release(path: Path) -> None:
    """tiny-gpt-oss with random biases, saved as the release ships it (experts in MXFP4) in `path`; and the same
    model with its experts dequantized, saved plainly in `path / "dequantized"`, for comparison."""
    model, _ = load_model("tiny-gpt-oss", CPU, torch.float32)
    randomize_biases(model)  # zeros at init would hide a bias left out
    model.save_pretrained(path, max_shard_size="60KB")
    save_experts_as_mxfp4(model, path)  # the model takes the dequantized experts
    model.save_pretrained(path / "dequantized")


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_tiny_gpt_oss_release(path)
    return path


@pytest.fixture(scope="module")
def loaded(release):
    return load_model(str(release), CPU, torch.float32)


def test_experts_are_the_dequantized_codes_and_the_rest_as_saved(release, loaded):
    model, _ = loaded
    saved = saved_tensors(release)
    assert "quantization_config" not in model.config.to_dict(), "the model must not look quantized to transformers"
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in saved.items():
        if name.endswith("_blocks"):
            stem = name.removesuffix("_blocks")  # [E, out, in] -> transformers' [E, in, out]
            expected[stem] = dequantize_mxfp4(tensor, saved[f"{stem}_scales"], torch.float32).transpose(1, 2)
        elif not name.endswith("_scales"):
            expected[name] = tensor
    assert sum(n.endswith("_blocks") for n in saved) == 2 * model.config.num_hidden_layers
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, param in params.items():
        assert param.dtype == torch.float32 and param.device == CPU, name
        assert torch.equal(param, expected[name]), name
    for layer in model.model.layers:  # the decoder reads the experts as transformers' parameters, contiguous
        assert all(getattr(layer.mlp.experts, m).is_contiguous() for m in EXPERT_MATRICES)


@pytest.fixture(scope="module")
def references(loaded):
    model, tok = loaded
    reqs = make_requests(tok, 12, seed=5, max_prompt=120, max_new=20)
    ref = {r.request_id: hf_greedy(model, tok, r) for r in reqs}
    assert_diverse(ref)
    return reqs, ref


@pytest.mark.parametrize("decoder", ["owned", "hf"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_equals_generate_of_the_loaded_model(loaded, references, mode, decoder):
    model, tok = loaded
    reqs, ref = references
    assert max(len(r.prompt_ids) for r in reqs) > 40, "prompts longer than a step: chunked prefill"
    engine = Engine(model, tok, EngineConfig(mode=mode, decoder=decoder, max_num_batched_tokens=40))
    assert (engine.runner.decoder is not None) == (decoder == "owned")
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.token_ids == ref[req.request_id], req.request_id
    engine.blocks.check_integrity([])


def test_the_release_loads_as_its_dequantized_checkpoint(release, loaded):
    """The same model as the plain checkpoint of its dequantized experts, loaded by transformers (in transformers'
    names and layout, which `state_dict` gives also once an owned decoder has moved the experts)."""
    model, _ = loaded
    plain, _ = load_model(str(release / "dequantized"), CPU, torch.float32)
    plain_params = plain.state_dict()
    state = model.state_dict()
    assert state.keys() == plain_params.keys()
    for name, param in state.items():
        assert torch.equal(param, plain_params[name]), name


def one_line_error(path: Path, **kw) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), CPU, torch.float32, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_mxfp4_on_another_model_is_refused_in_one_line(tmp_path):
    model, _ = load_model("tiny-llama", CPU, torch.float32)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = one_line_error(tmp_path)
    assert message.startswith("config.json quantization_config.quant_method 'mxfp4' on a model other than gpt-oss")
    assert "gpt-oss's MXFP4 experts" in message  # what cbq runs


def test_a_release_missing_a_scales_tensor_is_refused_in_one_line(release, tmp_path):
    from safetensors.torch import save_file

    tensors = saved_tensors(release)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((release / "config.json").read_text())
    message = one_line_error(tmp_path)
    assert "model.layers.1.mlp.experts.down_proj_blocks has no model.layers.1.mlp.experts.down_proj_scales" in message


def test_quantization_fp8_on_the_release_is_refused_in_one_line(release):
    message = one_line_error(release, quantization="fp8")
    assert message.startswith("--quantization fp8 is not supported on gpt-oss's MXFP4 release")


def test_the_fit_check_counts_the_experts_dequantized():
    """gpt-oss-20b as released: the load checks the bf16 size of the experts, held once (the owned decoder moves
    them into its layout a layer at a time), what the GPU will hold, not the 4.25 bits a weight of the file."""
    plain = preset_config("gptoss-20b")
    release = preset_config("gptoss-20b")
    release.quantization_config = {"quant_method": "mxfp4"}
    free = 200 * 10**9
    line = check_moe_fit(release, torch.bfloat16, free)
    assert line == check_moe_fit(plain, torch.bfloat16, free)
    experts_gb = float(line.split("(experts ")[1].split(" GB")[0])
    expert_params = 24 * 32 * 3 * 2880 * 2880  # layers x experts x (gate, up, down) x hidden x intermediate
    assert experts_gb == pytest.approx(expert_params * 2 / 1e9, abs=0.1)  # and their biases; MXFP4: 10 GB
    assert "held twice" not in line
    with pytest.raises(ModelLoadError, match="gpt_oss"):
        check_moe_fit(release, torch.bfloat16, 40 * 10**9)  # 20.9B bf16 parameters


def test_a_hub_release_is_downloaded_without_its_other_copies():
    """gpt-oss's hub repos hold the weights twice (`original/`, another format): only the top level is fetched."""
    from huggingface_hub.utils import filter_repo_objects

    from worker.engine.models.shard_build import DOWNLOAD_ALLOW, DOWNLOAD_IGNORE

    repo = ["config.json", "generation_config.json", "model.safetensors.index.json", "model-00000-of-00002.safetensors",
            "tokenizer.json", "tokenizer_config.json", "original/model.safetensors", "original/config.json",
            "metal/model.bin", "README.md"]  # fmt: skip
    fetched = list(filter_repo_objects(repo, allow_patterns=DOWNLOAD_ALLOW, ignore_patterns=DOWNLOAD_IGNORE))
    assert fetched == repo[:6]
