"""`--kv-cache-dtype fp8` in the Triton kernels: every KV writer (write_kv, the fused QKV/rotary write, the
small-step QKV GEMM's epilogue) stores what the torch reference stores (K / k_scale, V / v_scale rounded to e4m3,
saturated), and the decode, prefill, mixed and sliding-window attention kernels read an e4m3 cache as the torch
reference does when it dequantizes the same cache (K * k_scale, V * v_scale).

Two ways to run the same checks (`check_fp8_kv`): on CUDA (`@pytest.mark.gpu`), and on the CPU through Triton's
interpreter in a subprocess with TRITON_INTERPRET=1, tiny shapes. The engine-level checks (fp8 vs bf16 KV
greedy agreement, the doubled block count, the prefix cache) are GPU tests at the end.
Run the interpreter variant by hand:  TRITON_INTERPRET=1 python tests/worker/engine/test_attention_fp8_kv.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.engine.test_attention_triton import (
    _decode_ctx,
    _prefill_mix,
    _rel_err,
    _triton_installed,
    make_case,
)
from worker.engine.attention import paged_attention_ref, to_cache, write_kv_ref
from worker.engine.attention_backend import AttentionMetadata, TritonAttentionBackend
from worker.engine.kernels import attention as at
from worker.engine.kv_cache import KV_FP8_DTYPE

REPO_ROOT = Path(__file__).resolve().parents[3]
# Relative error of the kernels vs the reference over the same e4m3 cache: the rounding of q (bf16) and of the
# fp32 accumulation only; the cache's own rounding is in both.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SMALLEST_NORMAL = 2.0**-6  # e4m3: below this, subnormals


def _fp8_case(ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device, seed, k_scale, v_scale):
    """make_case's random paged cache (NaN where nothing is written) as an e4m3 cache of K / k_scale, V / v_scale."""
    c = make_case(ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, torch.float32, "cpu", seed)
    c["k_cache"] = to_cache(c["k_cache"] * 2, KV_FP8_DTYPE, k_scale).to(device)  # x2: some values above 2
    c["v_cache"] = to_cache(c["v_cache"], KV_FP8_DTYPE, v_scale).to(device)
    c["q"] = c["q"].to(dtype).to(device)
    for name in ("block_tables", "cu_seqlens_q", "context_lens"):
        c[name] = c[name].to(device)
    return c


def _reference(c, q, sliding_window=0, k_scale=1.0, v_scale=1.0):
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        layout = (c[k] for k in ("k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens"))
        return paged_attention_ref(
            q, *layout, c["scale"], sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale
        )
    finally:
        torch.set_float32_matmul_precision(prev)


def _close(out, ref, dtype, what) -> float:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = _rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"
    return err


def _assert_same_fp8(got: torch.Tensor, want: torch.Tensor, exact: bool, what) -> None:
    """Bit-equal e4m3 caches (NaN = NaN). The interpreter (numpy) rounds values at and below e4m3's smallest
    normal its own way (it flushes subnormals): there, only within that magnitude."""
    g, w = got.float(), want.float()
    same = (g == w) | (g.isnan() & w.isnan())
    if not exact:
        same |= (w.abs() <= SMALLEST_NORMAL) & ((g - w).abs() <= SMALLEST_NORMAL)
    assert same.all(), f"{what}: {int((~same).sum())} of {same.numel()} cache bytes differ"


