"""The owned decoder's Triton kernels compute their torch references (which are transformers'
functions). Checked on CPU through Triton's interpreter, in a subprocess since TRITON_INTERPRET must be
set before triton is imported; the GPU check is in test_decoder_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.engine.kernels import fused as fused_kernels

REPO_ROOT = Path(__file__).resolve().parents[3]

CHECK = r"""
from tests.worker.engine.test_fused_kernels import check_kernels, order_independent_interpreter_dots

order_independent_interpreter_dots()
check_kernels("cpu")
print("fused kernels match")
"""


def order_independent_interpreter_dots() -> None:
    """Make the interpreter's tl.dot sum each tile in float64, then round as before (this process only).

    The interpreter runs tl.dot as numpy's sgemm, whose summation order for an element can depend on where its
    row sits in the tile: on an AMD EPYC with numpy 2.4 the QKV+rotary program (weight rows j..j+31 and
    j+64..j+95) and the plain GEMM (rows j..j+63) then rounded the same row's fp32 products apart in the last
    bit. Summed in float64, a tile's products round to the same fp32 wherever the row sits, so the bit-for-bit
    checks below test the kernels' logic, not the host's BLAS. (On the GPU each MMA sums every row alike; the
    GPU check keeps exact equality in bf16.)"""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *rest):
        wide = (np.float16, np.float32)
        if a.data.dtype not in wide or b.data.dtype not in wide or d.data.dtype != np.float32:
            return original(self, a, b, d, *rest)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interp.TensorHandle(product + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot


def check_kernels(device: str) -> None:
    """Each Triton kernel against its torch twin, fp32 and bf16, on `device` (CUDA or the interpreter)."""
    torch.manual_seed(0)
    with torch.device(device):
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            _check_add_rmsnorm_and_silu_mul(dtype, tol)
            # head_dim 24: a non-power-of-two half
            for head_dim, with_norm in ((32, False), (32, True), (24, True)):
                _check_qkv_rope_write(dtype, tol, head_dim, with_norm)
        # the interpreter gets bf16 dots wrong (fp16 is the same code path); CUDA checks bf16
        for dtype in (torch.float32, torch.float16 if device == "cpu" else torch.bfloat16):
            _check_decode_gemm(dtype, 1e-6 if dtype == torch.float32 else 1e-2, pdl=device != "cpu")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _check_add_rmsnorm_and_silu_mul(dtype, tol):
    from worker.engine.kernels import fused as fk

    x, res, w = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype), torch.randn(96).to(dtype)
    want_normed, want_res = fk.add_rmsnorm_ref(x, res, w, 1e-5)
    got_normed, got_res = fk.add_rmsnorm(x, res.clone(), w, 1e-5)
    assert _rel(got_res, want_res) < tol / 2, dtype  # one rounding (the interpreter rounds bf16 its way)
    assert _rel(got_normed, want_normed) < tol, (dtype, _rel(got_normed, want_normed))
    got_normed, got_res = fk.add_rmsnorm(x, None, w, 1e-5)
    assert got_res is x and _rel(got_normed, fk.rmsnorm_ref(x, w, 1e-5)) < tol
    gate_up = torch.randn(3, 2 * 200).to(dtype)
    assert _rel(fk.silu_mul(gate_up), fk.silu_mul_ref(gate_up)) < tol, dtype


def _check_decode_gemm(dtype, tol, pdl):
    """decode_linear (every config family, bias, 1-32 rows) against torch in fp32 on the same rounded
    inputs; a shape that does not tile falls back to cuBLAS."""
    from worker.engine.kernels import decode_gemm as dg

    f = torch.nn.functional
    for config in (dg.NARROW_CONFIG, dg.WIDE_CONFIG):
        block_n, block_k = config[:2]
        n, k = 2 * block_n, 2 * block_k
        w = (torch.randn(n, k) / k**0.5).to(dtype)
        bias = torch.randn(n).to(dtype)
        for m in (1, 7, 32):
            x = torch.randn(m, k).to(dtype)
            got = dg.decode_linear(x, w, bias, pdl=pdl, config=config)
            want = f.linear(x.float(), w.float(), bias.float())
            assert got.dtype == dtype and _rel(got, want) < tol, (dtype, config, m, _rel(got, want))
    _check_gate_up_silu(dtype, tol, pdl)
    _check_grouped_launch_order(dtype, pdl)
    for head_dim in (64, 128, 24):  # 24: no whole group of rotary pairs, the two launches
        _check_qkv_rope_gemm(dtype, head_dim, pdl)
    x, w = torch.randn(3, 100).to(dtype), torch.randn(70, 100).to(dtype)
    assert dg.config_for(70, 100) is None and torch.equal(dg.decode_linear(x, w), f.linear(x, w))
    assert dg.config_for(4096, 14336) is None, "the down projection keeps cuBLAS"


def _check_grouped_launch_order(dtype, pdl):
    """group_n only reorders the programs: the same bits as the 2-D grid, for plain and gated products, with groups
    that divide the weight tiles and one that leaves a short last group (5 tiles in groups of 2), over 3 M blocks."""
    from worker.engine.kernels import decode_gemm as dg

    block_n, block_k = dg.NARROW_CONFIG[:2]
    config = dg.config_for(5 * block_n, 2 * block_k, dtype)  # NARROW_CONFIG, with fp32's fewer stages
    assert config is not None and config[:2] == (block_n, block_k)
    w = (torch.randn(5 * block_n, 2 * block_k) / (2 * block_k) ** 0.5).to(dtype)
    x = torch.randn(40, 2 * block_k).to(dtype)
    want = dg.decode_linear(x, w, pdl=pdl, config=config, block_m=16)
    gated = dg.decode_gate_up_silu(x, w[: 4 * block_n], pdl=pdl, config=config, block_m=16)
    for group_n in (1, 2, 5):
        got = dg.decode_linear(x, w, pdl=pdl, config=config, block_m=16, group_n=group_n)
        assert torch.equal(got, want), (dtype, group_n)
        got = dg.decode_gate_up_silu(x, w[: 4 * block_n], pdl=pdl, config=config, block_m=16, group_n=group_n)
        assert torch.equal(got, gated), (dtype, group_n, "gated")


def _check_qkv_rope_gemm(dtype, head_dim, pdl):
    """decode_qkv_rope_write (QKV GEMM with rotary and the KV write in its epilogue) gives q, the K cache and
    the V cache bit for bit as decode_linear then qkv_rope_write do; padding rows write scratch block 0."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import fused as fk

    num_heads, num_kv, block_size, num_blocks, k = 4, 2, 4, 12, 2 * dg.ROPE_CONFIG[1]
    n = (num_heads + 2 * num_kv) * head_dim
    assert (dg.rope_config_for(num_heads, num_kv, head_dim, k, dtype) is None) == (head_dim % 64 != 0)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    angles = torch.rand(40, head_dim // 2).repeat(1, 2) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for bias in (None, torch.randn(n).to(dtype)):
        for m in (1, 5, 32):
            x = torch.randn(m, k).to(dtype)
            positions = torch.randint(0, 40, (m,), dtype=torch.int32)
            slots = torch.randperm(num_blocks * block_size - block_size)[:m].to(torch.int32) + block_size
            if m > 1:
                slots[-1] = 0  # a padding row
            caches = [torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=dtype) for _ in range(4)]
            got_q = dg.decode_qkv_rope_write(
                x, w, bias, positions, cos, sin, num_heads, num_kv, caches[0], caches[1], slots, pdl=pdl
            )
            qkv = dg.decode_linear(x, w, bias, pdl=pdl, config=dg.ROPE_CONFIG)
            want_q = fk.qkv_rope_write(
                qkv, positions, cos, sin, None, None, 0.0, num_heads, num_kv, caches[2], caches[3], slots, pdl=pdl
            )
            what = (dtype, head_dim, m, bias is None)
            assert got_q.shape == (m, num_heads, head_dim) and torch.equal(got_q, want_q), what
            assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), what
            assert caches[0][1:].abs().sum() > 0 and caches[1][1:].abs().sum() > 0, what  # it wrote something


