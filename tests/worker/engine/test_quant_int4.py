"""INT4 weight-only checkpoints on the CPU (issue 46, item 4), built as the releases ship them
(tests/fixtures/int4_checkpoints.py: compressed-tensors pack-quantized sym and asym, GPTQ with and without act-order,
AWQ gemm; dense Llama-3-shaped and Qwen3-MoE-shaped). cbq's loader dequantizes every INT4 linear (and expert) to the
compute dtype: each weight is the fixture's own (q - zero) * scale exactly and within half a quantization step of the
weight before quantization (a layout read wrongly lands whole steps away), and the fp32 engine's greedy output
equals `generate` on a transformers model holding the same dequantized weights. INT4 variants cbq does not read are
refused in one line.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from tests.fixtures.checkpoints import corpus
from tests.fixtures.int4_checkpoints import (
    FORMATS,
    GROUP,
    Int4Checkpoint,
    _quantize,
    _words,
    build_int4_checkpoint,
    build_int4_moe_checkpoint,
)
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import ModelLoadError, load_model
from worker.engine.models.quant_loader import checkpoint_tensors
from worker.engine.quant import (
    CBQ_RUNS,
    QuantCheckpointError,
    UnsupportedQuantization,
    checkpoint_quantization,
)
from worker.engine.quant.config import moe_quantization
from worker.engine.quant.int4.awq import AwqConfig
from worker.engine.quant.int4.compressed_tensors import CompressedTensorsInt4Config
from worker.engine.quant.int4.gptq import GptqConfig
from worker.engine.quant.methods import linear_method

CPU = torch.device("cpu")
MAX_NEW_TOKENS = 16
MOE_FORMATS = ("ct-asym", "gptq-act-order", "awq")
CONFIG_TYPES = {"ct": CompressedTensorsInt4Config, "gptq": GptqConfig, "awq": AwqConfig}


@dataclass
class Loaded:
    release: Int4Checkpoint
    model: object  # through cbq's loader (models.load_model)
    tokenizer: object


_BUILT: dict[tuple[str, bool], Int4Checkpoint] = {}
_LOADED: dict[tuple[str, bool], Loaded] = {}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    def get(fmt: str, moe: bool = False) -> Int4Checkpoint:
        if (fmt, moe) not in _BUILT:
            build = build_int4_moe_checkpoint if moe else build_int4_checkpoint
            _BUILT[fmt, moe] = build(tmp_path_factory.mktemp(f"{fmt}-moe" if moe else fmt), fmt)
        return _BUILT[fmt, moe]

    return get


@pytest.fixture(scope="module")
def loaded(release):
    def get(fmt: str, moe: bool = False) -> Loaded:
        if (fmt, moe) not in _LOADED:
            r = release(fmt, moe)
            model, tokenizer = load_model(str(r.path), CPU, torch.float32)
            _LOADED[fmt, moe] = Loaded(r, model, tokenizer)
        return _LOADED[fmt, moe]

    return get


def _within_half_a_step(weight: torch.Tensor, release: Int4Checkpoint, name: str) -> None:
    error = (weight.float() - release.dense[name]).abs()
    assert (error <= release.half_step[name] * (1 + 1e-5) + 1e-7).all(), (name, float((error / release.half_step[name]).max()))


# -- (a) each format's linear reads as the release means it --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_linear_dequantizes_within_half_a_step_of_its_weight(release, fmt):
    r = release(fmt)
    config = json.loads((r.path / "config.json").read_text())
    quant = checkpoint_quantization(config["quantization_config"])
    assert type(quant) is CONFIG_TYPES[fmt.split("-")[0]]
    tensors = checkpoint_tensors(str(r.path))
    assert r.dense
    for name in r.dense:
        module = name.removesuffix(".weight")
        method = linear_method(quant, module)
        assert method is not None, module
        layer = method.load(tensors, module)
        if fmt == "gptq-act-order":
            assert layer.perm is not None, "act-order columns are stored sorted by group"
        assert layer.symmetric == (fmt in ("ct-sym", "gptq")), module
        weight = method.dequantize(layer, torch.float32)
        assert torch.equal(weight, r.dequantized[name]), module
        _within_half_a_step(weight, r, name)
    assert linear_method(quant, "lm_head") is None, "the head stays dense, as the releases ship it"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loader_holds_the_dequantized_weights(loaded, fmt):
    lo = loaded(fmt)
    params = dict(lo.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    for name, expected in lo.release.dequantized.items():
        assert torch.equal(params[name], expected), name


def test_gptq_v2_zeros_are_stored_as_they_are():
    """checkpoint_format gptq_v2 (GPTQModel's) stores each zero point itself; "gptq" (AutoGPTQ's) stores it minus one:
    the same tensors read under the other name land a whole step off."""
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * 0.05
    groups = torch.arange(256) // GROUP
    q, scale, zero = _quantize(weight, groups, symmetric=False, scale_dtype=torch.float16)
    tensors = {"l.qweight": _words(q).t().contiguous(), "l.qzeros": _words(zero.t()), "l.scales": scale.t().contiguous(),
               "l.g_idx": groups.to(torch.int32)}
    expected = (q - zero[:, groups]).float() * scale.float()[:, groups]
    v2 = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": False,
          "checkpoint_format": "gptq_v2"}
    method = linear_method(checkpoint_quantization(v2), "l")
    assert method is not None and torch.equal(method.dequantize(method.load(tensors, "l"), torch.float32), expected)
    v1 = linear_method(checkpoint_quantization({**v2, "checkpoint_format": "gptq"}), "l")
    assert v1 is not None and not torch.equal(v1.dequantize(v1.load(tensors, "l"), torch.float32), expected)


def _one_linear(groups: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype):
    torch.manual_seed(1)
    weight = torch.randn(64, 256) * 0.05
    q, scale, zero = _quantize(weight, groups, symmetric, scale_dtype)
    return weight, q, scale, zero, (q - zero[:, groups]).float() * scale.float()[:, groups]


def test_gptq_one_group_a_row_and_pack_quantized_channel_and_group_act_order():
    """The layouts' other shapes: GPTQ `group_size: -1` (one group over K), compressed-tensors strategy "channel"
    (weight_scale [N, 1]) and actorder "group" (weight_g_idx, the groups a permutation of the columns)."""
    one_group = torch.zeros(256, dtype=torch.int64)
    _, q, scale, zero, expected = _one_linear(one_group, True, torch.float16)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True, "desc_act": False}
    tensors = {"l.qweight": _words(q).t().contiguous(), "l.qzeros": _words((zero - 1).t() & 0xF),
               "l.scales": scale.t().contiguous(), "l.g_idx": one_group.to(torch.int32)}
    method = linear_method(checkpoint_quantization(gptq), "l")
    assert method is not None and torch.equal(method.dequantize(method.load(tensors, "l"), torch.float32), expected)

    ct_channel = _ct(weights={"strategy": "channel", "group_size": None})
    _, q, scale, zero, expected = _one_linear(one_group, True, torch.bfloat16)
    tensors = {"l.weight_packed": _words(q), "l.weight_scale": scale, "l.weight_shape": torch.tensor([64, 256])}
    method = linear_method(checkpoint_quantization(ct_channel), "l")
    assert method is not None and torch.equal(method.dequantize(method.load(tensors, "l"), torch.float32), expected)

    shuffled = torch.empty(256, dtype=torch.int64)
    shuffled[torch.randperm(256, generator=torch.Generator().manual_seed(2))] = torch.arange(256) // GROUP
    weight, q, scale, zero, expected = _one_linear(shuffled, False, torch.bfloat16)
    ct_group = _ct(weights={"symmetric": False, "actorder": "group"})
    tensors = {"l.weight_packed": _words(q), "l.weight_scale": scale, "l.weight_shape": torch.tensor([64, 256]),
               "l.weight_zero_point": _words(zero.t()).t().contiguous(), "l.weight_g_idx": shuffled.to(torch.int32)}
    method = linear_method(checkpoint_quantization(ct_group), "l")
    assert method is not None
    layer = method.load(tensors, "l")
    assert layer.perm is not None and torch.equal(method.dequantize(layer, torch.float32), expected)
    assert ((expected - weight).abs() <= scale.float()[:, shuffled] / 2 * (1 + 1e-5) + 1e-7).all()


def test_a_missing_or_misshapen_tensor_is_named(release):
    r = release("gptq")
    quant = checkpoint_quantization(json.loads((r.path / "config.json").read_text())["quantization_config"])
    tensors = dict(checkpoint_tensors(str(r.path)).items())
    module = "model.layers.0.mlp.down_proj"
    method = linear_method(quant, module)
    assert method is not None
    with pytest.raises(QuantCheckpointError, match=f"the checkpoint has no {module}.qzeros"):
        method.load({k: v for k, v in tensors.items() if k != f"{module}.qzeros"}, module)
    with pytest.raises(QuantCheckpointError, match=f"{module}.scales is"):
        method.load({**tensors, f"{module}.scales": tensors[f"{module}.scales"][:1]}, module)


def test_keep_int4_keeps_each_linear_packed_as_the_release_means_it(release):
    """The packed path (the W4A16 GEMMs on CUDA; test_int4_decoder.py decodes with it): each quantized linear an
    `Int4LinearModule` whose weight dequantizes to the dequantized load's, bit for bit."""

    from worker.engine.quant.int4 import dequantize
    from worker.engine.quant.int4.linear import Int4LinearModule

    r = release("awq")
    model, _ = load_model(str(r.path), torch.device("cpu"), torch.float32, keep_int4=True)
    packed = {name: m for name, m in model.named_modules() if isinstance(m, Int4LinearModule)}
    assert "model.layers.1.self_attn.q_proj" in packed and "lm_head" not in packed
    for name, module in packed.items():
        assert torch.equal(dequantize(module.layer, torch.float32), r.dequantized[f"{name}.weight"].float()), name


