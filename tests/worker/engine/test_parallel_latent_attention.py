"""Multi-head latent attention (DeepSeek-V2/V3) at --tensor-parallel-size 2 over gloo on the CPU, fp32: greedy
output equals one process's (the engine, and `model.generate`) token for token, from DeepSeek-V2-Lite's release-shaped
checkpoint (tests/fixtures/deepseek_checkpoints.py): the heads split over the ranks (q_proj and kv_b_proj by the
rank's heads' rows, o_proj by their columns, reduced), the latent replicated (every rank's cache holds the whole
latent: kv_lora_rank + qk_rope_head_dim values per token per layer), the dense first layer split as dense TP, the
experts and shared experts by intermediate size (one all-reduce for both). Sync and async, chunked prefill,
preemption and the prefix cache. DeepSeek-V3's FP8 fixture is refused in one line: its q_b_proj rows per rank (2
heads x 48) cut the [128, 128] blocks; the same fixture widened so that every split lands on a block (as the
releases' do) equals one process at TP=2, its FP8 weights dequantized by each rank from its own blocks.

Each engine spawns one helper process: one engine per mode, the cases few and the requests small.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.fixtures.deepseek_checkpoints import build_deepseek_checkpoint
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.engine_builder import build_engine
from worker.engine.latent_attention import is_latent_cache
from worker.engine.layers.tensor_parallel import GatheredLogits, ReducedOutput
from worker.engine.models import ModelLoadError, load_model
from worker.engine.quant.linear import Fp8LinearModule
from worker.engine.ranks import build_sharded_engine

from .conftest import hf_greedy, make_requests

# Small steps (prompts up to 90 tokens in chunks of 24) and a small cache (preemption).
CONFIG = dict(max_num_batched_tokens=24, num_kv_blocks=14, max_num_seqs=6)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory):
    """(checkpoint folder, requests, `generate`'s greedy tokens, one process's engine tokens)."""
    checkpoint = build_deepseek_checkpoint(tmp_path_factory.mktemp("v2-lite"), "v2-lite")
    model, tok = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
    requests = make_requests(tok, 8, seed=5, max_prompt=90, max_new=14)
    # half of them behind one 40-token prefix, for the prefix cache
    for request in requests[1::2]:
        request.prompt_ids[1:1] = requests[2].prompt_ids[1:41]
    reference = [hf_greedy(model, tok, r) for r in requests]
    assert len({t for ids in reference for t in ids}) >= 20, "varied text, or equality would prove little"
    one = Engine(model, tok, EngineConfig(**CONFIG))
    single = [r.token_ids for r in one.generate(requests)]
    return str(checkpoint.path), requests, reference, single


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_equals_one_process_at_tp2(v2_lite, mode):
    path, requests, reference, single = v2_lite
    assert single == reference, "one process is `generate`'s (test_engine_exact_deepseek.py)"
    assert max(len(r.prompt_ids) for r in requests) > CONFIG["max_num_batched_tokens"], "a prompt in chunks"
    engine = build_engine(path, mode=mode, tensor_parallel_size=2, **CONFIG)
    try:
        runner = engine.runner
        assert runner.replica is not None and runner.replica.state.world_size == 2
        assert runner.decoder is None, "transformers' layers with cbq's latent attention"
        config = engine.model.config
        assert config.num_attention_heads == 2, "rank 0 holds half of the 4 heads"
        layer = engine.model.model.layers[1]
        assert layer.self_attn.kv_b_proj.weight.shape[0] == 2 * (config.qk_nope_head_dim + config.v_head_dim)
        assert layer.self_attn.kv_a_proj_with_mqa.weight.shape[0] == config.kv_lora_rank + config.qk_rope_head_dim
        assert isinstance(layer.self_attn.o_proj, ReducedOutput) and isinstance(layer.mlp, ReducedOutput)
        assert isinstance(engine.model.model.layers[0].mlp.down_proj, ReducedOutput), "the dense first layer"
        assert isinstance(engine.model.lm_head, GatheredLogits)
        k_cache, v_cache = runner.kv_caches[0]
        assert is_latent_cache(k_cache, v_cache) and k_cache.shape[-1] == config.kv_lora_rank + config.qk_rope_head_dim
        results = engine.generate(requests)
        for request, result, expected in zip(requests, results, reference, strict=True):
            assert result.token_ids == expected, request.request_id
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
        assert engine.blocks.num_cache_hits > 0, "the shared prefix was meant to be reused"
        engine.blocks.check_integrity([])
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_owned_decoder_runs_latent_attention_at_tp2(v2_lite, mode):
    """`--decoder owned` on a latent-attention shard: each rank's owned decoder (latent_layer.py over the rank's heads,
    the owned MoE path) names its collectives itself, so none is put into the shard's modules; greedy tokens equal
    `generate`'s, with chunked prefill, preemption and the prefix cache."""
    from worker.engine.decoder import OwnedDecoder

    path, requests, reference, _ = v2_lite
    engine = build_engine(path, mode=mode, tensor_parallel_size=2, decoder="owned", **CONFIG)
    try:
        assert isinstance(engine.runner.decoder, OwnedDecoder) and engine.runner.decoder.latent is not None
        wrapped = [m for m in engine.model.modules() if isinstance(m, ReducedOutput | GatheredLogits)]
        assert not wrapped, "the owned decoder runs the collectives: none sits in a module"
        assert engine.model.config.num_attention_heads == 2
        results = engine.generate(requests)
        for request, result, expected in zip(requests, results, reference, strict=True):
            assert result.token_ids == expected, request.request_id
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_cache_hits > 0
    finally:
        engine.close()


