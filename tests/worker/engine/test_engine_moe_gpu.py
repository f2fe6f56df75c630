"""GPU checks of the mixtures of experts: the owned decoder on CUDA (the Triton grouped GEMMs in one workspace, the
decode steps in CUDA graphs) against `model.generate` in fp32 on the tiny MoE presets, graph vs eager in bf16, and
gpt-oss's MXFP4 release loaded in one process in bf16.
Run on the H200 by benchmarks/run_gpu.sh (`tests` or `moetests`); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .conftest import TINY_MOE_FAMILIES, hf_greedy, make_requests, randomize_score_correction_bias
from .test_engine_gpu import token_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(model, tok, reqs, **config) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, tok, EngineConfig(device="cuda", decoder="owned", **config))
    results = engine.generate(reqs)
    engine.blocks.check_integrity([])
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return [r.token_ids for r in results], engine


@pytest.mark.parametrize("name", TINY_MOE_FAMILIES)
def test_moe_fp32_owned_decoder_equals_generate(name):
    model, tok = load_model(name, torch.device("cuda"), torch.float32)
    randomize_score_correction_bias(model)  # GLM-4.5's: zeros at init would leave the choice bias untested
    reqs = make_requests(tok, 16, seed=7, max_prompt=300, max_new=32)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    assert len({t for ids in ref for t in ids}) > 20, "references are not diverse"
    for mode in ("sync", "async"):
        out, engine = run(model, tok, reqs, mode=mode, dtype="float32", max_num_batched_tokens=256)
        assert engine.runner.decoder.moe_workspace is not None, "the Triton experts did not run"
        agreement = token_agreement(out, ref)
        # the grouped GEMMs sum in another order than transformers' expert loop: rounding, rarely a near-tie
        assert agreement >= 0.99, f"{name} {mode}: fp32 owned decoder vs generate agree on {agreement:.4f}"
        del engine
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe"])  # GLM-4.5: grouped sigmoid routing captured
def test_moe_bf16_graph_equals_eager(name):
    model, tok = load_model(name, torch.device("cuda"), torch.bfloat16)
    randomize_score_correction_bias(model)
    reqs = make_requests(tok, 32, seed=8, max_prompt=300, max_new=48)
    eager, engine = run(model, tok, reqs, mode="async", use_cuda_graphs=False)
    del engine
    graph, engine = run(model, tok, reqs, mode="async", use_cuda_graphs=True)
    assert len(engine.runner.graphs) > 0
    # an eager decode step pads to its graph's bucket: the same kernels on the same shapes, the same tokens
    agreement = token_agreement(graph, eager)
    assert agreement == 1.0, f"graph vs eager (async) agree on {agreement:.4f} of tokens"


def test_gpt_oss_mxfp4_release_loads_in_one_process_in_bf16(tmp_path):
    """gpt-oss as released (MXFP4 experts) through `load_model` on CUDA in bf16 (test_gpt_oss_mxfp4.py: the CPU in
    fp32): every parameter lands on the GPU, the experts dequantized there equal the dequantized codes bitwise and
    the rest the saved tensors cast to bf16; the engine (owned decoder, Triton experts, CUDA graphs) gives the same
    tokens as the plain checkpoint of the same dequantized experts, which transformers loads."""
    from worker.engine.moe.mxfp4 import dequantize_mxfp4

    from .test_gpt_oss_mxfp4 import EXPERT_MATRICES, save_tiny_gpt_oss_release, saved_tensors

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    save_tiny_gpt_oss_release(tmp_path)
    model, tok = load_model(str(tmp_path), cuda, bf16)
    saved = saved_tensors(tmp_path)
    for name, param in model.named_parameters():
        assert param.device.type == "cuda" and param.dtype == bf16, name
        if name.endswith(EXPERT_MATRICES):
            blocks, scales = saved[f"{name}_blocks"].to(cuda), saved[f"{name}_scales"].to(cuda)
            expected = dequantize_mxfp4(blocks, scales, bf16).transpose(1, 2)
        else:
            expected = saved[name].to(cuda, bf16)
        assert torch.equal(param, expected), name
    reqs = make_requests(tok, 16, seed=9, max_prompt=300, max_new=32)
    got, engine = run(model, tok, reqs, mode="async", dtype="bfloat16")
    assert engine.runner.decoder.moe_workspace is not None and len(engine.runner.graphs) > 0
    assert len({t for ids in got for t in ids}) > 20, "outputs are not diverse"
    del engine, model
    torch.cuda.empty_cache()
    plain, _ = load_model(str(tmp_path / "dequantized"), cuda, bf16)
    expected_tokens, _ = run(plain, tok, reqs, mode="async", dtype="bfloat16")
    assert got == expected_tokens