def exact_interpreter_fp8() -> None:
    """Convert to and from e4m3 in the interpreter as torch (and the GPU's cvt) do, for this process only:
    Triton 3.6's interpreter rounds half up without carrying into the exponent (1.97 became 1.0, not 2.0) and
    flushes subnormals, so its e4m3 values are not the ones the kernels store on the GPU."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    torch_of = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}
    original = interp.InterpreterBuilder.create_fp_to_fp

    def as_torch(data: np.ndarray, dtype) -> torch.Tensor:
        raw = torch.from_numpy(np.ascontiguousarray(data))
        return raw.view(KV_FP8_DTYPE) if dtype == tl.float8e4nv else raw.view(torch_of[dtype])

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv in (src_ty, dst_ty) and {src_ty, dst_ty} - {tl.float8e4nv} <= set(torch_of):
            target = KV_FP8_DTYPE if dst_ty == tl.float8e4nv else torch_of[dst_ty]
            out = as_torch(src.data, src_ty).to(target)
            raw = out.view(torch.uint8) if target == KV_FP8_DTYPE else out.view(torch.uint16 if out.element_size() == 2 else torch.uint32)
            return interp.TensorHandle(raw.numpy().view(interp._get_np_dtype(dst_ty)), dst_ty)
        return original(self, src, dst_type, rounding_mode)

    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def check_write_kv(dtype, device, exact: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    kvh, d, bs, nb = 2, 24, 8, 5
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 0.37)):
        key = (torch.randn(11, kvh, d, generator=gen) * 3).to(dtype)
        value = torch.randn(11, kvh, d, generator=gen).to(dtype)
        key[0, 0, 0], value[1, 1, 1] = 1e4, -1e4  # past e4m3's range: saturate, never NaN
        slots = torch.randperm(nb * bs - bs, generator=gen)[:11].to(torch.int32) + bs
        slots[-1] = 0  # a padding row writes scratch block 0
        want = [torch.zeros(nb, bs, kvh, d, dtype=KV_FP8_DTYPE) for _ in range(2)]
        write_kv_ref(key, value, *want, slots, k_scale=k_scale, v_scale=v_scale)
        got = [torch.zeros(nb, bs, kvh, d, dtype=KV_FP8_DTYPE, device=device) for _ in range(2)]
        at.write_kv(key.to(device), value.to(device), *got, slots.to(device), k_scale, v_scale)
        for g, w, name in zip(got, want, "KV", strict=True):
            _assert_same_fp8(g.cpu(), w, exact, f"write_kv {name} {dtype} scales {k_scale, v_scale}")
        assert float(got[0].float().abs().max()) == 448.0 and not got[1].float().isnan().any()


def check_fused_writers(dtype, device, exact: bool) -> None:
    """The fused QKV + rotary write and the small-step GEMM epilogue store the e4m3 cache the unfused path does."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import fused as fk

    gen = torch.Generator().manual_seed(1)
    heads, kvh, head_dim, bs, nb, t = 4, 2, 64, 4, 8, 5
    kv_scale = (0.5, 0.37)
    qkv = torch.randn(t, (heads + 2 * kvh) * head_dim, generator=gen).to(dtype).to(device)
    positions = torch.tensor([0, 3, 7, 2, 9], dtype=torch.int32, device=device)
    angles = torch.rand(16, head_dim // 2, generator=gen).repeat(1, 2) * 6.3
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = torch.tensor([5, 6, 13, 0, 22], dtype=torch.int32, device=device)
    caches = [torch.zeros(nb, bs, kvh, head_dim, dtype=KV_FP8_DTYPE, device=device) for _ in range(4)]
    args = (qkv, positions, cos, sin, None, None, 1e-6, heads, kvh)
    q_fused = fk.qkv_rope_write(*args, caches[0], caches[1], slots, kv_scale=kv_scale)
    # the unfused path: the same rotary (the kernel's own q), then write_kv of the k and v it computes
    k_bf, v_bf = (torch.zeros(nb, bs, kvh, head_dim, dtype=dtype, device=device) for _ in range(2))
    fk.qkv_rope_write(*args, k_bf, v_bf, slots)
    k_rows = k_bf.view(-1, kvh, head_dim)[slots.long()]
    v_rows = v_bf.view(-1, kvh, head_dim)[slots.long()]
    at.write_kv(k_rows, v_rows, caches[2], caches[3], slots, *kv_scale)
    _assert_same_fp8(caches[0].cpu(), caches[2].cpu(), exact, f"qkv_rope_write K {dtype}")
    _assert_same_fp8(caches[1].cpu(), caches[3].cpu(), exact, f"qkv_rope_write V {dtype}")
    assert q_fused.shape == (t, heads, head_dim)
    if dtype == torch.float32:
        return  # the small-step GEMM multiplies bf16/fp16 weights only
    k = 2 * dg.ROPE_CONFIG[1]
    x = torch.randn(3, k, generator=gen).to(dtype).to(device)
    w = (torch.randn((heads + 2 * kvh) * head_dim, k, generator=gen) / k**0.5).to(dtype).to(device)
    epilogue = [torch.zeros(nb, bs, kvh, head_dim, dtype=KV_FP8_DTYPE, device=device) for _ in range(4)]
    rows = slots[:3]
    dg.decode_qkv_rope_write(x, w, None, positions[:3], cos, sin, heads, kvh, *epilogue[:2], rows, kv_scale=kv_scale)
    qkv_rows = dg.decode_linear(x, w, None, config=dg.ROPE_CONFIG)
    fk.qkv_rope_write(
        qkv_rows, positions[:3], cos, sin, None, None, 0.0, heads, kvh, *epilogue[2:], rows, kv_scale=kv_scale
    )
    _assert_same_fp8(epilogue[0].cpu(), epilogue[2].cpu(), exact, "QKV GEMM epilogue K")
    _assert_same_fp8(epilogue[1].cpu(), epilogue[3].cpu(), exact, "QKV GEMM epilogue V")


def check_attention(dtype, device) -> list[float]:
    """Decode (1, 2 and many splits), prefill (padding rows, a query-length bound), sliding windows, and a mixed
    step through the backend, over e4m3 caches with unit and non-unit scales."""
    errs = []
    heads, kvh, d, bs = 6, 2, 24, 16
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 0.37)):
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        ctx = _decode_ctx(bs, long=150)
        c = _fp8_case(ctx, [1] * len(ctx), heads, kvh, d, bs, dtype, device, 0, k_scale, v_scale)
        for window in (0, 5, 33):
            ref = _reference(c, c["q"], window, **scales)
            for splits in (1, 2, at.DEFAULT_MAX_NUM_SPLITS):
                out = at.paged_decode_attention(
                    c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], c["scale"],
                    max_num_splits=splits, sliding_window=window, **scales,
                )  # fmt: skip
                errs.append(_close(out, ref, dtype, f"decode {dtype} splits={splits} window={window} {scales}"))
        ctx, ql = _prefill_mix(bs, long=90)
        c = _fp8_case(ctx, ql, heads, kvh, d, bs, dtype, device, 1, k_scale, v_scale)
        q = torch.cat([c["q"], torch.randn(3, heads, d).to(dtype).to(device)])  # 3 padding rows: zeros
        for window in (0, 7):
            ref = _reference(c, q, window, **scales)
            layout = (c["k_cache"], c["v_cache"], c["block_tables"], c["cu_seqlens_q"], c["context_lens"])
            out = at.paged_prefill_attention(q, *layout, c["scale"], sliding_window=window, **scales)
            errs.append(_close(out, ref, dtype, f"prefill {dtype} window={window} {scales}"))
            bounded = at.paged_prefill_attention(q, *layout, c["scale"], max_query_len=max(ql), **scales)
            if not window:
                errs.append(_close(bounded, ref, dtype, f"prefill bounded {dtype} {scales}"))
        errs.append(_check_mixed(dtype, device, k_scale, v_scale))
    return errs


