"""GPU checks of latent attention (DeepSeek-V2/V3): on CUDA, the latent path (latent_attention.py: the Triton write
and attention kernels over the paged latent cache, decode steps in CUDA graphs) against `model.generate` in fp32 on
the release-shaped fixtures (V3's FP8 weights dequantized), and graph vs eager in bf16; each on transformers' layers
(what "auto" runs on tensor-parallel ranks, here "latent": the decoder choice "auto" with the owned decoder
refused) and on the owned decoder ("owned": latent_layer.py, the owned MoE path's Triton grouped GEMMs, the fused
layer ops and the small-step GEMMs), which "auto" takes in one CUDA process since these passed (2026-12-06).
Run on the H200 by benchmarks/run_gpu.sh (`mlagpu`); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.deepseek_checkpoints import SHAPES, build_deepseek_checkpoint
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.latent_attention import is_latent_cache
from worker.engine.models import load_model

from .conftest import hf_greedy, make_requests
from .test_engine_gpu import token_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


DECODERS = ["latent", "owned"]  # transformers' layers with cbq's latent attention; the owned decoder


def run(model, tok, reqs, **config) -> tuple[list[list[int]], Engine]:
    latent = config.get("decoder") == "latent"
    if latent:  # "auto" where the owned decoder is not taken (tensor-parallel ranks): refused here, so auto keeps
        # transformers' layers with cbq's latent attention in one process
        config["decoder"] = "auto"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("worker.engine.decoder._auto_owned", lambda model: False)
            engine = Engine(model, tok, EngineConfig(device="cuda", **config))
    else:
        engine = Engine(model, tok, EngineConfig(device="cuda", **config))
    assert is_latent_cache(*engine.runner.kv_caches[0])
    assert (engine.runner.decoder is None) == latent
    results = engine.generate(reqs)
    engine.blocks.check_integrity([])
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return [r.token_ids for r in results], engine


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_latent_fp32_equals_generate(tmp_path, name, decoder):
    checkpoint = build_deepseek_checkpoint(tmp_path / name, name)
    model, tok = load_model(str(checkpoint.path), torch.device("cuda"), torch.float32, keep_fp8=False)
    reqs = make_requests(tok, 16, seed=7, max_prompt=300, max_new=32)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    assert len({t for ids in ref for t in ids}) > 20, "references are not diverse"
    for mode in ("sync", "async"):
        out, engine = run(model, tok, reqs, mode=mode, dtype="float32", max_num_batched_tokens=256, decoder=decoder)
        agreement = token_agreement(out, ref)
        # absorbed attention multiplies in another order than the expanded heads: rounding, rarely a near-tie
        assert agreement >= 0.99, f"{name} {mode} {decoder}: fp32 latent attention vs generate agree on {agreement:.4f}"
        del engine
        torch.cuda.empty_cache()


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_latent_bf16_graph_equals_eager(tmp_path, name, decoder):
    """V3's FP8 experts stay FP8 (sm89+): on "latent", transformers' forward runs them in the shared workspace that
    the runner sized for its largest step (fp8_experts.reserve_workspaces), so its decode steps are captured too."""
    checkpoint = build_deepseek_checkpoint(tmp_path / name, name)
    model, tok = load_model(str(checkpoint.path), torch.device("cuda"), torch.bfloat16)
    reqs = make_requests(tok, 32, seed=8, max_prompt=300, max_new=48)
    eager, engine = run(model, tok, reqs, mode="async", use_cuda_graphs=False, decoder=decoder)
    del engine
    graph, engine = run(model, tok, reqs, mode="async", use_cuda_graphs=True, decoder=decoder)
    assert len(engine.runner.graphs) > 0
    agreement = token_agreement(graph, eager)
    assert agreement == 1.0, f"graph vs eager (async) agree on {agreement:.4f} of tokens"


@pytest.mark.parametrize("name", ["v2-lite", "v3-aligned"])
def test_latent_two_ranks_over_gloo_on_one_gpu_agree_with_one_process(tmp_path, name):
    """Tensor parallelism at TP=2 (two ranks sharing the GPU over gloo; NCCL refuses two ranks on one device) in fp32:
    heads split, the latent whole on each rank, the Triton latent kernels on each rank's heads. V3's FP8 fixture
    widened so that its splits land on whole [128, 128] blocks (test_parallel_latent_attention.py), its experts dequantized
    on both sides.
    The row-parallel sums round differently from one GEMM: agreement is near, not exact (exact on the CPU)."""
    from worker.engine.ranks import build_sharded_engine

    from .test_parallel_latent_attention import V3_BLOCK_ALIGNED

    overrides = V3_BLOCK_ALIGNED if name == "v3-aligned" else None
    checkpoint = build_deepseek_checkpoint(tmp_path / name, name.removesuffix("-aligned"), overrides=overrides)
    config = EngineConfig(device="cuda", dtype="float32", max_num_batched_tokens=256, num_kv_blocks=512)
    # Experts kept FP8 quantize their inputs, dequantized ones do not (0.28 agreement on an H100 between the two from
    # that alone): both sides dequantize them, to compare like with like (test_parallel_latent_attention.py compares
    # kept FP8 experts at TP=2 with one process on the CPU)
    model, tok = load_model(str(checkpoint.path), torch.device("cuda"), torch.float32, keep_fp8_experts=False)
    reqs = make_requests(tok, 16, seed=9, max_prompt=300, max_new=32)
    one = Engine(model, tok, config)
    expected = [r.token_ids for r in one.generate(reqs)]
    del one, model
    torch.cuda.empty_cache()
    two = build_sharded_engine(
        str(checkpoint.path), config, world_size=2, backend="gloo", device_ids=[0, 0], keep_fp8_experts=False
    )  # fmt: skip
    try:
        assert two.model.config.num_attention_heads == 2 and is_latent_cache(*two.runner.kv_caches[0])
        got = [r.token_ids for r in two.generate(reqs)]
    finally:
        two.close()
    agreement = token_agreement(got, expected)
    assert agreement > 0.95, f"{name}: TP=2 vs one process agree on {agreement:.4f} of tokens"
