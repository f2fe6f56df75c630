"""The FP8 small-step GEMM (worker/engine/quant/small_step.py) and the decoder's opt-in to it.

On the CPU the kernel runs through Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton
is imported), with its fp8 cast fixed (test_quant_kernels.exact_interpreter_fp8_casts) and its fp8 tl.dot summed in
float64 (`exact_interpreter_fp8_dots`). A K tile's e4m3 products then sum exactly (their exponents span < 53 bits),
so the kernel has one rounding per K tile and the torch twin `step_gemm_twin` (fp8.py's quantization, the same
per-tile fp32 accumulation, x_scale then w_scale, the bias) must equal it bit for bit: that checks the in-kernel
quantization against fp8.py's to the bit. Against fp8_linear_emulated (dequantized operands, one fp64 sum) the
kernel agrees to fp32 summation order. The FP8 QKV kernel with rotary + KV write in its epilogue equals the FP8
GEMM then fused.qkv_rope_write bit for bit. The `gpu` tests run the same checks on CUDA (the H200) with tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.engine.test_fused_kernels import _interpret, _llama_head_dim_64, mixed_step_three_ways
from tests.worker.engine.test_quant_kernels import _layers
from worker.engine.kernels import fused as fk
from worker.engine.quant.config import ActivationScale, Fp8Scheme, OnlineFp8Config, WeightScale
from worker.engine.quant.fp8 import (
    Fp8Linear,
    fp8_linear_emulated,
    quantize_input,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)

STEP_SCHEMES = ("channel-token", "channel-token-ub", "tensor-static", "channel-static", "tensor-token")

CHECK = r"""
from tests.worker.engine.test_quant_kernels import exact_interpreter_fp8_casts
from tests.worker.engine.test_quant_small_step import check_step_kernel, exact_interpreter_fp8_dots, typed_launches

exact_interpreter_fp8_casts()
exact_interpreter_fp8_dots()
typed_launches()
check_step_kernel("cpu")
print("fp8 step kernel matches")
"""

ROPE_CHECK = r"""
from tests.worker.engine.test_quant_kernels import exact_interpreter_fp8_casts
from tests.worker.engine.test_quant_small_step import check_qkv_rope_kernel, exact_interpreter_fp8_dots, typed_launches

exact_interpreter_fp8_casts()
exact_interpreter_fp8_dots()
typed_launches()
check_qkv_rope_kernel("cpu")
print("fp8 qkv rope kernel matches")
"""

DECODER_CHECK = r"""
from tests.worker.engine.test_quant_kernels import exact_interpreter_fp8_casts
from tests.worker.engine.test_quant_small_step import check_decoder_opt_in, exact_interpreter_fp8_dots