def _check_gate_up_silu(dtype, tol, pdl):
    """decode_gate_up_silu equals decode_linear then silu_mul bit for bit (same tiles: each product is
    rounded, then SiLU, then the multiply, as the two kernels do), and silu(gate) * up in fp32 within `tol`;
    an intermediate size that does not tile takes the two launches."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import fused as fk

    f = torch.nn.functional
    config = dg.GATED_CONFIG
    inter, k = 2 * config[0], 2 * config[1]
    w = (torch.randn(2 * inter, k) / k**0.5).to(dtype)
    for bias in (None, torch.randn(2 * inter).to(dtype)):
        for m in (1, 5, 32):
            x = torch.randn(m, k).to(dtype)
            got = dg.decode_gate_up_silu(x, w, bias, pdl=pdl)
            two_launches = fk.silu_mul(dg.decode_linear(x, w, bias, pdl=pdl, config=config), pdl=pdl)
            assert got.shape == (m, inter) and torch.equal(got, two_launches), (dtype, m, bias is None)
            gate, up = f.linear(x.float(), w.float(), None if bias is None else bias.float()).chunk(2, dim=-1)
            assert _rel(got, f.silu(gate) * up) < 2 * tol, (dtype, m, _rel(got, f.silu(gate) * up))
    x, w = torch.randn(3, 100).to(dtype), torch.randn(2 * 70, 100).to(dtype)
    assert dg.gated_config_for(70, 100) is None
    assert torch.equal(dg.decode_gate_up_silu(x, w), fk.silu_mul(f.linear(x, w)))


def _check_qkv_rope_write(dtype, tol, head_dim, with_norm):
    """4 q heads, 2 kv heads, 5 tokens, one of them a padding row (it writes scratch block 0, as graphs pad)."""
    from worker.engine.attention import write_kv_ref
    from worker.engine.kernels import fused as fk

    num_heads, num_kv, block_size, num_blocks, num_tokens = 4, 2, 4, 6, 5
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv) * head_dim).to(dtype)
    positions = torch.tensor([0, 3, 7, 2, 9], dtype=torch.int32)
    angles = torch.rand(16, head_dim // 2).repeat(1, 2) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_norm = torch.randn(head_dim).to(dtype) if with_norm else None
    k_norm = torch.randn(head_dim).to(dtype) if with_norm else None
    slots = torch.tensor([1, 6, 13, 2, 22], dtype=torch.int32)
    k_ref, v_ref, k_got, v_got = (
        torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=dtype) for _ in range(4)
    )
    args = (qkv, positions, cos, sin, q_norm, k_norm, 1e-6, num_heads, num_kv)
    want_q = fk.qkv_rope_write_ref(*args, lambda k, v: write_kv_ref(k, v, k_ref, v_ref, slots))
    got_q = fk.qkv_rope_write(*args, k_got, v_got, slots)
    what = (dtype, head_dim, with_norm)
    # transformers rounds after each rotary product, the kernel once: allow two roundings' worth
    assert got_q.shape == want_q.shape and _rel(got_q, want_q) < 2 * tol, (what, _rel(got_q, want_q))
    assert _rel(k_got, k_ref) < 2 * tol, (what, _rel(k_got, k_ref))
    assert torch.equal(v_got, v_ref), what  # v is copied, not computed


DECODER_CHECK = r"""
from tests.worker.engine.test_fused_kernels import check_decoder

