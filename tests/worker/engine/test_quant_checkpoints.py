"""FP8 checkpoints on the CPU (issue 26, item 5), built as the releases ship them (tests/fixtures/fp8_checkpoints.py):
cbq's loader dequantizes their weights to the compute dtype, and the engine's greedy output equals
`model.generate` on the same dequantized model, built independently (transformers' `from_config`, then the
dequantized state dict set on it). Quantizations cbq does not run end `cbq run` with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

from producer.cli import main
from tests.fixtures.checkpoints import build_checkpoint, corpus
from tests.fixtures.fp8_checkpoints import FORMATS, Fp8Checkpoint, build_fp8_checkpoint
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model
from worker.engine.models.quant_loader import (
    checkpoint_tensors,
    dequantize_state_dict,
    linear_module_names,
    load_dequantized_model,
)
from worker.engine.quant import CBQ_RUNS, OnlineFp8Config, checkpoint_quantization

FAMILY = {"fp8-block": "qwen3", "ct-channel-dynamic": "llama3", "ct-tensor-static": "llama3", "ct-block": "qwen3",
          "fbgemm": "llama3"}  # the families that ship each format
MAX_NEW_TOKENS = 16
FP8_REL = 2.0**-4  # e4m3 rounds a normal value to within 2^-4 of itself


@dataclass
class Loaded:
    fp8: Fp8Checkpoint
    model: object  # through cbq's loader (models.load_model), adopted by the engine
    tokenizer: object
    reference: object  # from_config + the dequantized state dict: generate() runs on this one


_LOADED: dict[str, Loaded] = {}


def reference_model(path, config, quant, dtype=torch.float32):
    """transformers' architecture without its quantizer, random-initialised as usual, then the dequantized
    weights set on it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    plain = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(plain, dtype=dtype).eval()
    state = dequantize_state_dict(checkpoint_tensors(str(path)), quant, dtype, linear_module_names(model))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if plain.tie_word_embeddings else []), missing
    model.generation_config = GenerationConfig.from_pretrained(path)
    return model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    def get(fmt: str) -> Loaded:
        if fmt not in _LOADED:
            from transformers import AutoConfig

            fp8 = build_fp8_checkpoint(tmp_path_factory.mktemp(fmt), fmt, FAMILY[fmt])
            model, tokenizer = load_model(str(fp8.path), torch.device("cpu"), torch.float32)
            config = AutoConfig.from_pretrained(fp8.path)
            reference = reference_model(fp8.path, config, checkpoint_quantization(config.quantization_config))
            _LOADED[fmt] = Loaded(fp8, model, tokenizer, reference)
        return _LOADED[fmt]

    return get


def _prompts(tokenizer) -> list[list[int]]:
    texts = corpus(4, seed=3)
    return [tokenizer.encode(t) for t in texts[:3]] + [tokenizer.encode_chat([{"role": "user", "content": texts[3]}])]


_REFERENCES: dict[tuple, list[int]] = {}


def _generate(model, prompt_ids: list[int]) -> list[int]:
    key = (id(model), tuple(prompt_ids))
    if key not in _REFERENCES:
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        _REFERENCES[key] = out[0, ids.shape[1] :].tolist()
    return _REFERENCES[key]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loader_dequantizes_each_format(loaded, fmt):
    lo = loaded(fmt)
    weights = dict(lo.model.named_parameters())
    reference = dict(lo.reference.named_parameters())
    for name, param in weights.items():  # cbq's loader and the independent reference hold the same weights
        assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name
    quantized = lo.fp8.dense
    assert quantized, "the fixture quantized some linears"
    for name, dense in quantized.items():  # the dequantized weight is the dense one to within FP8's precision
        w, d = weights[name].float(), dense.float()
        assert not torch.equal(w, d), f"{name} went through FP8"
        assert ((w - d).abs() <= FP8_REL * d.abs() + 2**-9 * d.abs().max()).all(), name
    if fmt == "fbgemm":  # modules_to_not_convert stay exactly as written
        assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
        assert "model.layers.0.self_attn.q_proj.weight" not in quantized
        assert "model.layers.1.mlp.up_proj.weight" in quantized


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_equals_generate_on_the_dequantized_model(loaded, fmt, mode):
    lo = loaded(fmt)
    prompts = _prompts(lo.tokenizer)
    engine = Engine(lo.model, lo.tokenizer, EngineConfig(mode=mode, max_num_batched_tokens=32))
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])
    outputs = [r.token_ids for r in results]
    assert outputs == [_generate(lo.reference, ids) for ids in prompts]
    assert len({tuple(o) for o in outputs}) > 1, "diverse greedy text"


