"""The Triton MoE path (worker/engine/moe/triton_moe.py) computes the reference (reference.py): the align step
on its own (every pair once, in token order within its expert, padded runs, the expert of every block) and the
whole layer for SiLU experts, gpt-oss's biased clamped SwiGLU and a shared expert, at decode and prefill
sizes, with a workspace reused across steps of different sizes.

On the CPU through Triton's interpreter, in a subprocess since TRITON_INTERPRET must be set before triton is
imported (tiny shapes, a few seconds); on CUDA as a `gpu` test. By hand:
  TRITON_INTERPRET=1 python -c "$(python -c 'from tests.worker.engine.test_moe_triton import CHECK; print(CHECK)')"
"""

from __future__ import annotations

import pytest
import torch

from worker.engine.moe import (
    Activation,
    ExpertWeights,
    MoeLayerWeights,
    MoeSpec,
    MoeWorkspace,
    RouterScoring,
    SharedExpertWeights,
    moe_forward,
)
from worker.engine.moe import triton_moe as tm
from worker.engine.moe.reference import experts_ref, route, shared_expert_forward

from .test_fused_kernels import _interpret

SMALL = tm.LaunchConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
WIDE = tm.LaunchConfig(block_m=32, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)
# the large tier's 128-row blocks (triton_moe._LARGE), on narrow columns: mostly padding rows at these sizes
TALL = tm.LaunchConfig(block_m=128, block_n=16, block_k=16, group_m=8, num_warps=8, num_stages=1)


def _spec(kind: str) -> MoeSpec:
    # I = 48 and H = 40 do not tile by the 32/16 blocks above: the masks are exercised (and EVEN_K where
    # K = I = 48 meets BLOCK_K = 16)
    if kind == "silu":
        return MoeSpec(
            "qwen3_moe",
            num_experts=8,
            top_k=2,
            hidden_size=40,
            expert_intermediate_size=48,
            norm_topk_prob=True,
        )
    if kind == "shared":
        return MoeSpec(
            "qwen2_moe", 6, 4, 40, 24, shared_expert_intermediate_size=32, has_shared_expert_gate=True
        )
    return MoeSpec(
        "gpt_oss",
        num_experts=8,
        top_k=4,
        hidden_size=40,
        expert_intermediate_size=48,
        scoring=RouterScoring.SOFTMAX_OVER_TOPK,
        has_router_bias=True,
        has_expert_bias=True,
        activation=Activation.CLAMPED_SWIGLU,
        swiglu_limit=1.0,  # small, so that the clamp bites at these weight scales
    )