check_decoder("cpu")
print("decoder matches")
"""


def mixed_step_three_ways(
    model, dev: torch.device, triton_attention: bool = False, positions: list[int] | None = None
) -> list[torch.Tensor]:
    """The owned forward's logits for one mixed step (two prompts, 7 rows, 2 sampled) on the torch path, with the
    Triton element-wise kernels, and on the small-step path (Triton GEMMs; PDL on CUDA), each decoder reading
    the family's norm and activation. `triton_attention`: the Triton paths attend with the Triton kernels (else
    every path uses the torch attention). `positions`: the 7 rows' rotary rows (default: their positions)."""
    from worker.engine.attention_backend import (
        AttentionBackend,
        AttentionMetadata,
        TritonAttentionBackend,
        sliding_windows_of,
    )
    from worker.engine.decoder import OwnedDecoder
    from worker.engine.layer_ops import layer_ops
    from worker.engine.model_runner import allocate_kv_cache

    outs = []
    for use_triton, small_step in ((False, False), (True, False), (True, True)):
        decoder = OwnedDecoder(model, 64, use_triton=use_triton)
        assert decoder.use_triton == use_triton
        if small_step:  # all 7 rows fit a small step; the interpreter cannot run PDL's intrinsics
            decoder.small_step_ops = layer_ops(
                True, small_step=True, pdl=dev.type != "cpu", norm=decoder.family.norm,
                activation=decoder.args.activation,
            )  # fmt: skip
        caches = allocate_kv_cache(model.config, 8, 16, torch.float32, dev)
        i32 = dict(dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            kv_caches=caches,
            slot_mapping=torch.tensor([16, 17, 18, 19, 32, 33, 34], **i32),
            block_tables=torch.tensor([[1], [2]], **i32),
            cu_seqlens_q=torch.tensor([0, 4, 7], **i32),
            context_lens=torch.tensor([4, 3], **i32),
            max_query_len=4,
            max_context_len=4,
            is_decode_only=False,
            backend=TritonAttentionBackend() if use_triton and triton_attention else AttentionBackend(),
            sliding_windows=sliding_windows_of(model.config),
        )
        ids = torch.tensor([1, 5, 9, 77, 4, 8, 2], **i32)
        rows = torch.tensor(positions or [0, 1, 2, 3, 0, 1, 2], **i32)
        with torch.inference_mode():
            outs.append(decoder(ids, rows, meta, torch.tensor([3, 6], device=dev)))
    return outs


