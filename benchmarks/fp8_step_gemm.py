"""FP8 weight GEMMs of a small decode step on the H200: the FP8 small-step kernel against what runs today.

    python3 benchmarks/fp8_step_gemm.py [--m 32] [--sweep]
    python3 benchmarks/fp8_step_gemm.py --chain [--m 32]

Per Llama-3-8B projection (QKV, O, gate/up, down) at M tokens, us per GEMM replayed from a CUDA graph over 32
distinct weights (skinny_gemm.graph_time_us), and the weight bytes per second:
  fp8-pair       kernels.fp8_linear: the per-token quantization kernel, then cuBLASLt _scaled_mm (decode_gemm
                 "cublas"/"auto" on an FP8 model today)
  fp8-step       quant/small_step.py's kernel, x quantized inside it (no PDL); `fp8-step+pdl` with PDL, which in a
                 chain of independent GEMMs lets each one start while the one before drains
  fp8-quant+step per_token_quant, then the kernel on e4m3 x (small_step X_QUANT "kernel"), both PDL links
  bf16-step      kernels/decode_gemm.py's kernel on the bf16 weight (the bf16 model's small step; down: its cuBLAS
                 fallback, as the decoder runs it)
gate/up also runs the gated variants (act·mul in the epilogue): fp8-gated+pdl, bf16-gated+pdl, and fp8-pair+silu.
QKV also runs the variants with rotary and the KV-cache write (Llama-3-8B's 32 heads, 8 KV heads, head_dim 128, a
bf16 cache): fp8-rope+pdl (the write in the FP8 kernel's epilogue), fp8-step+rope-write+pdl (the GEMM, then
qkv_rope_write), bf16-rope+pdl (decode_gemm's fused kernel).
--sweep times the FP8 kernel in each of FP8_CONFIGS; --chain times the decoder layer's GEMM chain (attention left
out) over 32 layers from one graph: bf16 small step, FP8 pair (today's FP8 path), FP8 small step (x quantized in
the GEMM, and by per_token_quant first).

H200, 2026-12-01 (benchmarks/h200/2026-12-01e): the in-GEMM quantization's kernel lost to the pair on every
projection but gate/up; the x_quant "kernel" variant came after it and is not measured yet.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from skinny_gemm import LAYERS, SHAPES, graph_time_us  # noqa: E402 (benchmarks/ is the script's directory)

from worker.engine.kernels import decode_gemm as dg  # noqa: E402
from worker.engine.kernels import fused as fk  # noqa: E402
from worker.engine.quant import (  # noqa: E402
    ActivationScale,
    Fp8Linear,
    Fp8Scheme,
    WeightScale,
    small_step,
)
from worker.engine.quant import kernels as fp8k  # noqa: E402
from worker.engine.quant.fp8 import fp8_linear_emulated, quantize_weight_per_channel  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, num_stages) for --sweep: small_step.STEP_CONFIG and its neighbours
FP8_CONFIGS: list[dg.Config] = [
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (32, 256, 4, 4),
    (32, 512, 4, 3),
    (128, 128, 4, 3),
    (128, 128, 8, 4),
]
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the lm_head stays bf16 in FP8 models
TOKEN = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)  # --quantization fp8


def rope_args(m: int) -> tuple:
    """(positions, cos, sin, heads, kv heads, k cache, v cache, slots) of Llama-3-8B's QKV for m tokens."""
    heads, kv_heads, head_dim, blocks, block_size = 32, 8, 128, 64, 16
    angles = torch.rand(4096, head_dim // 2, device="cuda").repeat(1, 2) * 6.3
    positions = torch.randint(0, 4096, (m,), dtype=torch.int32, device="cuda")
    slots = torch.randperm(blocks * block_size, device="cuda")[:m].to(torch.int32)
    k_cache, v_cache = (
        torch.zeros(blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    return positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots


def fp8_layers(n: int, k: int, count: int) -> list[Fp8Linear]:
    return [Fp8Linear(*quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02), TOKEN) for _ in range(count)]


def check(got: torch.Tensor, layer: Fp8Linear, x: torch.Tensor, what: str) -> None:
    """Every timed variant first computes the product (the bench would time a wrong kernel otherwise)."""
    want = fp8_linear_emulated(x, layer).float()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, f"{what}: {err}"


def bench_projection(name: str, m: int, sweep: bool) -> None:
    n, k = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    times = {**time_fp8(name, x, sweep), **time_bf16(name, x)}  # one set of 32 weights in memory at a time
    for label, us in times.items():
        weight_bytes = n * k * (2 if label.startswith("bf16") else 1)
        print(f"M={m:3d} {name:8s} {label:36s} {us:7.1f} us  {weight_bytes / us / 1e6:5.2f} TB/s", flush=True)


def time_fp8(name: str, x: torch.Tensor, sweep: bool) -> dict[str, float]:
    n, k = SHAPES[name]
    layers = fp8_layers(n, k, LAYERS)
    times: dict[str, float] = {}
    check(fp8k.fp8_linear(x, layers[0]), layers[0], x, f"{name} fp8-pair")
    times["fp8-pair"] = graph_time_us(lambda: [fp8k.fp8_linear(x, w) for w in layers], LAYERS)
    for config in FP8_CONFIGS if sweep else [small_step.STEP_CONFIG]:
        if small_step.step_config(layers[0], config=config) is None:
            print(f"    {name} {config}: does not tile [{n}, {k}]")
            continue
        check(small_step.fp8_step_linear(x, layers[0], config=config), layers[0], x, f"{name} fp8-step {config}")
        for pdl in (False, True):
            label = f"fp8-step{'+pdl' if pdl else ''}" + (f" {config}" if sweep else "")
            times[label] = graph_time_us(
                lambda c=config, p=pdl: [small_step.fp8_step_linear(x, w, pdl=p, config=c) for w in layers], LAYERS
            )
        for split in split_choices(name, k, config):  # x_quant "kernel": per_token_quant first
            label = f"fp8-quant+step+pdl split={split}" + (f" {config}" if sweep else "")
            times[label] = graph_time_us(
                lambda c=config, s=split: [
                    small_step.fp8_step_linear(x, w, pdl=True, config=c, x_quant="kernel", split_k=s) for w in layers
                ],
                LAYERS,
            )
    if name == "gate_up":
        times["fp8-gated+pdl"] = graph_time_us(
            lambda: [small_step.fp8_step_gate_up_act(x, w, pdl=True) for w in layers], LAYERS
        )
        times["fp8-pair+silu"] = graph_time_us(lambda: [fk.silu_mul(fp8k.fp8_linear(x, w)) for w in layers], LAYERS)
    if name == "qkv":
        rope = rope_args(x.shape[0])
        assert small_step.rope_step_config(layers[0], *rope[3:5], rope[1].shape[-1]) is not None
        for split in split_choices(name, k, small_step.STEP_CONFIG):
            check_rope_split(x, layers[0], rope, split)
            times[f"fp8-rope+pdl split={split}"] = graph_time_us(
                lambda s=split: [small_step.fp8_step_qkv_rope_write(x, w, None, *rope, pdl=True, split_k=s) for w in layers],
                LAYERS,
            )
        times["fp8-step+rope-write+pdl"] = graph_time_us(
            lambda: [
                fk.qkv_rope_write(small_step.fp8_step_linear(x, w, pdl=True), *rope[:3], None, None, 0.0, *rope[3:], pdl=True)
                for w in layers
            ],
            LAYERS,
        )
    return times


def split_choices(name: str, k: int, config: dg.Config) -> list[int]:
    """Split-K choices to time: 1, 2, 4 (those dividing K's tiles); gate/up's gated kernel is never split."""
    return [s for s in (1, 2, 4) if (k // config[1]) % s == 0 and (s == 1 or name != "gate_up")]


def check_rope_split(x: torch.Tensor, layer: Fp8Linear, rope: tuple, split: int) -> None:
    """The fused QKV with K split gives q as the split GEMM then qkv_rope_write (its timing would mislead otherwise)."""
    got = small_step.fp8_step_qkv_rope_write(x, layer, None, *rope, pdl=True, split_k=split)
    qkv = small_step.fp8_step_linear(x, layer, pdl=True, split_k=split)
    check(qkv, layer, x, f"qkv split={split}")
    want = fk.qkv_rope_write(qkv, *rope[:3], None, None, 0.0, *rope[3:], pdl=True)
    assert torch.equal(got, want), f"qkv rope split={split}"


def time_bf16(name: str, x: torch.Tensor) -> dict[str, float]:
    weights = [torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    times = {"bf16-step+pdl": graph_time_us(lambda: [dg.decode_linear(x, w, pdl=True) for w in weights], LAYERS)}
    if name == "gate_up":
        times["bf16-gated+pdl"] = graph_time_us(
            lambda: [dg.decode_gate_up_silu(x, w, pdl=True) for w in weights], LAYERS
        )
    if name == "qkv":
        rope = rope_args(x.shape[0])
        times["bf16-rope+pdl"] = graph_time_us(
            lambda: [dg.decode_qkv_rope_write(x, w, None, *rope, pdl=True) for w in weights], LAYERS
        )
    return times


def chain_bench(m: int) -> None:
    """us per decoder layer: add_rmsnorm, QKV, O (on the normed input), add_rmsnorm, gate/up + SiLU·mul, down."""
    fp8_bytes = sum(SHAPES[name][0] * SHAPES[name][1] for name in PROJECTIONS)
    x0 = torch.randn(m, SHAPES["o"][0], device="cuda", dtype=torch.bfloat16)
    for label, us in (*chain_fp8(x0), chain_bf16(x0)):
        weight_bytes = fp8_bytes * (2 if label.startswith("bf16") else 1)
        print(f"M={m:3d} {label:32s} {us:7.1f} us/layer  {weight_bytes / us / 1e6:5.2f} TB/s of weights", flush=True)


def run_chain(x0: torch.Tensor, layers: list[dict], linear, gate_up_act, pdl: bool, add_norm=fk.add_rmsnorm) -> None:
    norm_w = torch.ones(x0.shape[1], device=x0.device, dtype=x0.dtype)
    hidden_x, residual = x0, x0.clone()
    for w in layers:
        normed, residual = add_norm(hidden_x, residual, norm_w, 1e-5, pdl=pdl)
        linear(normed, w["qkv"])  # attention, left out, would read its output
        hidden_x = linear(normed, w["o"])
        normed, residual = add_norm(hidden_x, residual, norm_w, 1e-5, pdl=pdl)
        hidden_x = linear(gate_up_act(normed, w["gate_up"]), w["down"])


def chain_fp8(x0: torch.Tensor) -> list[tuple[str, float]]:
    layers = [{name: fp8_layers(*SHAPES[name], 1)[0] for name in PROJECTIONS} for _ in range(LAYERS)]
    variants = [
        ("fp8 pair (today)", fp8k.fp8_linear, lambda x, w: fk.silu_mul(fp8k.fp8_linear(x, w)), False),
        (
            "fp8 small step + pdl",
            lambda x, w: small_step.fp8_step_linear(x, w, pdl=True),
            lambda x, w: small_step.fp8_step_gate_up_act(x, w, pdl=True),
            True,
        ),
        (
            "fp8 quant + small step + pdl",
            lambda x, w: small_step.fp8_step_linear(x, w, pdl=True, x_quant="kernel"),
            lambda x, w: small_step.fp8_step_gate_up_act(x, w, pdl=True, x_quant="kernel"),
            True,
        ),
    ]
    times = [
        (label, graph_time_us(lambda li=linear, g=gate_up_act, p=pdl: run_chain(x0, layers, li, g, p), LAYERS))
        for label, linear, gate_up_act, pdl in variants
    ]
    # the decoder's small step: the norms quantize their rows (fp8_add_rmsnorm), down's input by per_token_quant;
    # K split by small_step's rule (split None) and not at all (1)
    for split, label in ((1, "no split-K"), (None, "split-K")):
        times.append((
            f"fp8 norm-quantized + small step + pdl, {label}",
            graph_time_us(
                lambda s=split: run_chain(
                    x0, layers, lambda x, w: small_step.fp8_step_linear(x, w, pdl=True, x_quant="kernel", split_k=s),
                    lambda x, w: small_step.fp8_step_gate_up_act(x, w, pdl=True), True, small_step.fp8_add_rmsnorm,
                ),
                LAYERS,
            ),
        ))  # fmt: skip
    return times


def chain_bf16(x0: torch.Tensor) -> tuple[str, float]:
    """The bf16 model's small step as the decoder runs it (down on cuBLAS: decode_gemm.MAX_K)."""
    layers = [
        {name: torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) * 0.02 for name in PROJECTIONS}
        for _ in range(LAYERS)
    ]
    linear = partial(dg.decode_linear, pdl=True)
    gate_up_act = partial(dg.decode_gate_up_silu, pdl=True)
    return "bf16 small step + pdl", graph_time_us(lambda: run_chain(x0, layers, linear, gate_up_act, True), LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, action="append", help="token counts (default 32)")
    parser.add_argument("--sweep", action="store_true", help="time the FP8 kernel in every FP8_CONFIGS entry")
    parser.add_argument("--chain", action="store_true", help="time the decoder layer's GEMM chain instead")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; us per GEMM (weight TB/s)")
    for m in args.m or [32]:
        assert m <= dg.MAX_TOKENS, f"the small-step path runs steps of at most {dg.MAX_TOKENS} tokens"
        if args.chain:
            chain_bench(m)
            continue
        for name in PROJECTIONS:
            bench_projection(name, m, args.sweep)


if __name__ == "__main__":
    main()
