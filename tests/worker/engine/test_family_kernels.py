"""The kernels' family epilogues (issue 24) against their torch references, and the owned decoder of every family
on its Triton path against its torch path: checked on the CPU through Triton's interpreter (in a subprocess, as
test_fused_kernels.py), and on CUDA (`gpu`) with, in fp32, the engine's greedy output against `model.generate`
for the family fixtures, and graphs against eager in bf16.

Epilogues: the fp32-weight RMSNorm (OLMo 2; Gemma's (1 + w) folded into an fp32 weight), Cohere's LayerNorm, a block's post-norm and
multiplier before the residual add (Gemma's sandwich norms, Granite), the embedding scale, GELU-tanh (act·mul and
the gate/up GEMM's epilogue), Gemma 3's fp32-weight q/k norms, attention soft-capping (decode and prefill) and the
final logits' divisor, scale and soft-cap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker.engine.attention import paged_attention_ref
from worker.engine.kernels import fused as fk

from .conftest import hf_greedy, make_requests
from .test_attention_triton import make_case
from .test_fused_kernels import REPO_ROOT, _rel, needs_triton

# The fixtures whose owned decoder takes the Triton path on CUDA with an epilogue or a torch stage of its own.
FUSED_FAMILIES = [
    "tiny-gemma2",  # (1 + w) sandwich norms, GELU-tanh, attention and final soft-caps, embedding scale
    "tiny-gemma3",  # + fp32-weight q/k norms, per-layer-type rotary
    "tiny-granite",  # embedding, residual and logits multipliers, attention multiplier
    "tiny-olmo2",  # fp32-weight norm, post-norms only; full-projection q/k norms (torch stage)
    "tiny-phi3",  # fused qkv / gate_up; partial rotary (torch stage)
    "tiny-smollm3",  # NoPE layers (torch stage)
    "tiny-glm4",  # four norms, interleaved partial rotary (torch stage)
    "tiny-ministral",  # interleaved sliding windows
    "tiny-cohere2",  # LayerNorm (the add+norm kernels' CENTRED), parallel blocks; interleaved rotary (torch stage)
]


def check_family_kernels(device: str) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        for dtype, tol in ((torch.float32, 1e-6), (_interpreter_dot_dtype(torch.bfloat16), 1e-2)):
            _check_add_norm_epilogues(dtype, tol)
            _check_gelu(dtype, tol)
            _check_qk_norm_fp32_weight(dtype, tol)
            _check_logits_epilogue(dtype, tol)
    _check_attention_softcap(device)  # make_case draws on the CPU's generator and moves the case to `device`


def _check_add_norm_epilogues(dtype, tol) -> None:
    n = 96
    x = torch.randn(5, n).to(dtype)
    res = torch.randn(5, n).to(dtype)
    w = (torch.randn(n) * 0.3).to(dtype)
    xw = (torch.randn(n) * 0.3).to(dtype)
    one_plus = fk.fold_one_plus(w)
    assert one_plus.dtype == torch.float32
    # Gemma's norm is the fp32-weight norm of the folded weight, bit for bit
    assert torch.equal(fk.rmsnorm_one_plus_ref(x, w, 1e-6), fk.rmsnorm_fp32_weight_ref(x, one_plus, 1e-6))
    scales: list = [None, 0.22, torch.tensor(61.97, dtype=dtype, device="cpu")]  # a CPU 0-dim, as the decoder's
    cases = [
        (norm_w, x_w, scale, with_res, fp32)
        for fp32, norm_w, x_w in ((False, w, None), (True, w, xw), (True, one_plus, fk.fold_one_plus(xw)))
        for scale in scales
        for with_res in (False, True)
    ]
    cases.append((None, xw, 0.5, True, True))  # OLMo 2: no pre-norm, the post-normed sum itself
    cases += [(w, None, None, with_res, "layer") for with_res in (False, True)]  # Cohere's LayerNorm (CENTRED)
    for norm_w, x_w, scale, with_res, fp32 in cases:
        centred = fp32 == "layer"
        ref_norm = fk.layernorm_ref if centred else fk.rmsnorm_fp32_weight_ref if fp32 else fk.rmsnorm_ref
        r_ref = res.clone() if with_res else None
        want, want_sum = fk.add_rmsnorm_ref(x, r_ref, norm_w, 1e-6, norm=ref_norm, x_weight=x_w, x_scale=scale)
        r_got = res.clone() if with_res else None
        got, got_sum = fk.add_rmsnorm(
            x, r_got, norm_w, 1e-6, weight_fp32=bool(fp32), centred=centred, x_weight=x_w, x_scale=scale
        )
        what = (dtype, norm_w is None, x_w is not None, scale, with_res, fp32)
        assert _rel(got_sum, want_sum) < tol, (what, _rel(got_sum, want_sum))
        assert _rel(got, want) < 2 * tol, (what, _rel(got, want))
        if with_res:
            assert got_sum is r_got, what  # the residual is updated in place


def _check_gelu(dtype, tol) -> None:
    from worker.engine.kernels import decode_gemm

    gate_up = (torch.randn(6, 2 * 80) * 3).to(dtype)
    got = fk.act_mul(gate_up, act=fk.ACT_GELU_TANH)
    assert _rel(got, fk.gelu_tanh_mul_ref(gate_up)) < 2 * tol, dtype
    assert _rel(fk.silu_mul(gate_up), fk.silu_mul_ref(gate_up)) < 2 * tol, dtype
    # the gate/up GEMM with GELU-tanh in its epilogue (K = 128, I = 64 tile GATED_CONFIG) equals the two launches
    x = torch.randn(5, 128).to(dtype)
    weight = (torch.randn(128, 128) * 0.1).to(dtype)
    bias = (torch.randn(128) * 0.1).to(dtype)
    assert decode_gemm.gated_config_for(64, 128, dtype) is not None
    fused = decode_gemm.decode_gate_up_silu(x, weight, bias, act=fk.ACT_GELU_TANH)
    two = fk.act_mul(decode_gemm.decode_linear(x, weight, bias), act=fk.ACT_GELU_TANH)
    assert _rel(fused, two) < tol, (dtype, _rel(fused, two))
    ref = fk.gelu_tanh_mul_ref(torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype))
    assert _rel(fused, ref) < 4 * tol, (dtype, _rel(fused, ref))


def _interpreter_dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16 for bf16 in Triton's interpreter, which gets bf16 dots wrong (test_fused_kernels.py) and rounds to
    bf16 otherwise than torch (half the elements of a bf16 RMSNorm one unit apart; fp16 agrees bit for bit)."""
    on_cpu = torch.get_default_device().type == "cpu"
    return torch.float16 if dtype == torch.bfloat16 and on_cpu else dtype