# -- (b) greedy output equals generate on the dequantized weights ----------------------------------------------------


def reference_model(release: Int4Checkpoint):
    """transformers' architecture without a quantizer, the checkpoint's unquantized tensors and the fixture's own
    dequantized weights set on it (nothing of cbq's loader)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(release.path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    for shard in sorted(release.path.glob("model*.safetensors")):
        state |= {n: t.float() for n, t in load_file(shard).items() if t.is_floating_point() and n.endswith(".weight")}
    state |= release.dequantized
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if config.tie_word_embeddings else []), missing
    model.generation_config = GenerationConfig.from_pretrained(release.path)
    return model


_REFERENCE: dict[str, object] = {}
_GENERATED: dict[tuple, list[int]] = {}


def _generate(model, prompt_ids: list[int]) -> list[int]:
    key = (id(model), tuple(prompt_ids))
    if key not in _GENERATED:
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        _GENERATED[key] = out[0, ids.shape[1] :].tolist()
    return _GENERATED[key]


def _prompts(tokenizer) -> list[list[int]]:
    texts = corpus(4, seed=3)
    return [tokenizer.encode(t) for t in texts[:3]] + [tokenizer.encode_chat([{"role": "user", "content": texts[3]}])]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_equals_generate_on_the_dequantized_model(loaded, fmt, mode):
    lo = loaded(fmt)
    if fmt not in _REFERENCE:
        _REFERENCE[fmt] = reference_model(lo.release)
    prompts = _prompts(lo.tokenizer)
    engine = Engine(lo.model, lo.tokenizer, EngineConfig(mode=mode, max_num_batched_tokens=32))
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])
    outputs = [r.token_ids for r in results]
    assert outputs == [_generate(_REFERENCE[fmt], ids) for ids in prompts]
    assert len({tuple(o) for o in outputs}) > 1, "diverse greedy text"


@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_moe_experts_are_the_dequantized_release(loaded, fmt):
    """Every expert's gate/up/down (stacked by transformers as gate_up_proj [E, 2I, H], down_proj [E, H, I]) is the
    fixture's dequantized linear exactly; the router stays as the release stores it."""
    lo = loaded(fmt, moe=True)
    params = dict(lo.model.named_parameters())
    deq = lo.release.dequantized
    num_experts = params["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
    for layer in range(lo.model.config.num_hidden_layers):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(num_experts):
            gate, up, down = (deq[f"{experts}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            assert torch.equal(params[f"{experts}.gate_up_proj"][e], torch.cat([gate, up])), (layer, e)
            assert torch.equal(params[f"{experts}.down_proj"][e], down), (layer, e)
            _within_half_a_step(down, lo.release, f"{experts}.{e}.down_proj.weight")
        router = params[f"model.layers.{layer}.mlp.gate.weight"]
        assert not router.float().eq(0).all()
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert torch.equal(params[name], deq[name]), name


@pytest.mark.parametrize(("mode", "decoder"), [("sync", "owned"), ("async", "owned"), ("sync", "hf")])
@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_moe_greedy_equals_generate_of_the_dequantized_model(loaded, fmt, mode, decoder):
    lo = loaded(fmt, moe=True)
    prompts = _prompts(lo.tokenizer)
    engine = Engine(lo.model, lo.tokenizer, EngineConfig(mode=mode, decoder=decoder, max_num_batched_tokens=40))
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])
    outputs = [r.token_ids for r in results]
    assert outputs == [_generate(lo.model, ids) for ids in prompts]  # the loaded weights are the release's: above
    assert len({tuple(o) for o in outputs}) > 1, "diverse greedy text"


# -- (c) what cbq does not read, in one line -------------------------------------------------------------------------

_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
_CT_WEIGHTS = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False}