def check_decoder(device: str) -> None:
    """The whole owned forward with the Triton element-wise kernels, and with the small-step path (Triton
    GEMMs; PDL on CUDA), equals its torch twin."""
    from worker.engine.models import load_model

    dev = torch.device(device)
    for name in ("tiny-qwen3", "tiny-qwen2", "llama, head_dim 64"):
        # head_dim 64: the QKV GEMM's rotary epilogue runs (the tiny presets' 16 takes the two launches)
        model = _llama_head_dim_64(dev) if name.startswith("llama") else load_model(name, dev, torch.float32)[0]
        outs = mixed_step_three_ways(model, dev)
        assert outs[0].shape == (2, model.config.vocab_size), name
        for variant, out in zip(("triton element-wise", "small-step path"), outs[1:], strict=True):
            err = (outs[0] - out).abs().max().item()
            assert err < 1e-4, (name, variant, err)


def _llama_head_dim_64(dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, initializer_range=0.25,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dev).eval()


def _interpret(code: str, marker: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert marker in proc.stdout


needs_triton = pytest.mark.skipif(not fused_kernels.HAVE_TRITON, reason="triton is not installed")


@needs_triton
def test_fused_kernels_match_references_in_the_interpreter():
    _interpret(CHECK, "fused kernels match")


@needs_triton
def test_owned_decoder_with_triton_kernels_matches_torch_path_in_the_interpreter():
    _interpret(DECODER_CHECK, "decoder matches")


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_kernels.HAVE_TRITON), reason="needs CUDA, triton"
)
def test_gpu_fused_kernels_and_decoder():
    check_kernels("cuda")
    check_decoder("cuda")