def _layer(spec: MoeSpec, dtype, device, gen) -> MoeLayerWeights:
    def rnd(*shape, scale=0.3):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    num_experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    bias = spec.has_expert_bias
    experts = ExpertWeights(
        rnd(num_experts, 2 * inter, hidden),
        rnd(num_experts, hidden, inter),
        rnd(num_experts, 2 * inter) if bias else None,
        rnd(num_experts, hidden) if bias else None,
    )
    shared = None
    if spec.has_shared_expert:
        shared_inter = spec.shared_expert_intermediate_size
        shared = SharedExpertWeights(rnd(2 * shared_inter, hidden), rnd(hidden, shared_inter), rnd(1, hidden))
    router_bias = rnd(num_experts) if spec.has_router_bias else None
    layer = MoeLayerWeights(rnd(num_experts, hidden, scale=1.0), router_bias, experts, shared)
    layer.check(spec)
    return layer


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_align(device: str) -> None:
    """The align step's output, read back: what the GEMMs rely on."""
    spec = _spec("silu")
    gen = torch.Generator().manual_seed(1)
    for num_tokens, block_m in ((1, 16), (3, 16), (37, 16), (37, 32), (200, 64)):
        num_pairs = num_tokens * spec.top_k
        ids = torch.stack(
            [torch.randperm(spec.num_experts, generator=gen)[: spec.top_k] for _ in range(num_tokens)]
        )
        ids[: num_tokens // 2, 0] = 5  # a popular expert; some experts get nothing
        ids = ids.to(device)
        ws = MoeWorkspace.allocate(spec, 256, torch.float32, torch.device(device))
        flat = ids.reshape(-1)
        tm._count_kernel[(spec.num_experts,)](flat, ws.counts, num_pairs, BLOCK=64)
        tm._align_kernel[(spec.num_experts,)](
            flat, ws.counts, ws.sorted_pair_ids, ws.block_expert_ids, ws.num_padded, num_pairs, spec.num_experts,
            BLOCK_M=block_m, BLOCK_E=8, BLOCK=64,
        )  # fmt: skip
        counts = torch.bincount(flat.cpu(), minlength=spec.num_experts)
        assert ws.counts.cpu().tolist() == counts.tolist()
        padded = ((counts + block_m - 1) // block_m * block_m).tolist()
        assert ws.num_padded.item() == sum(padded)
        assert tm.max_blocks(num_pairs, spec.num_experts, block_m) * block_m >= sum(padded)
        sorted_ids, block_expert = ws.sorted_pair_ids.cpu().tolist(), ws.block_expert_ids.cpu().tolist()
        start = 0
        for expert in range(spec.num_experts):
            run = sorted_ids[start : start + padded[expert]]
            want = (flat.cpu() == expert).nonzero().flatten().tolist()
            assert run == want + [num_pairs] * (padded[expert] - len(want)), (expert, run, want)
            assert block_expert[start // block_m : (start + padded[expert]) // block_m] == [expert] * (
                padded[expert] // block_m
            )
            start += padded[expert]


def check_layers(device: str, dtypes) -> None:
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    for dtype, dtype_tol in dtypes:
        for kind in ("silu", "gpt_oss", "shared"):
            spec = _spec(kind)
            layer = _layer(spec, dtype, dev, gen)
            wide = _double(layer)
            ws = MoeWorkspace.allocate(spec, 64, dtype, dev)
            # prefill-sized first, then decode-sized: stale rows of the bigger step must not leak
            for num_tokens, config in ((64, WIDE), (64, TALL), (5, SMALL), (1, SMALL)):
                hidden = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(dtype).to(dev)
                # one routing for both (fp16 logits can tie; the two must not pick differently)
                topk_weights, topk_ids = route(hidden, layer.router_weight, layer.router_bias, spec)
                want = experts_ref(hidden.double(), topk_weights.double(), topk_ids, wide.experts, spec)
                got = tm.experts_triton(hidden, topk_weights, topk_ids, layer.experts, spec, ws, config)
                assert got.dtype == dtype and got.shape == hidden.shape
                err, tol = _rel(got, want), dtype_tol
                if tol is None:  # 16-bit: within twice the error of transformers' own 16-bit arithmetic
                    tol = 2 * _rel(experts_ref(hidden, topk_weights, topk_ids, layer.experts, spec), want)
                assert err < tol, (kind, dtype, num_tokens, err, tol)
                whole = moe_forward(hidden, layer, spec, ws, config)  # routing, experts, shared expert
                if layer.shared is not None:
                    got = got + shared_expert_forward(hidden, layer.shared)
                assert torch.equal(whole, got)


def _double(layer: MoeLayerWeights) -> MoeLayerWeights:
    def d(t):
        return None if t is None else t.double()

    e, s = layer.experts, layer.shared
    return MoeLayerWeights(
        d(layer.router_weight),
        d(layer.router_bias),
        ExpertWeights(d(e.gate_up), d(e.down), d(e.gate_up_bias), d(e.down_bias)),
        None if s is None else SharedExpertWeights(d(s.gate_up), d(s.down), d(s.gate)),
    )


def check_triton(device: str) -> None:
    check_align(device)
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest); fp16 is the same code path, and
    # rounds to nearest in the interpreter too. CUDA checks bf16.
    check_layers(
        device, ((torch.float32, 1e-6), (torch.float16 if device == "cpu" else torch.bfloat16, None))
    )


CHECK = """
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_moe_triton import check_triton
_patch_triton_interpreter()  # runtime loop bounds under numpy 2.4, and bf16 dots
check_triton("cpu")
print("moe triton matches")
"""


@pytest.mark.skipif(not tm.HAVE_TRITON, reason="triton is not installed")
def test_triton_moe_matches_reference_in_the_interpreter():
    _interpret(CHECK, "moe triton matches")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and tm.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_triton_moe_matches_reference():
    check_triton("cuda")
    check_release_shapes("cuda")


def check_release_shapes(device: str, token_counts=(2048, 256, 32, 1)) -> None:
    """The Qwen3-30B-A3B and gpt-oss-20b layer shapes in bf16 with the launch-config table's own choices, at
    decode and prefill sizes (GPU only: too big for the interpreter)."""
    qwen = MoeSpec("qwen3_moe", 128, 8, 2048, 768, norm_topk_prob=True)
    oss = MoeSpec(
        "gpt_oss", 32, 4, 2880, 2880, scoring=RouterScoring.SOFTMAX_OVER_TOPK, has_router_bias=True,
        has_expert_bias=True, activation=Activation.CLAMPED_SWIGLU,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    for spec in (qwen, oss):
        layer = _layer(spec, torch.bfloat16, dev, gen)
        ws = MoeWorkspace.allocate(spec, 2048, torch.bfloat16, dev)
        for num_tokens in token_counts:
            hidden = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
            topk_weights, topk_ids = route(hidden, layer.router_weight, layer.router_bias, spec)
            want = experts_ref(hidden.double(), topk_weights.double(), topk_ids, _double(layer).experts, spec)
            got = tm.experts_triton(hidden, topk_weights, topk_ids, layer.experts, spec, ws)
            tol = 2 * _rel(experts_ref(hidden, topk_weights, topk_ids, layer.experts, spec), want)
            assert _rel(got, want) < tol, (spec.model_type, num_tokens, _rel(got, want), tol)


def test_max_blocks_bounds_every_routing():
    """The grid is sized from T alone: no routing of P pairs over E experts needs more blocks than this."""
    for num_pairs, num_experts, block_m in ((1, 8, 16), (8, 128, 16), (256, 128, 16), (65536, 128, 64)):
        # worst case: as many experts as possible with one pair each, the rest on one expert
        hit = min(num_experts, num_pairs)
        worst = (hit - 1) + -(-(num_pairs - hit + 1) // block_m)
        assert tm.max_blocks(num_pairs, num_experts, block_m) >= worst


def test_launch_config_table_and_heuristic(monkeypatch):
    spec = MoeSpec("qwen3_moe", num_experts=128, top_k=8, hidden_size=2048, expert_intermediate_size=768)
    assert tm.heuristic_config(spec, 32).block_m == 16  # decode: 2 pairs per expert
    assert tm.heuristic_config(spec, 8192).block_m == 64  # prefill: 512 per expert
    table = tm.LAUNCH_CONFIGS[(128, 768, "NVIDIA H200")]
    assert table[min(m for m in table if m >= 32)].block_m == 16
    assert tm.config_for(spec, 32, torch.device("cpu")) == tm.heuristic_config(spec, 32)
    # bf16 experts take the large tile from 128 pairs an expert, over the heuristic and over a device's table alike;
    # e4m3 experts keep what those choose
    for device_name in ("cpu", "NVIDIA H200"):
        monkeypatch.setattr(tm, "_device_name", lambda device, name=device_name: name)
        assert tm.config_for(spec, 2047, torch.device("cpu")).block_m == 64, device_name  # 127.9 an expert
        assert tm.config_for(spec, 2048, torch.device("cpu")).block_m == 128, device_name
        assert tm.config_for(spec, 8192, torch.device("cpu"), fp8=True).block_m == 64, device_name


@pytest.mark.skipif(not tm.HAVE_TRITON, reason="triton is not installed")
def test_empty_step_launches_nothing():
    spec = _spec("silu")
    layer = _layer(spec, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    ws = MoeWorkspace.allocate(spec, 4, torch.float32, torch.device("cpu"))
    hidden = torch.zeros(0, spec.hidden_size)
    assert moe_forward(hidden, layer, spec, ws).shape == (
        0,
        spec.hidden_size,
    )  # no kernel runs (no interpreter)
