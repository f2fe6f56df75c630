"""DeepSeek-class models (multi-head latent attention) from release-shaped checkpoints through the whole engine
(fp32, CPU): greedy output equals `model.generate` token for token for DeepSeek-V2-Lite's shape (no q LoRA, YaRN
with mscale, softmax greedy routing, two shared experts, a dense first layer) and DeepSeek-V3's (q LoRA, grouped
sigmoid routing with its correction bias, block-wise FP8 weights dequantized at load, the MTP layer shipped and not
loaded), in sync and async mode, with chunked prefill, forced preemption, the prefix cache on and off, through
transformers' forward with cbq's paged attention ("hf": each head's expanded K and V in the cache), with cbq's
latent attention ("auto": latent_attention.py, kv_lora_rank + qk_rope_head_dim values per token per layer in the
cache, the query absorbed into the latent space), and on the owned decoder ("owned": latent_layer.py, the same
latent attention, the owned MoE path and layer ops)."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from tests.fixtures.deepseek_checkpoints import SHAPES, build_deepseek_checkpoint
from worker.engine.config import EngineConfig
from worker.engine.decoder import unsupported_reason
from worker.engine.engine import Engine
from worker.engine.families.deepseek_v2 import mla_softmax_scale
from worker.engine.kv_cache import cache_head_dim, kv_bytes_per_block, latent_width
from worker.engine.latent_attention import install_latent_attention, is_latent_cache
from worker.engine.models import ModelLoadError, load_model
from worker.engine.moe import moe_layer_ids, spec_from_config
from worker.engine.moe.spec import RouterScoring

from .conftest import hf_greedy, make_requests
from .test_engine_exact import assert_diverse
from .test_engine_prefix_cache import assert_clean, shared_prefix_requests
from .test_fused_kernels import _interpret, needs_triton

NAMES = list(SHAPES)
REQUESTS = {"v2-lite": (12, 160), "v3": (8, 120)}  # (requests, longest prompt) of the mixed references
SCENARIOS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=40),
    "preemption": dict(num_kv_blocks=24, max_num_batched_tokens=128),
}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """name -> (checkpoint, model, tokenizer), each built and loaded once."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            checkpoint = build_deepseek_checkpoint(tmp_path_factory.mktemp(name), name)
            model, tok = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
            cache[name] = (checkpoint, model, tok)
        return cache[name]

    return get


_REFERENCES: dict[tuple[str, str], tuple[list, dict]] = {}


def references(deepseek, name: str, kind: str):
    if (name, kind) not in _REFERENCES:
        _, model, tok = deepseek(name)
        seed = zlib.crc32(name.encode()) % 1000
        num, max_prompt = REQUESTS[name]  # V3's fixture is 4x wider (FP8 blocks): fewer, shorter requests
        if kind == "mixed":
            reqs = make_requests(tok, num, seed=seed, max_prompt=max_prompt, max_new=24)
        else:
            reqs = shared_prefix_requests(tok, seed=seed, num=num - 2, max_new=16)
        _REFERENCES[name, kind] = (reqs, {r.request_id: hf_greedy(model, tok, r) for r in reqs})
    return _REFERENCES[name, kind]


# transformers' layers with their attention over expanded K/V ("hf") or cbq's over the latent ("auto"); the owned
# decoder over the latent ("owned": latent_layer.py)
DECODERS = ["hf", "auto", "owned"]


def run_and_compare(model, tok, reqs, ref, config: EngineConfig) -> Engine:
    engine = Engine(model, tok, config)
    owned = engine.runner.decoder is not None
    assert owned == (config.decoder == "owned"), "only 'owned' takes the owned decoder for latent attention"
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert is_latent_cache(k_cache, v_cache) == (config.decoder != "hf")
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.token_ids == ref[req.request_id], f"{req.request_id} (prompt {len(req.prompt_ids)} tokens)"
    assert_clean(engine)
    return engine


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_generate(deepseek, name, scenario, mode, decoder):
    _, model, tok = deepseek(name)
    reqs, ref = references(deepseek, name, "mixed")
    assert_diverse(ref)
    config = EngineConfig(mode=mode, decoder=decoder, enable_prefix_caching=False, **SCENARIOS[scenario])
    engine = run_and_compare(model, tok, reqs, ref, config)
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    if scenario == "chunked_prefill":
        assert max(len(r.prompt_ids) for r in reqs) > 40


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_prefix_cache_equals_generate(deepseek, name, mode, decoder):
    _, model, tok = deepseek(name)
    reqs, ref = references(deepseek, name, "shared")
    config = EngineConfig(mode=mode, decoder=decoder, enable_prefix_caching=True, max_num_batched_tokens=40)
    engine = run_and_compare(model, tok, reqs, ref, config)
    assert engine.stats().prefix_cache_hits > 0, "the shared prefixes were meant to hit the cache"


