"""Mixtures of experts through the whole engine (fp32, CPU): greedy output equals `model.generate` token for
token for each tiny MoE preset (Qwen3-MoE, Qwen2-MoE with its shared expert and a dense layer, Mixtral, gpt-oss
with its attention sinks, alternating sliding windows and biased experts, GLM-4.5 with its grouped sigmoid
routing, correction bias, shared expert, dense first layer and partial rotary, with and without q/k norms), in sync
and async mode, with chunked prefill, forced preemption, the prefix cache on and off, through transformers'
forward ("hf", its own expert loop) and cbq's owned decoder ("owned": `moe.moe_forward`, the reference on CPU)."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.moe import triton_moe

from .conftest import TINY_MOE_FAMILIES, hf_greedy, make_requests
from .test_engine_exact import assert_diverse
from .test_engine_prefix_cache import assert_clean, shared_prefix_requests
from .test_fused_kernels import _interpret

SCENARIOS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=40),
    "preemption": dict(num_kv_blocks=24, max_num_batched_tokens=128),
}

_REFERENCES: dict[tuple[str, str], tuple[list, dict]] = {}


def references(tiny_models, name: str, kind: str):
    """`kind` "mixed": mixed prompt lengths; "shared": prompts over shared prefixes (for the prefix cache)."""
    if (name, kind) not in _REFERENCES:
        model, tok = tiny_models(name)
        seed = zlib.crc32(name.encode()) % 1000
        if kind == "mixed":
            reqs = make_requests(tok, 14, seed=seed, max_prompt=160, max_new=24)
        else:
            reqs = shared_prefix_requests(tok, seed=seed, num=12, max_new=16)
        _REFERENCES[name, kind] = (reqs, {r.request_id: hf_greedy(model, tok, r) for r in reqs})
    return _REFERENCES[name, kind]


def run_and_compare(model, tok, reqs, ref, config: EngineConfig) -> Engine:
    engine = Engine(model, tok, config)
    assert (engine.runner.decoder is not None) == (config.decoder == "owned")
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.token_ids == ref[req.request_id], f"{req.request_id} (prompt {len(req.prompt_ids)} tokens)"
    assert_clean(engine)
    return engine


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", TINY_MOE_FAMILIES)
def test_greedy_equals_generate(tiny_models, name, scenario, mode, decoder):
    model, tok = tiny_models(name)
    reqs, ref = references(tiny_models, name, "mixed")
    assert_diverse(ref)
    config = EngineConfig(mode=mode, decoder=decoder, enable_prefix_caching=False, **SCENARIOS[scenario])
    engine = run_and_compare(model, tok, reqs, ref, config)
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    if scenario == "chunked_prefill":
        assert max(len(r.prompt_ids) for r in reqs) > 40


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", TINY_MOE_FAMILIES)
def test_greedy_with_prefix_cache_equals_generate(tiny_models, name, mode, decoder):
    model, tok = tiny_models(name)
    reqs, ref = references(tiny_models, name, "shared")
    config = EngineConfig(mode=mode, decoder=decoder, enable_prefix_caching=True, max_num_batched_tokens=40)
    engine = run_and_compare(model, tok, reqs, ref, config)
    assert engine.stats().prefix_cache_hits > 0


def test_sparse_and_dense_layers_as_declared(tiny_models):
    """tiny-qwen2-moe's layer 0 is dense (mlp_only_layers) and layer 1 sparse with a gated shared expert: the owned
    decoder reads them so, and the experts it runs are the model's own tensors (no copy)."""
    model, tok = tiny_models("tiny-qwen2-moe")
    decoder = Engine(model, tok, EngineConfig(decoder="owned")).runner.decoder
    dense, sparse = decoder.moe_layers
    assert dense is None and decoder.layers[0].gate_up_weight is not None
    assert sparse is not None and decoder.layers[1].gate_up_weight is None
    assert sparse.shared is not None and sparse.shared.gate is not None
    experts = model.model.layers[1].mlp.experts
    assert sparse.experts.gate_up.data_ptr() == experts.gate_up_proj.data_ptr()
    assert sparse.experts.down.data_ptr() == experts.down_proj.data_ptr()