exact_interpreter_fp8_casts()
exact_interpreter_fp8_dots()
check_decoder_opt_in("cpu")
print("fp8 step decoder matches")
"""


def exact_interpreter_fp8_dots() -> None:
    """Make the interpreter's fp8 tl.dot sum each tile in float64, then round to fp32 once (this process only).
    Its own dot widens e4m3 to fp16 (exact) and runs numpy's sgemm, whose summation order is the host BLAS's."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *rest):
        if not (a.dtype == tl.float8e4nv and b.dtype == tl.float8e4nv and d.data.dtype == np.float32):
            return original(self, a, b, d, *rest)

        def wide(t):
            return interp._convert_float(t.data, t.dtype, tl.float16, None).view(np.float16).astype(np.float64)

        product = np.matmul(wide(a), wide(b)).astype(np.float32)
        return interp.TensorHandle(product + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot


def typed_launches() -> None:
    """Make small_step's kernel launches refuse an argument that is not a tensor, a number, a bool or a dtype
    (this process only). The interpreter reads an unread pointer argument never, so it ran a launch passing an
    Fp8Rows as the bias placeholder; CUDA's launcher specializes every argument and failed it (the H200 run of
    2026-12-01)."""
    from worker.engine.quant import small_step

    class Checked:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for name, value in [*enumerate(args), *kwargs.items()]:
                    assert value is None or isinstance(value, (torch.Tensor, int, float, bool, torch.dtype)), (
                        f"launch argument {name} is a {type(value).__name__}"
                    )
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in ("_fp8_step_gemm_kernel", "_fp8_qkv_rope_kernel"):
        setattr(small_step, name, Checked(getattr(small_step, name)))


def step_gemm_twin(
    x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None, block_k: int, split: int = 1
) -> torch.Tensor:
    """The kernel's arithmetic in torch: fp8.py's quantized x, each K tile's products summed exactly and added to an
    fp32 accumulator (one per split of K, the splits then added in order: kernels/split_k.py), times x_scale, times
    w_scale, plus the bias, rounded to x's dtype."""
    m, k = x.shape
    x_fp8, x_scale = quantize_input(x, layer)
    w = layer.weight.double()
    acc = torch.zeros(m, layer.out_features, dtype=torch.float32, device=x.device)
    for first in range(0, k, k // split):
        partial = torch.zeros_like(acc)
        for start in range(first, first + k // split, block_k):
            tile = slice(start, start + block_k)
            partial = partial + (x_fp8[:, tile].double() @ w[:, tile].t()).float()
        acc = acc + partial
    out = acc * x_scale.expand(m)[:, None] * layer.weight_scale.expand(layer.out_features)[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def other_x_quant() -> str:
    """The x quantization the path does not take by default (small_step.X_QUANT): checked for the same bits."""
    from worker.engine.quant import small_step

    return "gemm" if small_step.X_QUANT == "kernel" else "kernel"


def _rel_to_scale(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().amax().clamp(min=1)
    return ((got.float() - want.float()).abs() / scale).max().item()


def check_step_kernel(device: str) -> None:
    """fp8_step_linear against its twin (the interpreter: bit for bit) and the emulation, every scheme the kernel
    runs, M in {1, 5, 32}, with and without bias; the gated variant against the unfused pair (bit for bit);
    shapes and schemes the kernel refuses against kernels.fp8_linear. x quantized by per_token_quant first
    (x_quant "kernel") gives the same bits as inside the GEMM."""
    from worker.engine.quant import small_step

    exact = device == "cpu"
    # fp16 stands in for bf16 in the interpreter, whose fp32 -> bf16 store is not round-to-nearest-even
    dtypes = (torch.float32, torch.float16) if exact else (torch.bfloat16, torch.float32)
    for n, k in ((128, 256), (192, 384)):
        layers = _layers(n, k, device)
        for name in STEP_SCHEMES:
            layer = layers[name]
            config = small_step.step_config(layer)
            assert config is not None, name
            block_k = config[1]  # 256 where K is a multiple of it (K = 256 here), else 128 (K = 384)
            for m in (1, 5, 32):
                for dtype in dtypes:
                    torch.manual_seed(m)
                    x = (torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]).to(device, dtype)
                    x[0, :5] = 0.0
                    for bias in (None, torch.randn(n).to(device, dtype)):
                        what = f"{name} m={m} n={n} k={k} {dtype} bias={bias is not None}"
                        got = small_step.fp8_step_linear(x, layer, bias, pdl=not exact)
                        assert got.shape == (m, n) and got.dtype == dtype, what
                        # x quantized by per_token_quant first or inside the GEMM: the same e4m3 x and scales
                        other = small_step.fp8_step_linear(x, layer, bias, pdl=not exact, x_quant=other_x_quant())
                        assert torch.equal(got, other), f"{what}: x_quant {other_x_quant()}"
                        twin = step_gemm_twin(x, layer, bias, block_k)
                        if exact:
                            assert torch.equal(got, twin), f"{what}: {(got.float() - twin.float()).abs().max()}"
                        want = fp8_linear_emulated(x, layer, bias)
                        # the GPU's fp32 division may tip an e4m3 rounding of x: one step of one element
                        tol = 2e-5 if dtype == torch.float32 else (2**-10 if dtype == torch.float16 else 2**-7)
                        err = _rel_to_scale(got, want)
                        assert err <= (tol if exact else 2**-7), f"{what}: {err}"
        _check_gated(layers, device, dtypes)
    _check_split_k(device, dtypes)
    _check_fp8_add_rmsnorm(device, dtypes)
    _check_fallbacks(device)


def _check_split_k(device: str, dtypes) -> None:
    """K split over 2 and 4 programs (kernels/split_k.py): the twin summing each split's K tiles apart and then the
    partials in split order (the interpreter: bit for bit), the emulation's tolerance, the same bits on a second
    launch (whichever program of a tile came last), and every tile counter back at 0."""
    from worker.engine.kernels import split_k
    from worker.engine.quant import small_step

    exact = device == "cpu"
    n, k = 128, 4 * small_step.STEP_CONFIG[1]
    layers = _layers(n, k, device)
    for name in ("channel-token", "tensor-static", "channel-token-ub"):
        layer = layers[name]
        for split in (2, 4):
            for m in (1, 5, 32):
                dtype = dtypes[m % 2]
                x = (torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]).to(device, dtype)
                bias = torch.randn(n).to(device, dtype) if m == 5 else None
                what = f"{name} split={split} m={m} {dtype}"
                got = small_step.fp8_step_linear(x, layer, bias, pdl=not exact, split_k=split)
                assert torch.equal(got, small_step.fp8_step_linear(x, layer, bias, pdl=not exact, split_k=split)), what
                if exact:
                    twin = step_gemm_twin(x, layer, bias, small_step.STEP_CONFIG[1], split)
                    assert torch.equal(got, twin), f"{what}: {(got.float() - twin.float()).abs().max()}"
                tol = 2e-5 if dtype == torch.float32 else (2**-10 if dtype == torch.float16 else 2**-7)
                err = _rel_to_scale(got, fp8_linear_emulated(x, layer, bias))
                assert err <= (tol if exact else 2**-7), f"{what}: {err}"
    assert not split_k.tile_counters(torch.device(device)).any(), "a tile counter was left above 0"


def _check_fp8_add_rmsnorm(device: str, dtypes) -> None:
    """fp8_add_rmsnorm (the norm quantizing its own rows) gives the bits of add_rmsnorm then per_token_quant, with
    and without the residual, the post-norm and scale, the fp32-weight norm, fbgemm's cap; and the GEMM fed its
    Fp8Rows gives the bits of the GEMM fed the unquantized rows (plain, gated, and the QKV with rotary)."""
    from worker.engine.quant import kernels, small_step

    pdl = device != "cpu"
    hidden = 384  # not a power of two: the norm's block is masked
    layers = _layers(256, hidden, device)
    for dtype in dtypes:
        for m in (1, 5, 32):
            gen = torch.Generator().manual_seed(m)
            x, res = (torch.randn(m, hidden, generator=gen).to(device, dtype) for _ in range(2))
            w, xw = (torch.rand(hidden, generator=gen).to(device, dtype) + 0.5 for _ in range(2))
            cases = [
                dict(residual=res), dict(residual=None), dict(residual=res, x_weight=xw, x_scale=0.7),
                dict(residual=res, weight_fp32=True), dict(residual=res, scale_ub=1.5),
            ]  # fmt: skip
            for case in cases:
                scale_ub = case.pop("scale_ub", None)
                residual = case.pop("residual")
                want_res = None if residual is None else residual.clone()
                normed, want_total = fk.add_rmsnorm(x, want_res, w, 1e-5, pdl=pdl, **case)
                want_x, want_scale = kernels.per_token_quant(normed, scale_ub)
                got_res = None if residual is None else residual.clone()
                rows, got_total = small_step.fp8_add_rmsnorm(
                    x, got_res, w, 1e-5, scale_ub=scale_ub, pdl=pdl, **case
                )
                what = (dtype, m, sorted(case), scale_ub)
                assert rows.dtype == dtype and torch.equal(rows.scale, want_scale), what
                assert torch.equal(rows.x.view(torch.uint8), want_x.view(torch.uint8)), what
                assert torch.equal(got_total, want_total), what
                if case or scale_ub is not None:
                    continue
                layer = layers["channel-token"]
                got = small_step.fp8_step_linear(rows, layer, pdl=pdl)
                assert torch.equal(got, small_step.fp8_step_linear(normed, layer, pdl=pdl)), what
                got = small_step.fp8_step_gate_up_act(rows, layer, pdl=pdl)
                assert torch.equal(got, small_step.fp8_step_gate_up_act(normed, layer, pdl=pdl)), what


def _check_gated(layers: dict[str, Fp8Linear], device: str, dtypes) -> None:
    from worker.engine.quant import small_step

    for name in ("channel-token", "tensor-static"):
        layer = layers[name]  # n rows: [gate; up] with I = n / 2
        inter = layer.out_features // 2
        if small_step.step_config(layer, gated=True) is None:
            continue
        for act in (fk.ACT_SILU, fk.ACT_GELU_TANH):
            for m in (1, 5, 32):
                for dtype in dtypes:
                    x = torch.randn(m, layer.in_features).to(device, dtype)
                    bias = torch.randn(2 * inter).to(device, dtype) if m == 5 else None
                    pdl = device != "cpu"
                    got = small_step.fp8_step_gate_up_act(x, layer, bias, pdl=pdl, act=act)
                    prequantized = small_step.fp8_step_gate_up_act(x, layer, bias, pdl=pdl, act=act, x_quant=other_x_quant())
                    assert torch.equal(got, prequantized), (name, act, m, dtype, "x_quant", other_x_quant())
                    # the same K tiles as the gated kernel (which never splits K): the same sums
                    unfused = small_step.fp8_step_linear(
                        x, layer, bias, pdl=pdl, config=small_step.GATED_STEP_CONFIG, split_k=1
                    )
                    pair = fk.act_mul(unfused, pdl=pdl, act=act)
                    assert got.shape == (m, inter) and torch.equal(got, pair), (name, act, m, dtype)


def _check_fallbacks(device: str) -> None:
    """Where `step_config` says None (N = 112: a multiple of 16, as cuBLASLt wants, not of BLOCK_N; block-wise
    scales) the result is kernels.fp8_linear's (the emulation off CUDA)."""
    from worker.engine.quant import kernels, small_step

    torch.manual_seed(3)
    untiled = Fp8Linear(
        *quantize_weight_per_channel(torch.randn(112, 256)), Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
    ).to(device)
    block = _layers(128, 256, device)["block"]
    for layer, what in ((untiled, "N=112"), (block, "block-wise")):
        assert small_step.step_config(layer) is None, what
        x = torch.randn(5, 256, device=device)
        assert torch.equal(small_step.fp8_step_linear(x, layer), kernels.fp8_linear(x, layer)), what
        want = fk.act_mul(kernels.fp8_linear(x, layer))
        assert torch.equal(small_step.fp8_step_gate_up_act(x, layer), want), what


def _qkv_layers(num_heads: int, num_kv: int, head_dim: int, k: int, device: str) -> dict[str, Fp8Linear]:
    """Fused QKV weights [(H + 2 KVH) D, K], one per scheme: per-channel scales that differ row by row (so rows j
    and j + D/2 of a head do not share one), one per-tensor scale with static activations, and q/k/v quantized per
    tensor with different scales, stacked as fuse_fp8 stacks them (per-channel after Fp8Linear.concat)."""
    torch.manual_seed(2)
    n = (num_heads + 2 * num_kv) * head_dim
    layers = {name: _layers(n, k, device)[name] for name in ("channel-token", "tensor-static", "channel-token-ub")}
    token = Fp8Scheme(WeightScale.TENSOR, ActivationScale.TOKEN)
    parts = [
        Fp8Linear(*quantize_weight_per_tensor(torch.randn(rows, k) * spread), token)
        for rows, spread in ((num_heads * head_dim, 0.1), (num_kv * head_dim, 1.0), (num_kv * head_dim, 3.0))
    ]
    fused = Fp8Linear.concat(parts).to(device)
    assert fused.scheme.weight is WeightScale.CHANNEL
    return {**layers, "q/k/v per tensor, fused": fused}


def check_qkv_rope_kernel(device: str) -> None:
    """fp8_step_qkv_rope_write (the FP8 QKV GEMM with rotary and the KV write in its epilogue) gives q, the K cache
    and the V cache bit for bit as fp8_step_linear then fused.qkv_rope_write do: head_dim 64 and 128, every scheme
    of `_qkv_layers`, with and without bias, M in {1, 5, 32} (at 5 with a model-dtype cache, K split over two
    programs on both sides), a model-dtype cache and an e4m3 cache with scales;
    a padding row (slot 0) writes scratch block 0 as the two launches do. head_dim 32 (no whole group of pairs)
    takes the two launches. The same tiles and K order on either side, so the GPU must agree bit for bit too."""
    from worker.engine.quant import small_step

    exact = device == "cpu"
    pdl = not exact
    dtype = torch.float16 if exact else torch.bfloat16  # fp16 stands in for bf16 in the interpreter
    num_heads, num_kv, block_size, num_blocks, k = 4, 2, 4, 12, 2 * small_step.STEP_CONFIG[1]
    for head_dim in (64, 128, 32):
        n = (num_heads + 2 * num_kv) * head_dim
        angles = torch.rand(40, head_dim // 2).repeat(1, 2) * 6.3
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        for name, layer in _qkv_layers(num_heads, num_kv, head_dim, k, device).items():
            fused = small_step.rope_step_config(layer, num_heads, num_kv, head_dim) is not None
            assert fused == (head_dim != 32), (name, head_dim)
            for m in (1, 5, 32):
                bias = torch.randn(n).to(device, dtype) if m != 1 or name == "tensor-static" else None
                for cache_dtype, kv_scale in ((dtype, (1.0, 1.0)), (torch.float8_e4m3fn, (0.05, 0.37))):
                    x = (torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]).to(device, dtype)
                    positions = torch.randint(0, 40, (m,), dtype=torch.int32, device=device)
                    slots = torch.randperm(num_blocks * block_size - block_size)[:m].to(device, torch.int32)
                    slots += block_size
                    if m > 1:
                        slots[-1] = 0  # a padding row
                    shape = (num_blocks, block_size, num_kv, head_dim)
                    caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(4)]
                    rope = (positions, cos, sin, num_heads, num_kv)
                    split = 2 if m == 5 and cache_dtype == dtype else None  # K split over 2 programs on both sides
                    got_q = small_step.fp8_step_qkv_rope_write(
                        x, layer, bias, *rope, caches[0], caches[1], slots, pdl=pdl, kv_scale=kv_scale, split_k=split
                    )
                    qkv = small_step.fp8_step_linear(x, layer, bias, pdl=pdl, split_k=split)
                    want_q = fk.qkv_rope_write(
                        qkv, positions, cos, sin, None, None, 0.0, num_heads, num_kv, caches[2], caches[3], slots,
                        pdl=pdl, kv_scale=kv_scale,
                    )  # fmt: skip
                    what = (name, head_dim, m, bias is not None, cache_dtype)
                    assert got_q.shape == (m, num_heads, head_dim) and torch.equal(got_q, want_q), what
                    bits = [c.view(torch.uint8) for c in caches]  # e4m3 has no torch.equal on every build
                    assert torch.equal(bits[0], bits[2]) and torch.equal(bits[1], bits[3]), what
                    # x quantized by per_token_quant first: the same q and caches
                    pre_caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
                    pre_q = small_step.fp8_step_qkv_rope_write(
                        x, layer, bias, *rope, *pre_caches, slots, pdl=pdl, kv_scale=kv_scale, x_quant=other_x_quant(),
                        split_k=split,
                    )
                    assert torch.equal(pre_q, got_q), (*what, "x_quant", other_x_quant())
                    for cache, want in zip(pre_caches, bits[:2], strict=True):
                        assert torch.equal(cache.view(torch.uint8), want), (*what, "x_quant", other_x_quant())
                    assert bits[0][1:].any() and bits[1][1:].any(), what  # it wrote something
                    if m > 1:
                        assert bits[0][0].any(), what  # the padding row's scratch slot, as the two launches


def _fp8_llama(dev: torch.device):
    """The head_dim-64 Llama (every GEMM tiles by the step kernel's blocks) with --quantization fp8, kept FP8."""
    from worker.engine.quant.linear import quantize_linears

    model = _llama_head_dim_64(dev)
    quantize_linears(model, OnlineFp8Config(), keep_fp8=True)
    return model


class _CountedKernel:
    """A Triton kernel whose launches (`kernel[grid](...)`) are appended to `log` by name."""

    def __init__(self, kernel, name: str, log: list[str]):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def check_decoder_opt_in(device: str) -> None:
    """One mixed step (7 rows, a small step) of a tiny FP8 model: the small-step path, whose FP8 GEMMs are
    quant/small_step.py's (the gated one and the QKV one with rotary + KV write included), gives the logits of the
    path without it (FP8 GEMMs through kernels.fp8_linear, made the emulation on CUDA too: cuBLASLt's row-wise
    output is bf16): to fp32 summation order in the interpreter, on CUDA far nearer each other than FP8 is to the
    dense model (see the bound). With the fused FP8 QKV turned off (`rope_step_config` None: the GEMM, then
    fused.qkv_rope_write) the small-step path gives the same logits bit for bit, with one launch more per layer."""
    from worker.engine.kernels import fused
    from worker.engine.quant import kernels, small_step

    dev = torch.device(device)
    model = _fp8_llama(dev)
    layers = model.config.num_hidden_layers

    def run(fused_qkv: bool) -> tuple[list[torch.Tensor], list[str]]:
        launches: list[str] = []
        originals = (
            small_step._launch, kernels.fp8_linear, small_step._fp8_qkv_rope_kernel, fused._qkv_rope_write_kernel,
            small_step.rope_step_config,
        )  # fmt: skip

        def counting_launch(*args, **kwargs):
            launches.append("gated" if kwargs["gated"] else "plain")
            return originals[0](*args, **kwargs)

        small_step._launch = counting_launch
        kernels.fp8_linear = lambda x, layer, bias=None, backend="auto": originals[1](x, layer, bias, "emulated")
        small_step._fp8_qkv_rope_kernel = _CountedKernel(originals[2], "qkv rope", launches)
        fused._qkv_rope_write_kernel = _CountedKernel(originals[3], "rope write", launches)
        if not fused_qkv:
            small_step.rope_step_config = lambda *args, **kwargs: None
        try:
            return mixed_step_three_ways(model, dev), launches
        finally:
            (
                small_step._launch, kernels.fp8_linear, small_step._fp8_qkv_rope_kernel, fused._qkv_rope_write_kernel,
                small_step.rope_step_config,
            ) = originals  # fmt: skip

    (torch_path, elementwise, step), launches = run(fused_qkv=True)
    # per layer on the small-step path: the QKV GEMM with rotary + KV write, O and down plain, gate/up gated; the
    # element-wise path's qkv_rope_write (the torch path launches none)
    want = {"qkv rope": layers, "plain": 2 * layers, "gated": layers, "rope write": layers}
    assert {name: launches.count(name) for name in want} == want, launches
    def off(out: torch.Tensor, ref: torch.Tensor) -> float:
        return ((out - ref).abs().max() / ref.abs().max()).item()

    # On the CPU (the interpreter, exact casts and dots) the paths differ by fp32 summation order. On CUDA a last
    # fp32 bit (a norm's sum order, the tensor cores' FP8 accumulation) can tip an e4m3 rounding of some
    # activation, one e4m3 step is 6-12% of the value, and this random model (init range 0.25) carries it to the
    # logits: the H200 found the paths 0.027-0.033 apart, while FP8 itself puts this model 0.139 off its dense
    # twin. So on CUDA the paths must be much nearer each other than FP8 is to the dense model.
    bound = 1e-4 if device == "cpu" else 0.4 * off(torch_path, mixed_step_three_ways(_llama_head_dim_64(dev), dev)[0])
    for variant, out in (("triton element-wise", elementwise), ("fp8 small step", step)):
        assert off(out, torch_path) < bound, (variant, off(out, torch_path), bound)
    # the norms feeding FP8 linears quantize their rows themselves (LayerOps.add_norm_fp8); without that the
    # GEMMs quantize them: the same bits
    from worker.engine import decoder as decoder_mod

    rows_for = decoder_mod.rows_for
    decoder_mod.rows_for = lambda *args, **kwargs: None
    try:
        (_, _, gemm_quantized), _ = run(fused_qkv=True)
    finally:
        decoder_mod.rows_for = rows_for
    assert torch.equal(step, gemm_quantized), (step - gemm_quantized).abs().max()
    (_, _, unfused_step), launches = run(fused_qkv=False)
    # one launch more per layer: the QKV GEMM plain, then qkv_rope_write
    want = {"qkv rope": 0, "plain": 3 * layers, "gated": layers, "rope write": 2 * layers}
    assert {name: launches.count(name) for name in want} == want, launches
    assert torch.equal(step, unfused_step), (step - unfused_step).abs().max()


needs_triton = pytest.mark.skipif(not fk.HAVE_TRITON, reason="triton is not installed")
# FP8 tensor cores (sm89+) and programmatic dependent launch (sm90+): the H200
needs_sm90 = pytest.mark.skipif(
    not (fk.HAVE_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs an sm90+ GPU and triton",
)


@needs_triton
def test_fp8_step_kernel_matches_its_twin_and_the_emulation_in_the_interpreter():
    _interpret(CHECK, "fp8 step kernel matches")


@needs_triton
def test_fp8_qkv_rope_kernel_equals_the_gemm_then_qkv_rope_write_in_the_interpreter():
    _interpret(ROPE_CHECK, "fp8 qkv rope kernel matches")


@needs_triton
def test_fp8_small_step_decoder_matches_the_fp8_gemm_path_in_the_interpreter():
    _interpret(DECODER_CHECK, "fp8 step decoder matches")


def test_decode_gemm_auto_and_triton_take_fp8_models_onto_the_small_step_and_cublas_keeps_them_off(monkeypatch):
    """build_decoder: FP8 linears take the small-step path with decode_gemm "auto" and "triton" (1.357x W1 of
    the quantization + cuBLASLt pair on the H200), and "cublas" keeps that pair; a bf16 model likewise."""
    from worker.engine import decoder as decoder_mod

    monkeypatch.setattr(decoder_mod.decode_gemm, "usable", lambda device, dtype: True)  # as on an H200
    cpu = torch.device("cpu")
    fp8_model, dense_model = _fp8_llama(cpu), _llama_head_dim_64(cpu)
    for model, gemm, takes_it in (
        (fp8_model, "triton", True), (fp8_model, "auto", True), (fp8_model, "cublas", False),
        (dense_model, "auto", True), (dense_model, "triton", True), (dense_model, "cublas", False),
    ):  # fmt: skip
        decoder = decoder_mod.build_decoder(model, "owned", cpu, 64, use_triton=fk.HAVE_TRITON, gemm=gemm)
        assert decoder is not None
        assert decoder.is_quantized == (model is fp8_model)
        assert (decoder.small_step_ops is not None) == (takes_it and fk.HAVE_TRITON), (gemm, decoder.is_quantized)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_step_kernel_and_decoder():
    """The same checks on CUDA (PDL on): the kernel within the emulation's tolerance, gated == unfused bit for
    bit, the fallbacks; the decoder's mixed step with the FP8 small-step path against the path without it, and
    with the fused FP8 QKV on against off (bit for bit)."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the emulation's fp32 GEMM must not run in TF32
    try:
        check_step_kernel("cuda")
        check_decoder_opt_in("cuda")
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_qkv_rope_kernel_equals_the_gemm_then_qkv_rope_write():
    """The interpreter check on CUDA (PDL on, bf16, an e4m3 cache with scales), then Llama-3-8B's QKV (32 heads, 8
    KV heads, head_dim 128, K = 4096) at M = 32: the fused kernel and the two launches run the same tiles in the
    same K order, so q and both caches agree bit for bit."""
    from worker.engine.quant import small_step

    check_qkv_rope_kernel("cuda")
    torch.manual_seed(0)
    heads, kv_heads, head_dim, k, m = 32, 8, 128, 4096, 32
    w = torch.randn((heads + 2 * kv_heads) * head_dim, k, device="cuda") * 0.02
    layer = Fp8Linear(*quantize_weight_per_channel(w), Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN))
    assert small_step.rope_step_config(layer, heads, kv_heads, head_dim) is not None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(4096, head_dim // 2, device="cuda").repeat(1, 2) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    positions = torch.randint(0, 4096, (m,), dtype=torch.int32, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:m].to(torch.int32)
    caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(4)]
    rope = (positions, cos, sin, heads, kv_heads)
    got = small_step.fp8_step_qkv_rope_write(x, layer, None, *rope, *caches[:2], slots, pdl=True, kv_scale=(0.1, 0.2))
    qkv = small_step.fp8_step_linear(x, layer, pdl=True)
    want = fk.qkv_rope_write(qkv, *rope[:3], None, None, 0.0, heads, kv_heads, *caches[2:], slots, kv_scale=(0.1, 0.2))
    assert torch.equal(got, want)
    bits = [c.view(torch.uint8) for c in caches]
    assert torch.equal(bits[0], bits[2]) and torch.equal(bits[1], bits[3])


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp8_step_kernel_at_the_llama_3_8b_shapes():
    """bf16 outputs within 1% of the output's scale of the emulation (test_quant_kernels' H200 bound) at M = 32
    for each Llama-3-8B projection, the down projection (K = 14,336) included."""
    from worker.engine.quant import small_step

    torch.manual_seed(0)
    token = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda") * 0.02
        layer = Fp8Linear(*quantize_weight_per_channel(w), token)
        x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
        assert small_step.step_config(layer) is not None, (n, k)
        got, want = small_step.fp8_step_linear(x, layer, pdl=True).float(), fp8_linear_emulated(x, layer).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, ((n, k), err)


@pytest.mark.gpu
@needs_sm90
def test_gpu_engine_with_decode_gemm_triton_runs_fp8_small_steps_in_cuda_graphs():
    """small-llama --quantization fp8 with decode_gemm "triton" (CUDA graphs on) against "cublas": the prefill (all
    16 prompts in one step of far more than 32 rows) takes the same GEMMs, so first tokens are equal; the second
    token comes from a small decode step, where the two FP8 GEMMs differ in summation order and the fp32 division's
    last bit: most agree (GPU_TOP1's bound, as the FP8 tests)."""
    from tests.worker.engine.test_quant_decoder import GPU_TOP1, _requests
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    model, tokenizer = load_model("small-llama", torch.device("cuda"), torch.bfloat16, quantization="fp8")
    reqs = _requests(tokenizer, 16, max_new_tokens=8)
    outputs = {}
    for gemm in ("cublas", "triton"):
        engine = Engine(model, tokenizer, EngineConfig(decoder="owned", decode_gemm=gemm, max_num_batched_tokens=2048))
        assert engine.runner.decoder is not None and engine.runner.decoder.is_quantized
        assert (engine.runner.decoder.small_step_ops is not None) == (gemm == "triton")
        outputs[gemm] = [r.token_ids for r in engine.generate(reqs)]
        del engine
    pairs = list(zip(outputs["cublas"], outputs["triton"], strict=True))
    assert all(a[:1] == b[:1] for a, b in pairs), "prefill takes the same FP8 GEMMs either way"
    seconds = sum(a[:2] == b[:2] for a, b in pairs)
    print(f"small-llama fp8: second tokens of decode_gemm triton and cublas agree on {seconds} of 16")
    assert seconds >= math.ceil(GPU_TOP1 * 16), seconds
