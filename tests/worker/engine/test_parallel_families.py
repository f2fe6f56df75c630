"""The engine at --tensor-parallel-size 2 over gloo on the CPU, for the families whose layouts need more than
splitting separate q/k/v and gate/up linears (test_parallel_engine.py covers those): greedy output equals
`model.generate` (fp32) token for token, with chunked prefill, preemption and the prefix cache.

- tiny-phi3: q/k/v and gate/up shipped fused (each rank reads its rows of each block), Phi-4-mini's partial rotary.
- tiny-glm4: gate/up shipped fused, q/k/v biases, interleaved partial rotary.
- tiny-mixtral: experts split by intermediate size, read from the release's per-expert `block_sparse_moe.experts.
  {e}.w1/w3/w2` (what transformers saves).
- tiny-gpt-oss: attention sinks split with the q heads; biased experts (gate/up columns interleaved), the down
  bias held by rank 0 alone; and the same model saved as the release ships it, experts in MXFP4.
- tiny-olmo2: q/k norms over the whole projection, their statistic summed over the ranks (one all-reduce of [T]
  per norm), with two KV heads (one per rank) and with one (held by both ranks, so counted twice in the sum).
- tiny-cohere2: one LayerNorm feeding attention and the MLP in parallel, both row-parallel outputs reduced before
  they join the residual, (residual + attention) + MLP; interleaved rotary on the sliding layers, NoPE global ones.
- a Gemma 3 multimodal checkpoint: its language model read under the checkpoint's names.

Each case is a preset saved as a checkpoint folder (so each rank reads its slices of the safetensors files) with
random biases (transformers initialises them to zero, which would hide a bias added on every rank); the saved model
is the reference. Each (checkpoint, mode) spawns one helper process, so the cases are few and the requests small.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.fixtures.checkpoints import gemma3_multimodal_model, save_experts_as_mxfp4
from worker.engine.engine import Engine
from worker.engine.engine_builder import build_engine
from worker.engine.models import load_model, preset_config

from .conftest import hf_generate
from .test_parallel_engine import CONFIG, make_requests

# A smaller cache than test_parallel_engine.py's: the presets' requests end sooner (the byte tokenizer's eos).
SMALL_CACHE = dict(CONFIG, num_kv_blocks=10)
# checkpoint name -> (preset, config fields over the preset's, released as MXFP4)
CHECKPOINTS = {
    "phi3": ("tiny-phi3", {}, False),
    "glm4": ("tiny-glm4", {}, False),
    "mixtral": ("tiny-mixtral", {}, False),
    "gpt_oss": ("tiny-gpt-oss", {}, False),
    "gpt_oss_mxfp4": ("tiny-gpt-oss", {}, True),
    "olmo2": ("tiny-olmo2", {}, False),
    "olmo2_one_kv_head": ("tiny-olmo2", {"num_key_value_heads": 1}, False),
    "cohere2": ("tiny-cohere2", {}, False),
}
CASES = [
    ("phi3", "sync"),
    ("phi3", "async"),
    ("glm4", "async"),
    ("mixtral", "sync"),
    ("gpt_oss", "async"),
    ("gpt_oss_mxfp4", "sync"),
    ("olmo2", "sync"),
    ("olmo2_one_kv_head", "async"),
    ("cohere2", "async"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per checkpoint: its folder and `model.generate`'s greedy tokens for each request."""
    built = {}
    requests = make_requests(None)
    for name, (preset, overrides, mxfp4) in CHECKPOINTS.items():
        model, tokenizer = load_model(preset, torch.device("cpu"), torch.float32)
        if overrides:  # the preset's config and seed, another shape
            config = preset_config(preset)
            for field, value in overrides.items():
                setattr(config, field, value)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_biases(model)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, max_shard_size="60KB")
        if mxfp4:
            save_experts_as_mxfp4(model, path)
        eos = sorted(tokenizer.eos_token_ids)
        built[name] = (str(path), {r.request_id: hf_generate(model, r, eos, eos[0]) for r in requests})
    return requests, built


def randomize_biases(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # `.bias`, and gpt-oss's experts' `gate_up_proj_bias` / `down_proj_bias`
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(param.numel()))


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_greedy_equals_generate_at_tp2(checkpoints, name, mode):
    requests, built = checkpoints
    path, reference = built[name]
    engine = build_engine(path, mode=mode, tensor_parallel_size=2, **SMALL_CACHE)
    try:
        assert engine.runner.replica is not None and engine.runner.replica.state.world_size == 2
        results = engine.generate(requests)
        for request, result in zip(requests, results, strict=True):
            assert result.token_ids == reference[request.request_id], request.request_id
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
        assert engine.blocks.num_cache_hits > 0, "the shared prefix was meant to be reused"
        engine.blocks.check_integrity([])
    finally:
        engine.close()


def test_the_language_model_of_a_gemma3_multimodal_checkpoint_at_tp2(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (4B-27B's layout): each rank reads its slices of the language
    model's tensors under their checkpoint names (`model.language_model.*`), the vision tower's never; the tokens
    equal one process's, which test_families.py checks against the whole model's `generate`."""
    gemma3_multimodal_model().save_pretrained(tmp_path, max_shard_size="200KB")
    requests = make_requests(None)
    one = Engine.from_model(str(tmp_path), **SMALL_CACHE)
    expected = [r.token_ids for r in one.generate(requests)]
    engine = build_engine(str(tmp_path), mode="async", tensor_parallel_size=2, **SMALL_CACHE)
    try:
        assert engine.model.config.model_type == "gemma3_text"
        assert [r.token_ids for r in engine.generate(requests)] == expected
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_cache_hits > 0
    finally:
        engine.close()