def _check_mixed(dtype, device, k_scale, v_scale) -> float:
    """A mixed step (2 decodes, then 2 prefill chunks) through TritonAttentionBackend, its scales from the
    metadata's per-layer kv_scales (layer 1 here)."""
    ctx, ql = [40, 17, 30, 9], [1, 1, 12, 9]
    c = _fp8_case(ctx, ql, 4, 2, 16, 8, dtype, device, 2, k_scale, v_scale)
    meta = AttentionMetadata(
        kv_caches=[],
        slot_mapping=torch.zeros(0, dtype=torch.int32, device=device),
        block_tables=c["block_tables"],
        cu_seqlens_q=c["cu_seqlens_q"],
        context_lens=c["context_lens"],
        max_query_len=max(ql),
        max_context_len=max(ctx),
        is_decode_only=False,
        backend=TritonAttentionBackend(),
        num_decode_seqs=2,
        kv_scales=((1.0, 1.0), (k_scale, v_scale)),
    )
    out = meta.backend.attend(c["q"], c["k_cache"], c["v_cache"], meta, c["scale"], 1)
    ref = _reference(c, c["q"], 0, k_scale, v_scale)
    return _close(out, ref, dtype, f"mixed step {dtype} scales {k_scale, v_scale}")


def check_fp8_kv(device: str) -> list[float]:
    exact = device != "cpu"  # the interpreter's e4m3 subnormals may still differ (see _assert_same_fp8)
    errs: list[float] = []
    for dtype in (torch.float32, torch.bfloat16):
        check_write_kv(dtype, device, exact)
        check_fused_writers(dtype, device, exact)
        errs += check_attention(dtype, device)
    return errs


@pytest.mark.skipif(not _triton_installed(), reason="triton not installed")
def test_fp8_kv_kernels_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "fp8 kv checks passed" in proc.stdout


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs a CUDA device and triton"
)


@pytest.mark.gpu
@needs_cuda
def test_fp8_kv_kernels_on_cuda():
    errs = check_fp8_kv("cuda")
    assert max(errs) < TOL[torch.bfloat16]


@pytest.fixture(scope="module")
def small_bf16():
    """small-llama in bf16 on CUDA at `bench quality`'s stable init (unit embeddings, small residual updates,
    logits of std 4): at the plain random init any perturbation grows through the layers (bench/quality.py)."""
    from worker.bench import quality
    from worker.engine.tokenizer import ByteTokenizer

    probe = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(0))
    model, _ = quality.build_models("small-llama", None, torch.bfloat16, torch.device("cuda"), 0, 4.0, probe)
    return model, ByteTokenizer()