def test_glm4_moe_layers_as_declared(tiny_models):
    """tiny-glm4-moe's layer 0 is dense (first_k_dense_replace) and layer 1 sparse, with the ungated shared
    expert and the router's correction bias (the model's own buffer, which the fixture made non-zero); the
    q/k norms are read where use_qk_norm builds them and absent where it does not (the Air preset)."""
    model, tok = tiny_models("tiny-glm4-moe")
    decoder = Engine(model, tok, EngineConfig(decoder="owned")).runner.decoder
    dense, sparse = decoder.moe_layers
    assert dense is None and decoder.layers[0].gate_up_weight is not None
    assert sparse is not None and decoder.layers[1].gate_up_weight is None
    assert sparse.shared is not None and sparse.shared.gate is None
    router = model.model.layers[1].mlp.gate
    assert sparse.score_correction_bias is router.e_score_correction_bias
    assert sparse.score_correction_bias.abs().min() > 0
    assert all(w.q_norm is not None and w.k_norm is not None for w in decoder.layers)
    air, air_tok = tiny_models("tiny-glm4-moe-air")
    air_decoder = Engine(air, air_tok, EngineConfig(decoder="owned")).runner.decoder
    assert all(w.q_norm is None and w.k_norm is None for w in air_decoder.layers)


def _without_correction_bias(decoder) -> None:
    decoder.moe_layers = [
        None if w is None else dataclasses.replace(w, score_correction_bias=torch.zeros_like(w.score_correction_bias))
        for w in decoder.moe_layers
    ]


# Each routing knob GLM-4.5 reads, left out of the owned decoder: the fixture's greedy output must change (so the
# exactness matrix above would catch an implementation that ignored it).
GLM_KNOBS = {
    "correction bias": _without_correction_bias,
    "groups": lambda d: setattr(d, "moe_spec", dataclasses.replace(d.moe_spec, num_groups=1, topk_groups=1)),
    "routed_scaling_factor": lambda d: setattr(d, "moe_spec", dataclasses.replace(d.moe_spec, routed_scaling_factor=1.0)),
    "shared expert": lambda d: setattr(d, "moe_layers", [w and dataclasses.replace(w, shared=None) for w in d.moe_layers]),
}


@pytest.mark.parametrize("knob", list(GLM_KNOBS))
def test_every_glm4_moe_routing_knob_changes_the_output(tiny_models, knob):
    model, tok = tiny_models("tiny-glm4-moe")
    reqs, ref = references(tiny_models, "tiny-glm4-moe", "mixed")
    engine = Engine(model, tok, EngineConfig(decoder="owned"))
    assert [r.token_ids for r in engine.generate(reqs)] == [ref[r.request_id] for r in reqs]
    GLM_KNOBS[knob](engine.runner.decoder)
    assert [r.token_ids for r in engine.generate(reqs)] != [ref[r.request_id] for r in reqs], knob


# The owned decoder with the Triton experts (what CUDA runs: a workspace from the largest step, the grouped GEMMs),
# through Triton's interpreter on the CPU, in a subprocess since TRITON_INTERPRET must be set before triton loads.
TRITON_CHECK = """
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
_patch_triton_interpreter()  # runtime loop bounds under numpy 2.4
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.moe import MoeWorkspace
from tests.worker.engine.conftest import hf_greedy, load_tiny, make_requests

for name in ("tiny-qwen2-moe", "tiny-gpt-oss", "tiny-glm4-moe"):
    model, tok = load_tiny(name)
    reqs = make_requests(tok, 3, seed=2, max_prompt=40, max_new=6)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    engine = Engine(model, tok, EngineConfig(decoder="owned", max_num_batched_tokens=64))
    decoder = engine.runner.decoder
    decoder.moe_workspace = MoeWorkspace.allocate(decoder.moe_spec, 64, torch.float32, torch.device("cpu"))
    assert [r.token_ids for r in engine.generate(reqs)] == ref, name
print("owned decoder with triton experts equals generate")
"""


@pytest.mark.skipif(not triton_moe.HAVE_TRITON, reason="triton is not installed")
def test_owned_decoder_with_the_triton_experts_equals_generate_in_the_interpreter():
    _interpret(TRITON_CHECK, "owned decoder with triton experts equals generate")


@pytest.mark.parametrize(
    "preset,field,value",
    [
        ("tiny-qwen3-moe", "hidden_act", "gelu"),  # experts compute silu(gate) * up
        ("tiny-mixtral", "routed_scaling_factor", 2.5),  # DeepSeek's routing knob, which mixtral does not read
        ("tiny-qwen2-moe", "quantization_config", {"quant_method": "fp8"}),  # per-tensor FP8
        ("tiny-qwen3-moe", "quantization_config", {"quant_method": "fbgemm_fp8"}),  # experts cbq does not read
        ("tiny-glm4-moe", "n_group", 3),  # 16 experts do not split into 3 groups
        ("tiny-glm4-moe", "hidden_act", "gelu"),
    ],
)
def test_an_moe_config_the_layer_does_not_compute_is_refused_in_one_line(preset, field, value):
    from worker.engine.models import ModelLoadError, family_for, preset_config

    config = preset_config(preset)
    setattr(config, field, value)
    with pytest.raises(ModelLoadError, match=f"^model type '{config.model_type}': config.json sets .*{field}"):
        family_for(config)