def test_fp8_latent_cache_at_tp2_equals_one_process(v2_lite):
    """--kv-cache-dtype fp8: every rank keeps the whole latent in e4m3 with the same static scales as one process, so
    greedy tokens equal one process's fp8 run, which differ from the fp32 cache's (the check would not notice an fp32
    cache otherwise); preemption and the prefix cache too."""
    path, requests, reference, _ = v2_lite
    fp8 = dict(CONFIG, kv_cache_dtype="fp8")
    one = Engine.from_model(path, **fp8)
    expected = [r.token_ids for r in one.generate(requests)]
    assert expected != reference, "an e4m3 latent was meant to change some tokens"
    engine = build_engine(path, mode="async", tensor_parallel_size=2, **fp8)
    try:
        k_cache, v_cache = engine.runner.kv_caches[0]
        assert k_cache.dtype == torch.float8_e4m3fn and is_latent_cache(k_cache, v_cache)
        assert [r.token_ids for r in engine.generate(requests)] == expected
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_cache_hits > 0
    finally:
        engine.close()


# DeepSeek-V3's fixture made wide enough that every split lands on the [128, 128] FP8 blocks at TP=2, as the release's
# do: q_b_proj 4 heads x 128 rows, kv_b_proj 4 x (64 + 64), o_proj 4 x 64 columns, the dense MLP's 512 and the shared
# expert's 256 intermediate columns (the routed experts are dequantized whole and then sliced: any size).
V3_BLOCK_ALIGNED = dict(
    hidden_size=256, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
    intermediate_size=512, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def v3_aligned(tmp_path_factory):
    return build_deepseek_checkpoint(tmp_path_factory.mktemp("v3-aligned"), "v3", overrides=V3_BLOCK_ALIGNED)


@pytest.mark.parametrize(
    ("keep_fp8", "keep_fp8_experts", "decoder"),
    [(False, False, "auto"), (True, False, "auto"), (True, True, "auto"), (False, False, "owned"),
     (True, False, "owned"), (True, True, "owned")],
)  # fmt: skip
def test_v3_fp8_block_aligned_equals_one_process_at_tp2(v3_aligned, keep_fp8, keep_fp8_experts, decoder):
    """Each rank reads its rows / columns of the block-wise FP8 linears with their blocks' scales (shard_fp8.py) and
    dequantizes them (one process's values, so greedy tokens equal `generate`'s too), or keeps them FP8 as sm89+ GPUs
    do (`keep_fp8`: the GEMM emulated on the CPU; the replicated latent projections kept FP8 as well), as one
    process keeps them; with `keep_fp8_experts` each rank's slice of every expert's columns kept FP8 too (what lets
    V3/R1 fit 8 GPUs); on either decoder (the owned one: V3's q LoRA and grouped sigmoid routing, its FP8 linears
    through their methods)."""
    from worker.engine.moe.fp8_experts import Fp8Experts

    model, tok = load_model(
        str(v3_aligned.path), torch.device("cpu"), torch.float32, keep_fp8=keep_fp8, keep_fp8_experts=keep_fp8_experts
    )  # fmt: skip
    requests = make_requests(tok, 5, seed=3, max_prompt=60, max_new=10)
    config = EngineConfig(**dict(CONFIG, num_kv_blocks=32))
    expected = [r.token_ids for r in Engine(model, tok, config).generate(requests)]
    assert len({t for ids in expected for t in ids}) >= 12, "varied text, or equality would prove little"
    if not keep_fp8:
        assert expected == [hf_greedy(model, tok, r) for r in requests]
    del model
    engine = build_sharded_engine(
        str(v3_aligned.path), replace(config, decoder=decoder), world_size=2, keep_fp8=keep_fp8,
        keep_fp8_experts=keep_fp8_experts,
    )  # fmt: skip
    try:
        attention = engine.model.model.layers[1].self_attn
        assert engine.model.config.num_attention_heads == 2
        assert (engine.runner.decoder is not None) == (decoder == "owned")
        assert any(isinstance(m, Fp8Experts) for m in engine.model.modules()) == keep_fp8_experts
        fp8 = [isinstance(m, Fp8LinearModule) for m in (attention.kv_a_proj_with_mqa, attention.q_a_proj)]
        assert fp8 == [keep_fp8, keep_fp8]
        assert [r.token_ids for r in engine.generate(requests)] == expected
    finally:
        engine.close()


def test_v3_fp8_blocks_cut_by_the_head_split_are_refused_in_one_line(tmp_path):
    """The V3 fixture's q_b_proj has 4 heads x 48 rows: a rank's 96 rows end inside a [128, 128] FP8 block, which the
    ranks cannot dequantize apart (shard_fp8.py). The releases' (128 heads x 192 rows, 128 x 256 for kv_b_proj, o_proj's
    128 x 128 columns) split on block boundaries at 2, 4 and 8 ranks."""
    checkpoint = build_deepseek_checkpoint(tmp_path, "v3")
    with pytest.raises(ModelLoadError, match=r"tensor parallelism: .*q_b_proj's rows \[0, 96\) of 192 cut its block-wise"):
        build_engine(str(checkpoint.path), tensor_parallel_size=2, num_kv_blocks=8)

