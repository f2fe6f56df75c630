"""FP8 mixtures of experts as the releases ship them (tests/fixtures/fp8_checkpoints.py `build_fp8_moe_checkpoint`:
Qwen3-*-FP8's block-wise per-expert tensors, GLM-4.5-Air-FP8's per-channel compressed-tensors), through cbq's
loader on the CPU in fp32: the experts are the checkpoint's FP8 values times their scales, exactly (the CPU
dequantizes them at load; sm89+ CUDA keeps them FP8: test_moe_fp8.py), the router as stored; the attention runs as in a dense FP8 model
(kept FP8 with `keep_fp8`, what sm89+ CUDA does); the engine's greedy output equals `model.generate` of the loaded
model token for token (owned and hf decoders, sync and async, chunked prefill); other FP8 formats on a mixture of
experts are refused in one line. The `gpu` test checks the load (experts kept FP8) and the first tokens on CUDA in
bf16.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tests.fixtures.fp8_checkpoints import MOE_FORMATS, Fp8Checkpoint, build_fp8_moe_checkpoint
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import ModelLoadError, load_model
from worker.engine.quant import MOE_RUNS
from worker.engine.quant.linear import Fp8LinearModule

CPU = torch.device("cpu")
BLOCK = 128


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a mapping)
    return tensors


def dequantized(tensors: dict[str, torch.Tensor], linear: str) -> torch.Tensor:
    """A linear's weight as the release means it, in fp32, written out here: e4m3 value times the scale of its
    [128, 128] block (`weight_scale_inv`) or of its row (`weight_scale` [N, 1])."""
    weight = tensors[f"{linear}.weight"]
    assert weight.dtype == torch.float8_e4m3fn, linear
    n, k = weight.shape
    if f"{linear}.weight_scale_inv" in tensors:
        scale = tensors[f"{linear}.weight_scale_inv"].float()
        scale = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    else:
        scale = tensors[f"{linear}.weight_scale"].float()
        assert scale.shape == (n, 1), linear
    return weight.float() * scale


_BUILT: dict[str, Fp8Checkpoint] = {}
_LOADED: dict[tuple[str, bool], tuple[nn.Module, object]] = {}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    def get(fmt: str) -> Fp8Checkpoint:
        if fmt not in _BUILT:
            _BUILT[fmt] = build_fp8_moe_checkpoint(tmp_path_factory.mktemp(fmt), fmt)
        return _BUILT[fmt]

    return get


@pytest.fixture(scope="module")
def loaded(release):
    def get(fmt: str, keep_fp8: bool = False):
        if (fmt, keep_fp8) not in _LOADED:
            _LOADED[fmt, keep_fp8] = load_model(str(release(fmt).path), CPU, torch.float32, keep_fp8=keep_fp8)
        return _LOADED[fmt, keep_fp8]

    return get


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_experts_are_the_dequantized_checkpoint_tensors_exactly(release, loaded, fmt):
    model, _ = loaded(fmt)
    tensors = checkpoint_tensors(release(fmt).path)
    config = model.config
    assert "quantization_config" not in config.to_dict(), "the model must not look quantized to transformers"
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == list(range(getattr(config, "first_k_dense_replace", 0), config.num_hidden_layers))
    num_experts = model.model.layers[sparse[0]].mlp.experts.gate_up_proj.shape[0]
    for i in sparse:
        experts, prefix = model.model.layers[i].mlp.experts, f"model.layers.{i}.mlp.experts"
        for e in range(num_experts):
            gate, up, down = (dequantized(tensors, f"{prefix}.{e}.{p}_proj") for p in ("gate", "up", "down"))
            assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up])), (i, e)
            assert torch.equal(experts.down_proj[e], down), (i, e)
        router = f"model.layers.{i}.mlp.gate.weight"
        assert tensors[router].dtype != torch.float8_e4m3fn, "the release leaves the router unquantized"
        assert torch.equal(model.get_parameter(router), tensors[router].float()), router
    q_proj = "model.layers.0.self_attn.q_proj"  # the attention: dequantized on the CPU, as a dense model's
    assert torch.equal(model.get_parameter(f"{q_proj}.weight"), dequantized(tensors, q_proj))
    if fmt == "ct-channel-dynamic":  # GLM-4.5's fp32 router and correction bias stay fp32 in a bf16 model
        bf16, _ = load_model(str(release(fmt).path), CPU, torch.bfloat16)
        for name in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"):
            assert tensors[name].dtype == torch.float32 and tensors[name].to(torch.bfloat16).float().ne(tensors[name]).any()
            held = bf16.get_buffer(name) if "bias" in name else bf16.get_parameter(name)
            assert torch.equal(held, tensors[name]), name


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_keep_fp8_keeps_the_attention_fp8_and_the_sparse_mlp_dense(release, loaded, fmt):
    """What sm89+ CUDA loads: the attention (and GLM's dense first MLP) as `Fp8LinearModule`s holding the release's
    bytes; the experts, and every linear under a sparse MLP (GLM's shared expert), dequantized."""
    model, _ = loaded(fmt, keep_fp8=True)
    tensors = checkpoint_tensors(release(fmt).path)
    for i, layer in enumerate(model.model.layers):
        q_proj = layer.self_attn.q_proj
        assert isinstance(q_proj, Fp8LinearModule)
        assert torch.equal(q_proj.weight.view(torch.uint8), tensors[f"model.layers.{i}.self_attn.q_proj.weight"].view(torch.uint8))
        if hasattr(layer.mlp, "experts"):
            assert layer.mlp.experts.gate_up_proj.dtype == torch.float32
            under_mlp = [m for m in layer.mlp.modules() if isinstance(m, (nn.Linear, Fp8LinearModule))]
            assert all(type(m) is nn.Linear for m in under_mlp), f"layer {i}: the sparse MLP stays dense"
        else:  # GLM's dense first layer: FP8, as a dense model's MLP
            assert isinstance(layer.mlp.down_proj, Fp8LinearModule)
    plain, _ = loaded(fmt)
    plain_params = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if ".experts." in name or ".shared_experts." in name:
            assert torch.equal(param, plain_params[name]), name


def _requests(vocab_size: int, num: int = 8, seed: int = 5) -> list[EngineRequest]:
    """Mixed prompt lengths, some past a 40-token step (chunked prefill)."""
    rng = random.Random(seed)
    lengths = [1, 3, 90] + [rng.randint(2, 100) for _ in range(num - 3)]
    sampling = [SamplingParams(max_new_tokens=rng.randint(8, 20), temperature=0) for _ in lengths]
    return [
        EngineRequest(f"r{i}", [rng.randrange(vocab_size) for _ in range(n)], s)
        for i, (n, s) in enumerate(zip(lengths, sampling, strict=True))
    ]


def greedy(model, tokenizer, req: EngineRequest) -> list[int]:
    """`generate` on the model alone, stopping on every eos id the engine stops on."""
    ids = torch.tensor([req.prompt_ids], device=model.device)
    eos = sorted(tokenizer.eos_token_ids)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=req.sampling.max_new_tokens,
        eos_token_id=eos, pad_token_id=eos[0],
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


_REFERENCES: dict[tuple[str, bool], tuple[list[EngineRequest], dict[str, list[int]]]] = {}


def references(loaded, fmt: str, keep_fp8: bool = False):
    if (fmt, keep_fp8) not in _REFERENCES:
        model, tok = loaded(fmt, keep_fp8)
        reqs = _requests(model.config.vocab_size)
        _REFERENCES[fmt, keep_fp8] = (reqs, {r.request_id: greedy(model, tok, r) for r in reqs})
    return _REFERENCES[fmt, keep_fp8]


@pytest.mark.parametrize("decoder", ["owned", "hf"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_greedy_equals_generate_of_the_loaded_model(loaded, fmt, mode, decoder):
    model, tok = loaded(fmt)
    reqs, ref = references(loaded, fmt)
    assert len({t for ids in ref.values() for t in ids}) >= 40, "diverse greedy text"
    assert len({tuple(ids) for ids in ref.values()}) == len(ref)
    engine = Engine(model, tok, EngineConfig(mode=mode, decoder=decoder, max_num_batched_tokens=40))
    assert (engine.runner.decoder is not None) == (decoder == "owned")
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.token_ids == ref[req.request_id], req.request_id
    engine.blocks.check_integrity([])


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_owned_decoder_multiplies_the_fp8_attention_and_dense_experts(loaded, fmt):
    """keep_fp8 (sm89+ CUDA's load) on the CPU: the owned decoder fuses the attention's FP8 rows (its GEMM emulated)
    and runs the MoE layer on the dequantized experts; greedy output equals `generate` on the same model."""
    model, tok = loaded(fmt, keep_fp8=True)
    reqs, ref = references(loaded, fmt, keep_fp8=True)
    engine = Engine(model, tok, EngineConfig(decoder="owned", max_num_batched_tokens=40))
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.is_quantized
    sparse = [i for i, w in enumerate(decoder.moe_layers) if w is not None]
    assert sparse and all(decoder.moe_layers[i].experts.gate_up.dtype == torch.float32 for i in sparse)
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.token_ids == ref[req.request_id], req.request_id


def test_quantization_fp8_on_an_moe_quantizes_its_attention_and_dense_mlps_only():
    """`--quantization fp8` on a bf16 mixture of experts (tiny-qwen2-moe: a gated shared expert, layer 0 dense) on the
    CPU: the attention and the dense MLP become FP8, the sparse MLP (experts, shared expert, its gate) stays as it
    was (sm89+ CUDA quantizes the routed experts too: test_moe_fp8.py)."""
    dense, _ = load_model("tiny-qwen2-moe", CPU, torch.float32)
    model, tok = load_model("tiny-qwen2-moe", CPU, torch.float32, quantization="fp8", keep_fp8=True)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8LinearModule)
    for layer, plain in zip(model.model.layers, dense.model.layers, strict=True):
        assert isinstance(layer.self_attn.q_proj, Fp8LinearModule)
        if hasattr(layer.mlp, "experts"):
            assert not any(isinstance(m, Fp8LinearModule) for m in layer.mlp.modules())
            assert torch.equal(layer.mlp.shared_expert.up_proj.weight, plain.mlp.shared_expert.up_proj.weight)
            assert torch.equal(layer.mlp.experts.down_proj, plain.mlp.experts.down_proj)
    engine = Engine(model, tok, EngineConfig(decoder="owned", max_num_batched_tokens=40))
    assert engine.runner.decoder is not None and engine.runner.decoder.is_quantized
    reqs = _requests(256, num=5)
    ref = {r.request_id: greedy(model, tok, r) for r in reqs}
    assert {r.request_id: r.token_ids for r in engine.generate(reqs)} == ref


def _with_quantization_config(release: Fp8Checkpoint, target: Path, quantization_config: dict) -> str:
    target.mkdir()
    for f in release.path.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "quant_method 'fbgemm_fp8'"),
        ("tensor", "quant_method 'compressed-tensors' with per-tensor or block weight scales"),
    ],
)
def test_an_fp8_moe_format_cbq_does_not_read_is_refused_in_one_line(release, tmp_path, change, field):
    fp8 = release("ct-channel-dynamic")
    qc = json.loads((fp8.path / "config.json").read_text())["quantization_config"]
    if change == "tensor":  # RedHatAI's static per-tensor FP8 on a mixture of experts
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
        qc["config_groups"]["group_0"]["input_activations"] |= {"strategy": "tensor", "dynamic": False}
        change = qc
    path = _with_quantization_config(fp8, tmp_path / "other", change)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, CPU, torch.float32)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"config.json quantization_config.{field} on a mixture of experts (glm4_moe) is not supported; {MOE_RUNS}"