def test_auto_takes_the_owned_decoder_in_one_cuda_process(deepseek, monkeypatch):
    """decoder "auto" for latent attention: the owned decoder in one CUDA process (it passed the GPU tests and ran W1
    1.36x faster); transformers' layers with cbq's latent attention on the CPU, on tensor-parallel shards, and
    where the owned decoder cannot run the model; "hf" is transformers' own attention."""
    from worker.engine import decoder as decoder_module

    _, model, _ = deepseek("v2-lite")
    monkeypatch.setattr(decoder_module, "OwnedDecoder", lambda *args, **kwargs: "owned")
    installed: list[str] = []
    monkeypatch.setattr(decoder_module, "install_latent_attention", lambda m: installed.append("latent"))

    def build(choice, device="cuda", tp=None):
        installed.clear()
        built = decoder_module.build_decoder(model, choice, torch.device(device), 64, False, tp=tp)
        return built or ("latent on transformers" if installed else "transformers")

    assert build("auto") == build("owned") == "owned"
    assert build("auto", "cpu") == "latent on transformers" and build("hf") == "transformers"
    assert build("auto", tp=object()) == "latent on transformers"
    monkeypatch.setattr(decoder_module, "unsupported_reason", lambda m: "not this one")
    assert build("auto") == "latent on transformers"


@pytest.mark.parametrize("name", NAMES)
def test_latent_cache_holds_one_row_per_token_and_generate_is_unchanged(deepseek, name):
    """"owned" and "auto" keep kv_lora_rank + qk_rope_head_dim values per token per layer (K and V one tensor); the
    owned decoder runs the model, "auto" keeps transformers' layers on the CPU (the owned decoder on CUDA:
    test_auto_takes_the_owned_decoder_in_one_cuda_process); transformers' forward outside the engine is its own."""
    _, model, tok = deepseek(name)
    assert unsupported_reason(model) is None
    assert Engine(model, tok, EngineConfig(decoder="auto", num_kv_blocks=8)).runner.decoder is None
    engine = Engine(model, tok, EngineConfig(decoder="owned", num_kv_blocks=8))
    assert engine.runner.decoder is not None
    k_cache, v_cache = engine.runner.kv_caches[0]
    config = model.config
    assert k_cache.shape == (8, 16, 1, config.kv_lora_rank + config.qk_rope_head_dim) and is_latent_cache(k_cache, v_cache)
    assert len(engine.runner.kv_caches) == config.num_hidden_layers
    checkpoint, _, _ = deepseek(name)
    fresh, _ = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
    ids = torch.tensor([[tok.bos_token_id, *range(60, 90)]])
    with torch.no_grad():
        before = fresh(ids).logits
        assert install_latent_attention(fresh) == config.num_hidden_layers
        assert install_latent_attention(fresh) == config.num_hidden_layers  # idempotent
        after = fresh(ids).logits  # no cbq metadata: transformers' own attention
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_v2_lite_reads_the_release_knobs(deepseek):
    checkpoint, model, _ = deepseek("v2-lite")
    config = model.config
    assert checkpoint.config["q_lora_rank"] is None and model.model.layers[0].self_attn.q_proj is not None
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["mscale_all_dim"] == 0.707
    # qk_head_dim^-0.5 times mscale(40, 0.707)^2: YaRN's softmax factor enters the scale
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert mla_softmax_scale(config) == pytest.approx(24**-0.5 * mscale**2)
    assert model.model.layers[1].self_attn.scaling == pytest.approx(mla_softmax_scale(config))
    spec = spec_from_config(config)
    assert (spec.scoring, spec.top_k, spec.norm_topk_prob, spec.shared_expert_intermediate_size) == (
        RouterScoring.SOFTMAX, 6, False, 64
    )
    assert moe_layer_ids(config) == (1, 2)
    # "hf": each head's expanded K (16 + 8) and V (16, padded to 24) per token per layer; the latent: 32 + 8
    assert cache_head_dim(config) == 24
    assert kv_bytes_per_block(config, 1, torch.float32) == 2 * 3 * 4 * 24 * 4
    assert latent_width(config) == 40 and kv_bytes_per_block(config, 1, torch.float32, latent=True) == 3 * 40 * 4