def _check_qk_norm_fp32_weight(dtype, tol) -> None:
    from worker.engine.attention import write_kv_ref

    num_heads, num_kv, head_dim, tokens = 4, 2, 32, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv) * head_dim).to(dtype)
    positions = torch.tensor([0, 3, 7, 1, 2])
    inv = 1.0 / (10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(16)[:, None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_norm = fk.fold_one_plus((torch.randn(head_dim) * 0.3).to(dtype))
    k_norm = fk.fold_one_plus((torch.randn(head_dim) * 0.3).to(dtype))
    caches = [torch.zeros(4, 4, num_kv, head_dim, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([1, 2, 5, 6, 9])
    args = (qkv, positions, cos, sin, q_norm, k_norm, 1e-6, num_heads, num_kv)

    def write(k, v):
        write_kv_ref(k, v, caches[0], caches[1], slots)

    want = fk.qkv_rope_write_ref(*args, write, norm=fk.rmsnorm_fp32_weight_ref)
    got = fk.qkv_rope_write(*args, caches[2], caches[3], slots, norm_fp32_weight=True)
    assert _rel(got, want) < 2 * tol, (dtype, _rel(got, want))
    assert _rel(caches[2], caches[0]) < 2 * tol and torch.equal(caches[3], caches[1]), dtype


def _check_logits_epilogue(dtype, tol) -> None:
    logits = (torch.randn(3, 300) * 20).to(dtype)
    for divisor, scale, softcap in ((4.0, None, None), (None, 0.25, None), (None, None, 8.0), (2.0, 0.5, 30.0)):
        want = fk.logits_epilogue_ref(logits, divisor, scale, softcap)
        got = fk.logits_epilogue(logits.clone(), divisor, scale, softcap)
        assert _rel(got, want) < 2 * tol, (dtype, divisor, scale, softcap, _rel(got, want))
    assert fk.logits_epilogue(logits, None, None, None) is logits


def _check_attention_softcap(device: str) -> None:
    """Soft-capped scores (cap 2: binding for scores of spread 4) in the decode (1 and several splits) and prefill
    kernels, with and without a window, against the reference."""
    from worker.engine.kernels import attention as at

    for dtype, tol in ((torch.float32, 1e-5), (_interpreter_dot_dtype(torch.bfloat16), 2e-2)):
        for window in (0, 5):
            c = make_case([9, 1, 23], [1, 1, 1], 4, 2, 32, 4, dtype, device, seed=3)
            layout = [c[k] for k in ("k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens")]
            want = paged_attention_ref(c["q"], *layout, 4 * c["scale"], sliding_window=window, softcap=2.0)
            plain = paged_attention_ref(c["q"], *layout, 4 * c["scale"], sliding_window=window)
            assert _rel(plain, want) > 10 * tol, "the cap must bind in this case"
            for splits in (1, 4):
                got = at.paged_decode_attention(
                    c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], 4 * c["scale"],
                    max_num_splits=splits, sliding_window=window, softcap=2.0,
                )  # fmt: skip
                assert _rel(got, want) < tol, (dtype, window, splits, _rel(got, want))
            c = make_case([9, 30, 5], [3, 30, 5], 4, 2, 32, 4, dtype, device, seed=4)
            layout = [c[k] for k in ("k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens")]
            want = paged_attention_ref(c["q"], *layout, 4 * c["scale"], sliding_window=window, softcap=2.0)
            got = at.paged_prefill_attention(
                c["q"], *layout, 4 * c["scale"], max_query_len=30, sliding_window=window, softcap=2.0
            )
            assert _rel(got, want) < tol, (dtype, window, "prefill", _rel(got, want))


def check_family_decoders(device: str, names=FUSED_FAMILIES) -> None:
    """Each family's owned forward on the Triton path (element-wise kernels; small-step GEMMs; Triton attention)
    equals its torch path (torch ops and attention) in fp32: one mixed step of two prompts."""
    from tests.worker.engine.test_fused_kernels import mixed_step_three_ways
    from worker.engine.models import load_model

    dev = torch.device(device)
    models = [(name, load_model(name, dev, torch.float32)[0]) for name in names]
    models.append(("gemma2, head_dim 64", _gemma2_head_dim_64(dev)))  # the QKV GEMM's rotary and GELU epilogues
    for name, model in models:
        outs = mixed_step_three_ways(model, dev, triton_attention=True)
        assert outs[0].shape == (2, model.config.vocab_size), name
        for variant, out in zip(("triton element-wise", "small-step path"), outs[1:], strict=True):
            err = (outs[0] - out).abs().max().item()
            assert err < 1e-4 * max(1.0, outs[0].abs().max().item()), (name, variant, err)


def _gemma2_head_dim_64(dev):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(1)
    config = Gemma2Config(
        vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, initializer_range=0.25,
        query_pre_attn_scalar=48, attn_logit_softcapping=5.0, final_logit_softcapping=8.0, sliding_window=3,
    )  # fmt: skip
    return Gemma2ForCausalLM(config).to(dev).eval()


KERNELS = r"""
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_fused_kernels import order_independent_interpreter_dots
from tests.worker.engine.test_family_kernels import check_family_kernels

_patch_triton_interpreter()
order_independent_interpreter_dots()
check_family_kernels("cpu")
print("family kernels match")
"""

DECODERS = r"""
import sys
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_family_kernels import check_family_decoders

_patch_triton_interpreter()
check_family_decoders("cpu", sys.argv[1:])
print("family decoders match")
"""


def test_every_family_takes_the_triton_path_on_cuda(tiny_models):
    """The gate and the runner, asked for CUDA: the Triton attention for every family (soft-capping ones too), and the
    owned decoder's kernels; the stages no kernel computes yet are per layer (`rope_kernel`), not per family."""
    from worker.engine.attention_backend import TritonAttentionBackend
    from worker.engine.decoder import OwnedDecoder, unsupported_reason
    from worker.engine.model_runner import attention_backend_for

    for name in FUSED_FAMILIES:
        model, _ = tiny_models(name)
        assert unsupported_reason(model) is None, name
        assert isinstance(attention_backend_for(model, "auto", is_cuda=True), TritonAttentionBackend), name
        decoder = OwnedDecoder(model, 64, use_triton=fk.HAVE_TRITON)
        assert decoder.use_triton == fk.HAVE_TRITON, name
        rotates_in_kernel = {
            "tiny-olmo2": False,  # q/k norms over the whole projection
            "tiny-phi3": False,  # partial rotary
            "tiny-glm4": False,  # interleaved partial rotary
            "tiny-cohere2": False,  # interleaved rotary on the sliding layers, none on the global ones
            "tiny-smollm3": None,  # every fourth layer has no rotary
        }.get(name, True)
        if rotates_in_kernel is None:
            assert decoder.rope_kernel == [i % 4 != 3 for i in range(4)], name
        else:
            assert all(k == rotates_in_kernel for k in decoder.rope_kernel), name


def _interpret(code: str, marker: str, args=()) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert marker in proc.stdout


@needs_triton
def test_family_epilogues_match_references_in_the_interpreter():
    _interpret(KERNELS, "family kernels match")


@needs_triton
@pytest.mark.parametrize("names", [FUSED_FAMILIES[:4], FUSED_FAMILIES[4:]])
def test_family_decoders_triton_path_matches_torch_path_in_the_interpreter(names):
    _interpret(DECODERS, "family decoders match", names)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_family_kernels_and_decoders():
    check_family_kernels("cuda")
    check_family_decoders("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAVE_TRITON), reason="needs CUDA, triton")
@pytest.mark.parametrize("name", FUSED_FAMILIES)
def test_owned_fp32_on_the_triton_path_equals_generate(name):
    """On CUDA the owned decoder runs the family on its Triton path (kernels, Triton attention, graphs) and its
    fp32 greedy output equals `model.generate`'s, sync and async (chunked prefill: 256-token steps)."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    from .test_engine_gpu import token_agreement

    model, tok = load_model(name, torch.device("cuda"), torch.float32)
    # The reference is the model's own math: transformers' CUDA default (sdpa) drops Gemma 2's attention soft-cap.
    model.set_attn_implementation("eager")
    reqs = make_requests(tok, 16, seed=5, max_prompt=300, max_new=32)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    for mode in ("sync", "async"):
        config = EngineConfig(device="cuda", mode=mode, dtype="float32", max_num_batched_tokens=256, decoder="owned")
        engine = Engine(model, tok, config)
        assert engine.runner.decoder.use_triton and engine.runner.attn_backend.name == "triton", name
        out = [r.token_ids for r in engine.generate(reqs)]
        del engine
        torch.cuda.empty_cache()
        agreement = token_agreement(out, ref)  # as test_decoder_gpu.py's: a near-tie may flip one token in fp32
        assert agreement >= 0.99, f"{name} {mode}: owned fp32 vs generate agree on {agreement:.4f} of tokens"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAVE_TRITON), reason="needs CUDA, triton")
@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3", "tiny-granite", "tiny-olmo2"])
def test_graph_equals_eager_bf16(name):
    """In bf16 the families' captured decode steps give the same tokens as eager ones (an eager decode step pads
    to its graph's bucket, so both run the same kernels on the same shapes)."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    model, tok = load_model(name, torch.device("cuda"), torch.bfloat16)
    reqs = make_requests(tok, 24, seed=7, max_prompt=300, max_new=48)
    outs = []
    for graphs in (False, True):
        config = EngineConfig(device="cuda", mode="async", use_cuda_graphs=graphs, decoder="owned")
        engine = Engine(model, tok, config)
        outs.append([r.token_ids for r in engine.generate(reqs)])
        assert (len(engine.runner.graphs) > 0) == graphs, name
        del engine
        torch.cuda.empty_cache()
    assert outs[0] == outs[1], f"{name}: graph and eager tokens differ in bf16"