def test_per_tensor_fp8_on_an_moe_is_refused_in_one_line(release, tmp_path):
    """quant_method "fp8" without weight_block_size: refused as on a dense model (cbq runs the block-wise one)."""
    path = _with_quantization_config(release("fp8-block"), tmp_path / "per-tensor", {"quant_method": "fp8"})
    with pytest.raises(ModelLoadError, match=r"^config.json quantization_config: quant_method 'fp8' without weight_block_size"):
        load_model(path, CPU, torch.float32)


# -- GPU (H200) ------------------------------------------------------------------------------------------

GPU_TOP1 = 0.6  # test_quant_decoder.py's bound: FP8 re-quantization amplifies last-bit differences


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an sm89+ GPU"
)
@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_gpu_fp8_moe_loads_fp8_attention_and_fp8_experts(release, fmt):
    from worker.engine.moe.fp8 import dequantize_down
    from worker.engine.moe.fp8_experts import Fp8Experts

    cuda = torch.device("cuda")
    fp8 = release(fmt)
    model, tok = load_model(str(fp8.path), cuda, torch.bfloat16)
    tensors = checkpoint_tensors(fp8.path)
    layer = model.model.layers[-1]
    assert isinstance(layer.self_attn.q_proj, Fp8LinearModule), "sm89+ keeps the attention FP8"
    experts, prefix = layer.mlp.experts, f"model.layers.{len(model.model.layers) - 1}.mlp.experts"
    assert isinstance(experts, Fp8Experts), "sm89+ keeps the experts FP8"
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj.is_cuda
    down = dequantize_down(experts.down_proj[3], experts.down_proj_scale[3], experts.format).cpu()
    assert torch.equal(down, dequantized(tensors, f"{prefix}.3.down_proj"))
    engine = Engine(model, tok, EngineConfig(decoder="owned", max_num_batched_tokens=256))
    assert engine.runner.decoder is not None and engine.runner.decoder.is_quantized
    reqs = _requests(model.config.vocab_size, num=16)
    results = engine.generate(reqs)
    firsts = [r.token_ids[:1] == greedy(model, tok, q)[:1] for q, r in zip(reqs, results, strict=True)]
    print(f"{fmt} MoE: first tokens agree with generate() on {sum(firsts)} of 16")
    assert sum(firsts) >= math.ceil(GPU_TOP1 * 16), f"first tokens agree with generate() on {sum(firsts)} of 16"