def test_v3_fp8_release_loads_without_its_mtp_layer(deepseek):
    """The block-wise FP8 weights are dequantized on the CPU (weight * scale per [128, 128] block), the MTP layer's
    weights are left unread, the correction bias is the checkpoint's."""
    from safetensors import safe_open

    checkpoint, model, _ = deepseek("v3")
    assert len(model.model.layers) == checkpoint.config["num_hidden_layers"] == 3
    index = json.loads((checkpoint.path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.kv_b_proj"

    def tensor(key):
        with safe_open(checkpoint.path / index[key], "pt") as f:
            return f.get_tensor(key)

    weight, scale_inv = tensor(f"{name}.weight"), tensor(f"{name}.weight_scale_inv")
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    rows, cols = weight.shape
    scales = scale_inv.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    torch.testing.assert_close(model.get_submodule(name).weight, weight.float() * scales, rtol=0, atol=0)
    bias = tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    torch.testing.assert_close(model.model.layers[2].mlp.gate.e_score_correction_bias, bias.float())
    assert bias.abs().sum() > 0
    spec = spec_from_config(model.config)
    assert (spec.scoring, spec.num_groups, spec.topk_groups, spec.routed_scaling_factor) == (
        RouterScoring.SIGMOID, 4, 2, 2.5
    )


@pytest.mark.parametrize("name", NAMES)
def test_one_process_reads_the_checkpoint_by_slice_as_transformers_loads_it(deepseek, name, monkeypatch):
    """The one loader: a latent-attention checkpoint is read by slice in one process, as the tensor-parallel ranks
    read it (no `from_pretrained`, no whole-model quantized loader), and every value equals transformers' own load
    of it: V2-Lite's `from_pretrained`, V3's block-wise FP8 release dequantized whole (the tests' reference loader)."""
    from transformers import AutoModelForCausalLM

    from worker.engine.models import quant_loader
    from worker.engine.models.loader import _load_config, _quantization, family_for, sparse_layers

    checkpoint, _, _ = deepseek(name)
    path = str(checkpoint.path)
    config = _load_config(path)
    quant = _quantization(config, None)
    if quant is None:
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        sparse = sparse_layers(config, family_for(config)[0])
        expected = quant_loader.load_dequantized_model(path, config, quant, torch.float32, sparse=sparse)

    def refuse(*args, **kwargs):
        raise AssertionError("a whole-model loader ran in one process")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(quant_loader, "plain_model", refuse)  # what the whole-model quantized loader builds
    loaded, _ = load_model(path, torch.device("cpu"), torch.float32)
    want = expected.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, value in got.items():
        assert torch.equal(value, want[key]), key


def test_unsupported_routing_is_refused_in_one_line(tmp_path):
    """DeepSeek-V2 (236B)'s group-limited greedy routing is not computed: refused at load, naming the field."""
    from transformers import AutoConfig

    from worker.engine.models.loader import family_for

    raw = {k: v for k, v in SHAPES["v2-lite"].items() if k != "model_type"}
    config = AutoConfig.for_model("deepseek_v2", **dict(raw, topk_method="group_limited_greedy", n_group=8, topk_group=3))
    with pytest.raises(ModelLoadError, match="topk_method='group_limited_greedy'"):
        family_for(config)


def test_an_fp8_cache_holds_the_latent_or_per_head_kv(deepseek):
    """--kv-cache-dtype fp8 keeps the latent in e4m3 (test_latent_fp8.py: its tokens and quality); decoder "hf"
    keeps per-head K/V in FP8 as any model's."""
    _, model, tok = deepseek("v2-lite")
    engine = Engine(model, tok, EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=8))
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.float8_e4m3fn and is_latent_cache(k_cache, v_cache)
    engine = Engine(model, tok, EngineConfig(kv_cache_dtype="fp8", decoder="hf", num_kv_blocks=8))
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.float8_e4m3fn and not is_latent_cache(k_cache, v_cache)


@pytest.mark.parametrize("aligned", [False, True])
def test_owned_decoder_runs_linears_kept_fp8_as_auto_does(deepseek, tmp_path, aligned):
    """V3's block-wise FP8 linears kept FP8 (as on sm89+ GPUs; the GEMM emulated on the CPU) through the owned decoder's
    latent attention: the query's and the latent's input projections as two GEMMs where the query's rows end inside
    a [128, 128] block (the fixture's 96-row q_a_proj), stacked into one where they end on one (the fixture widened as
    the releases are: 128 rows); greedy tokens equal decoder "auto"'s on the same FP8 weights."""
    from tests.worker.engine.test_parallel_latent_attention import V3_BLOCK_ALIGNED
    from worker.engine.decoder import OwnedDecoder
    from worker.engine.quant.linear import Fp8LinearModule

    path = build_deepseek_checkpoint(tmp_path, "v3", overrides=V3_BLOCK_ALIGNED).path if aligned else deepseek("v3")[0].path
    model, tok = load_model(str(path), torch.device("cpu"), torch.float32, keep_fp8=True)
    assert isinstance(model.model.layers[1].self_attn.q_a_proj, Fp8LinearModule)
    reqs = make_requests(tok, 5, seed=3, max_prompt=50, max_new=10)
    out = {}
    for decoder in ("auto", "owned"):
        engine = Engine(model, tok, EngineConfig(decoder=decoder, max_num_batched_tokens=24, num_kv_blocks=40))
        out[decoder] = [r.token_ids for r in engine.generate(reqs)]
        if decoder == "owned":
            assert isinstance(engine.runner.decoder, OwnedDecoder)
            stacked = [latent.kv_a_weight is None for latent in engine.runner.decoder.latent]
            assert stacked == [aligned] * len(stacked)
    assert len({t for ids in out["auto"] for t in ids}) >= 10, "varied text, or equality would prove little"
    assert out["owned"] == out["auto"]


@pytest.mark.parametrize("decoder", ["auto", "owned"])
def test_deterministic_mode_is_refused_in_one_line(deepseek, decoder):
    _, model, tok = deepseek("v2-lite")
    with pytest.raises(ValueError, match="multi-head latent attention runs no --deterministic yet"):
        Engine(model, tok, EngineConfig(deterministic=True, decoder=decoder, num_kv_blocks=8))


# The owned decoder's CUDA path on the CPU: Triton's interpreter runs the element-wise kernels (the latent attention's
# norms included), the small-step GEMMs (without PDL), the Triton attention backend (the latent decode kernel), and the
# grouped expert GEMMs; a subprocess, since TRITON_INTERPRET must be set before triton loads.
OWNED_TRITON_CHECK = """
import pathlib, tempfile
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
_patch_triton_interpreter()  # runtime loop bounds under numpy 2.4
from tests.fixtures.deepseek_checkpoints import build_deepseek_checkpoint
from tests.worker.engine.conftest import hf_greedy, make_requests
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.layer_ops import layer_ops
from worker.engine.models import load_model
from worker.engine.moe import MoeWorkspace

for name in ("v2-lite", "v3"):
    path = build_deepseek_checkpoint(pathlib.Path(tempfile.mkdtemp()), name).path
    model, tok = load_model(str(path), torch.device("cpu"), torch.float32)
    reqs = make_requests(tok, 4, seed=5, max_prompt=40, max_new=10)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    config = EngineConfig(decoder="owned", attention_backend="triton", max_num_batched_tokens=64)
    engine = Engine(model, tok, config)
    decoder = engine.runner.decoder
    norm, act = decoder.family.norm, decoder.args.activation
    decoder.use_triton = True
    decoder.ops = layer_ops(True, small_step=False, norm=norm, activation=act)
    decoder.small_step_ops = layer_ops(True, small_step=True, pdl=False, norm=norm, activation=act)
    decoder.moe_workspace = MoeWorkspace.allocate(decoder.moe_spec, 64, torch.float32, torch.device("cpu"))
    assert [r.token_ids for r in engine.generate(reqs)] == ref, name
    assert sum(map(len, ref)) > 20, "references too short to test decode steps"
print("owned latent decoder with triton kernels equals generate")
"""


@needs_triton
def test_owned_decoder_with_the_triton_kernels_equals_generate_in_the_interpreter():
    _interpret(OWNED_TRITON_CHECK, "owned latent decoder with triton kernels equals generate")