def test_quantization_fp8_at_load_rounds_the_weights_and_runs_exact(tmp_path):
    """`--quantization fp8` on a bf16 checkpoint: per-channel FP8 weights, dequantized on the CPU."""
    from transformers import AutoConfig

    build_checkpoint(tmp_path, "llama3", dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), torch.device("cpu"), torch.float32, quantization="fp8")
    dense, _ = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    w, d = model.state_dict()[q_proj], dense.state_dict()[q_proj]
    assert not torch.equal(w, d) and ((w - d).abs() <= FP8_REL * d.abs() + 1e-6).all()
    assert torch.equal(model.state_dict()["lm_head.weight"], dense.state_dict()["lm_head.weight"])
    online = load_dequantized_model(str(tmp_path), config, OnlineFp8Config(), torch.float32)
    assert all(torch.equal(t, online.state_dict()[name]) for name, t in model.state_dict().items())
    reference = reference_model(tmp_path, config, OnlineFp8Config())
    prompts = _prompts(tokenizer)[:3]
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=32))
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])
    assert [r.token_ids for r in results] == [_generate(reference, ids) for ids in prompts]


def _rewrite(fp8: Fp8Checkpoint, target, change) -> str:
    """A copy of the checkpoint with one tensor changed (None: removed)."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for f in fp8.path.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    index = json.loads((target / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(target / shard)
        for name, value in change.items():
            if name in tensors:
                del tensors[name]
                if value is not None:
                    tensors[name] = value
        save_file(tensors, target / shard)
    return str(target)


def _run_cli(model: str, tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "the water", "max_new_tokens": 3}\n')
    return CliRunner().invoke(main, ["run", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--model", model])


def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_checkpoint_whose_tensors_contradict_its_config_is_named(loaded, tmp_path):
    fp8 = loaded("fp8-block").fp8
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    model = _rewrite(fp8, tmp_path / "no-scale", {scale: None})
    line = _one_error_line(_run_cli(model, tmp_path))
    assert line == f"Error: cannot load the checkpoint {model}: Fp8CheckpointError: the checkpoint has no {scale}, " \
        "which its quantization_config needs"


def _awq_checkpoint(path) -> str:
    """An AWQ-shaped folder in a layout cbq does not read: a Llama config with AutoAWQ's GEMV quantization_config and
    packed int4 tensors (the GEMM layout loads: test_quant_int4.py)."""
    from safetensors.torch import save_file

    build_checkpoint(path, "llama3")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemv",
        "zero_point": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    prefix = "model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.qweight": torch.zeros(64, 8, dtype=torch.int32),
               f"{prefix}.qzeros": torch.zeros(1, 8, dtype=torch.int32),
               f"{prefix}.scales": torch.ones(1, 64, dtype=torch.float16)}, path / "awq.safetensors")
    return str(path)


@pytest.mark.parametrize("case", ["awq", "gguf"])
def test_cbq_run_refuses_other_quantizations_in_one_line(tmp_path, case):
    if case == "awq":
        model = _awq_checkpoint(tmp_path / "awq")
        field = "config.json quantization_config.version 'gemv' (AWQ checkpoints in the gemm layout)"
    else:
        model = str(tmp_path / "llama-3-8b.Q4_K_M.gguf")
        (tmp_path / "llama-3-8b.Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
        field = f"{model}: GGUF"
    line = _one_error_line(_run_cli(model, tmp_path))
    assert line == f"Error: {field} is not supported; {CBQ_RUNS}"
    assert "install" not in line


def test_cbq_run_runs_an_fp8_checkpoint(loaded, tmp_path):
    lo = loaded("ct-channel-dynamic")
    result = _run_cli(str(lo.fp8.path), tmp_path)
    assert result.exit_code == 0, result.output
    [line] = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert line["usage"]["completion_tokens"] == 3