def test_the_multi_token_prediction_layer_is_not_read(release, tmp_path):
    """GLM-4.5's releases ship one more layer (`num_nextn_predict_layers`, FP8 like the others) that transformers
    does not build: the loader skips it; without that field, such a tensor is named in one line."""
    from safetensors.torch import save_file

    fp8 = release("ct-channel-dynamic")
    path = _with_quantization_config(fp8, tmp_path / "mtp", json.loads((fp8.path / "config.json").read_text())["quantization_config"])
    num_layers = json.loads((fp8.path / "config.json").read_text())["num_hidden_layers"]
    extra = f"model.layers.{num_layers}.eh_proj"
    save_file({f"{extra}.weight": torch.ones(8, 8).to(torch.float8_e4m3fn), f"{extra}.weight_scale": torch.ones(8, 1)},
              str(Path(path) / "mtp.safetensors"))  # fmt: skip
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    index["weight_map"] |= {f"{extra}.weight": "mtp.safetensors", f"{extra}.weight_scale": "mtp.safetensors"}
    (Path(path) / "model.safetensors.index.json").write_text(json.dumps(index))
    for nextn in (1, 0):
        config = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": nextn}))
        if nextn:
            model, _ = load_model(path, CPU, torch.float32)
            assert len(model.model.layers) == num_layers
        else:
            with pytest.raises(ModelLoadError, match=f"the checkpoint has {extra}.weight \\(torch.float8_e4m3fn\\)"):
                load_model(path, CPU, torch.float32)