def _generate(model, tok, reqs, **config):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    engine = Engine(model, tok, EngineConfig(device="cuda", **config))
    results = engine.generate(reqs)
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return engine, [r.token_ids for r in results]


@pytest.mark.gpu
@needs_cuda
def test_teacher_forced_fp8_kv_triton_equals_the_torch_reference(small_bf16):
    """cbq's forward over an e4m3 cache with the Triton writers and kernels (prefill, then decode steps) vs the
    same forward with the torch attention reading the same kind of cache: the kernels' arithmetic order is all
    that differs, as between the two bf16 runs."""
    from worker.bench import quality

    model, _ = small_bf16
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (300,), generator=gen).tolist() for _ in range(3)]
    found = {}
    for kv in ("auto", "fp8"):
        triton = quality.teacher_forced_logits(model, kv, prompts, decode_len=40)
        torch_ref = quality.teacher_forced_logits(model, kv, prompts, decode_len=40, attention_backend="torch")
        found[kv] = quality.compare(torch_ref, triton)
    print(f"triton vs torch attention, bf16 cache: {found['auto']}, fp8 cache: {found['fp8']}")
    assert found["fp8"].mean_kl < max(2e-3, 4 * found["auto"].mean_kl), found
    assert found["fp8"].top1_agreement >= min(0.97, found["auto"].top1_agreement - 0.02), found


@pytest.mark.gpu
@needs_cuda
def test_engine_fp8_kv_agrees_with_bf16_kv_and_doubles_the_blocks(small_bf16):
    """Greedy tokens with an e4m3 cache vs a bf16 cache (graphs, async, the Triton kernels): FP8 rounds K and V
    to 3 mantissa bits, so a sequence may part from the bf16 one after a near-tie; most first tokens agree. The
    same memory budget holds twice the blocks."""
    from .conftest import make_requests
    from .test_engine_gpu import token_agreement

    model, tok = small_bf16
    reqs = make_requests(tok, 48, seed=5, max_prompt=500, max_new=48)
    bf16_engine, bf16 = _generate(model, tok, reqs, gpu_memory_utilization=0.5)
    bf16_blocks = bf16_engine.runner.num_kv_blocks
    del bf16_engine
    torch.cuda.empty_cache()
    fp8_engine, fp8 = _generate(model, tok, reqs, gpu_memory_utilization=0.5, kv_cache_dtype="fp8")
    assert fp8_engine.runner.kv_caches[0][0].dtype == KV_FP8_DTYPE
    ratio = fp8_engine.runner.num_kv_blocks / bf16_blocks
    assert 1.9 < ratio < 2.1, f"fp8 holds {ratio:.2f}x the blocks of bf16"
    del fp8_engine
    torch.cuda.empty_cache()
    firsts = sum(a[:1] == b[:1] for a, b in zip(fp8, bf16, strict=True)) / len(reqs)
    agreement = token_agreement(fp8, bf16)
    print(f"fp8 vs bf16 KV: first tokens {firsts:.3f}, token agreement {agreement:.3f}")
    assert firsts >= 0.8 and agreement >= 0.2, (firsts, agreement)  # CPU, bf16, same requests: 0.92, 0.37


@pytest.mark.gpu
@needs_cuda
def test_fp8_kv_prefix_cache_reuses_fp8_blocks(small_bf16):
    """A second pass over the same prompts reads their prefixes from cached e4m3 blocks: the same tokens as the
    first pass, which wrote them (the cached blocks hold what a fresh prefill would write)."""
    from .conftest import make_requests
    from .test_engine_gpu import token_agreement

    model, tok = small_bf16
    reqs = make_requests(tok, 16, seed=9, max_prompt=400, max_new=24)
    engine, first = _generate(model, tok, reqs, kv_cache_dtype="fp8", enable_prefix_caching=True)
    hits = engine.blocks.num_cache_hits
    second = [r.token_ids for r in engine.generate(reqs)]
    assert engine.blocks.num_cache_hits - hits >= 16 * 8, "the second pass read its prompts from the cache"
    agreement = token_agreement(second, first)
    assert agreement >= 0.95, f"cached fp8 prefixes vs fresh: {agreement:.3f}"


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if not at.HAVE_TRITON:
        sys.exit("triton is not installed")
    from tests.worker.engine.test_attention_triton import _patch_triton_interpreter

    _patch_triton_interpreter()
    exact_interpreter_fp8()
    found = check_fp8_kv("cpu")
    print(f"fp8 kv checks passed: {len(found)} attention checks, max relative error {max(found):.3g}")