def _ct(weights=None, inputs=None, fmt="pack-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": {**_CT_WEIGHTS, **(weights or {})}, "input_activations": inputs,
             "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}


REFUSED = {
    "gptq 8-bit": ({**_GPTQ, "bits": 8}, "quantization_config.bits 8"),
    "gptq 3-bit": ({**_GPTQ, "bits": 3}, "quantization_config.bits 3"),
    "gptq marlin": ({**_GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    "gptq bitblas": ({**_GPTQ, "checkpoint_format": "bitblas"}, "checkpoint_format 'bitblas'"),
    "gptq quantized head": ({**_GPTQ, "lm_head": True}, "lm_head true"),
    "gptq dynamic": ({**_GPTQ, "dynamic": {"-:.*mlp.*": {}}}, "quantization_config.dynamic"),
    "gptq odd group": ({**_GPTQ, "group_size": 100}, "group_size 100"),
    "awq gemv": ({**_AWQ, "version": "gemv"}, "version 'gemv'"),
    "awq exllama": ({**_AWQ, "version": "exllama"}, "version 'exllama'"),
    "awq marlin": ({**_AWQ, "version": "marlin"}, "version 'marlin'"),
    "awq 8-bit": ({**_AWQ, "bits": 8}, "quantization_config.bits 8"),
    "awq no zero point": ({**_AWQ, "zero_point": False}, "zero_point False"),
    "ct int8 packed": (_ct(weights={"num_bits": 8}), "int 8-bit pack-quantized"),
    "ct W4A8": (_ct(inputs={"type": "int", "num_bits": 8, "dynamic": True, "strategy": "token"}),
                "input_activations (INT4 weights with quantized activations)"),
    "ct int8 W8A8": (_ct(weights={"num_bits": 8}, inputs={"type": "int", "num_bits": 8}, fmt="int-quantized"),
                     "format 'int-quantized'"),
    "ct tensor strategy": (_ct(weights={"strategy": "tensor"}), "strategy 'tensor' with INT4 weights"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "quant_method 'bitsandbytes'"),
    "hqq": ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_int4_variants_cbq_does_not_read_are_one_line(case):
    config, field = REFUSED[case]
    with pytest.raises(UnsupportedQuantization) as info:
        checkpoint_quantization(config)
    message = str(info.value)
    assert field in message and message.endswith(f" is not supported; {CBQ_RUNS}"), message
    assert "\n" not in message and "gptq" in message and "awq" in message


@pytest.mark.parametrize("config", [_GPTQ, _AWQ, _ct()])
def test_the_int4_formats_are_accepted_on_a_mixture_of_experts(config):
    quant = moe_quantization(config, "qwen3_moe")
    assert quant is not None and quant.scheme_for("model.layers.0.mlp.experts.3.down_proj") is not None


def test_a_refused_checkpoint_fails_to_load_in_one_line(release, tmp_path):
    r = release("gptq")
    target = tmp_path / "gptq-8bit"
    shutil.copytree(r.path, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load_model(str(target), CPU, torch.float32)
    assert str(info.value) == f"config.json quantization_config.bits 8 (gptq at 8 bits) is not supported; {CBQ_RUNS}"


def test_quantized_weights_pickled_in_pytorch_model_bin_are_refused_in_one_line(release, tmp_path):
    """The one loader reads safetensors; a folder of pickled weights only takes transformers' from_pretrained, which
    cbq runs unquantized only: a quantized one is refused in one line rather than loaded by another route."""
    from safetensors.torch import load_file

    r = release("gptq")
    target = tmp_path / "gptq-pickled"
    shutil.copytree(r.path, target)
    state = {}
    for shard in sorted(target.glob("model*.safetensors")):
        state |= load_file(shard)
        shard.unlink()
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save(state, target / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(target), CPU, torch.float32)
    assert "\n" not in str(info.value) and "pytorch_model*.bin" in str(info.value) and "safetensors" in str(info.value)


@pytest.mark.parametrize("fmt", ["gptq-act-order", "awq", "ct-asym"])
def test_a_gate_up_shipped_fused_reads_each_output_as_shipped_apart(release, fmt):
    """Phi-3 and GLM-4 ship gate_up_proj fused: a merged layer reads each output's entries of every packed tensor
    (along the dim that follows the rows: 1 for GPTQ's and AWQ's [K, N] layouts) as it reads gate and up apart; kept
    packed, its GEMM is the same weight's."""
    from worker.engine.checkpoint import ModelSource
    from worker.engine.layers.linear import MergedColumnParallelLinear
    from worker.engine.parallel.group import ParallelState
    from worker.engine.quant.methods import LinearMethods

    r = release(fmt)
    quant = checkpoint_quantization(json.loads((r.path / "config.json").read_text())["quantization_config"])
    tensors, mlp = checkpoint_tensors(str(r.path)), "model.layers.0.mlp"
    method = LinearMethods(quant).method_for(f"{mlp}.gate_proj")
    apart, fused = {}, {}
    for spec in method.tensors():  # type: ignore[attr-defined]
        names = [f"{mlp}.{p}_proj.{spec.name}" for p in ("gate", "up")]
        if names[0] not in tensors:  # an optional tensor the release leaves out
            continue
        parts = [tensors[name] for name in names]
        apart |= dict(zip(names, parts, strict=True))
        # the rows' tensors stacked; g_idx (the input columns' groups) and the shape as gate's
        fused[f"{mlp}.gate_up_proj.{spec.name}"] = parts[0] if spec.output_dim is None else torch.cat(parts, spec.output_dim)
    if fmt == "gptq-act-order":  # one g_idx for both, as a fused release's: the columns are ordered once
        apart[f"{mlp}.up_proj.g_idx"] = apart[f"{mlp}.gate_proj.g_idx"]
    one = ParallelState.single(CPU)
    read_apart = MergedColumnParallelLinear(256, [384, 384], one, dtype=torch.float32, method=method)
    read_apart.load_merged(ModelSource(apart), [f"{mlp}.gate_proj", f"{mlp}.up_proj"])
    read_fused = MergedColumnParallelLinear(256, [384, 384], one, dtype=torch.float32, method=method)
    read_fused.load_fused(ModelSource(fused), f"{mlp}.gate_up_proj")
    assert torch.equal(read_fused.weight, read_apart.weight)
    kept = MergedColumnParallelLinear(256, [384, 384], one, dtype=torch.float32, method=method.kept(True))  # type: ignore[attr-defined]
    kept.load_fused(ModelSource(fused), f"{mlp}.gate_up_proj")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kept(x), x @ read_fused.weight.t())  # kept packed: the same weight's GEMM
    if fmt != "gptq-act-order":
        assert torch.equal(read_fused.weight, torch.cat([r.dequantized[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")]))


def test_a_packed_tensor_of_a_linear_the_config_leaves_dense_is_named(release, tmp_path):
    """The slice reader accounts for every INT4 tensor it reads; one nobody read (a packed head the config leaves
    dense) is named in one line rather than ignored."""
    from tests.fixtures.fp8_checkpoints import _read_checkpoint, _save_sharded

    target = tmp_path / "packed-head"
    shutil.copytree(release("ct-sym").path, target)
    _, tensors = _read_checkpoint(target)
    for shard in target.glob("model*.safetensors"):
        shard.unlink()
    _save_sharded({**tensors, "lm_head.weight_packed": torch.zeros(8, 32, dtype=torch.int32)}, target)
    with pytest.raises(ModelLoadError, match=r"has lm_head.weight_packed .*leaves lm_head unquantized"):
        load_model(str(target), CPU, torch.float32)


@pytest.mark.parametrize("fmt", ["gptq-act-order", "ct-asym"])
def test_a_rank_of_tensor_parallelism_reads_an_int4_checkpoint_through_the_same_methods(release, fmt):
    """The sharded loader reads INT4 linears by slice through their methods, as one process does: a rank of a world
    of one holds the dequantized release (test_parallel_fp8.py runs TP=2)."""
    from worker.engine.models.shard_model import load_shard
    from worker.engine.parallel.group import ParallelState

    r = release(fmt)
    model, _, _ = load_shard(str(r.path), ParallelState(rank=0, world_size=1, device=CPU), EngineConfig())
    params = dict(model.named_parameters())
    for name, expected in r.dequantized.items():
        assert torch.equal(params[name], expected), name


# -- on a GPU (the lead's `-m gpu` run): dequantized at load in bf16 until the W4A16 GEMM keeps them packed ---------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("fmt", "moe"), [("gptq-act-order", False), ("ct-asym", False), ("awq", True)])
def test_gpu_int4_checkpoint_loads_dequantized_and_runs_the_owned_decoder(release, fmt, moe):
    cuda = torch.device("cuda")
    r = release(fmt, moe)
    model, tok = load_model(str(r.path), cuda, torch.bfloat16, keep_int4=False)  # kept packed: test_int4_decoder.py
    params = dict(model.named_parameters())
    name = "model.layers.1.self_attn.q_proj.weight"
    assert params[name].dtype == torch.bfloat16 and params[name].is_cuda
    assert torch.equal(params[name].cpu(), r.dequantized[name].to(torch.bfloat16))
    engine = Engine(model, tok, EngineConfig(decoder="owned", max_num_batched_tokens=256))
    assert engine.runner.decoder is not None
    prompts = _prompts(tok)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])
    firsts = [res.token_ids[:1] == _generate(model, ids)[:1] for ids, res in zip(prompts, results, strict=True)]
    print(f"{fmt} ({'MoE' if moe else 'dense'}) on the GPU: first tokens agree with generate() on {sum(firsts)} of 4")
    assert sum(firsts) >= 3
