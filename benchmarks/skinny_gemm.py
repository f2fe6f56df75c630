"""Decode-shaped weight GEMMs on the H200: cuBLAS (as the owned decoder calls it) vs alternatives.

    python3 benchmarks/skinny_gemm.py [--m 32 --m 64] [--sweep]
    python3 benchmarks/skinny_gemm.py --chain [--m 32]

--chain times the decoder layer's GEMM chain as the owned decoder runs it (add_rmsnorm, QKV, O (on the normed input),
add_rmsnorm, gate/up, SiLU·mul, down; attention left out) over 32 layers from one CUDA graph, three ways:
cuBLAS with the Triton element-wise kernels (decode_gemm "cublas"), decode_gemm.py's Triton GEMMs without
programmatic dependent launch, and with it (down on cuBLAS), and with SiLU·mul in the gate/up GEMM's epilogue
(`gated`: decode_gemm "triton" as the decoder runs it) in a few tile shapes.

For each Llama-3-8B projection (QKV, O, gate/up, down, lm_head) and token count M, times y = x @ W^T
replayed from a CUDA graph over 32 distinct weights (one per layer, so L2 never holds the next one),
and reports microseconds per GEMM and the weight bytes per second (the floor is the copy bandwidth):
  cublas      F.linear(x, W) with W [N, K] (what the decoder runs)
  cublas-kn   x @ W' with W' = W^T made contiguous [K, N] (another cuBLAS layout and kernel family)
  triton      the owned decoder's small-step kernel (worker/engine/kernels/decode_gemm.py): each program owns
              BLOCK_N whole weight rows over all of K (no split-K reduce), computing W_tile @ x^T so the
              weight rows are the MMA's long side (best of CONFIGS with --sweep, else decode_gemm's choice)

Results on the H200: benchmarks/README.md, "Skinny GEMMs" and "Small decode steps". Alone, the Triton
kernel ties cuBLAS; what made it pay in the engine is programmatic dependent launch, which cuBLAS lacks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (BLOCK_N, BLOCK_K, num_warps, num_stages). CONFIGS is the sweep of benchmarks/skinny_gemm.py --sweep.
Config = tuple[int, int, int, int]
CONFIGS: list[Config] = [
    (16, 256, 4, 4),
    (16, 256, 4, 6),
    (16, 512, 4, 3),
    (32, 128, 4, 4),
    (32, 128, 4, 6),
    (32, 256, 4, 3),
    (32, 256, 4, 4),
    (32, 512, 4, 2),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 64, 4, 8),
    (32, 128, 8, 6),
]


def pick_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Config | None:
    """The decoder's configuration for an [m, k] x [n, k]^T product, or None where it uses cuBLAS."""
    from worker.engine.kernels import decode_gemm

    return decode_gemm.config_for(n, k, dtype) if m <= decode_gemm.MAX_TOKENS else None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with the decoder's Triton kernel (decode_gemm.py, without PDL)."""
    from worker.engine.kernels import decode_gemm

    config = config or pick_config(x.shape[0], *weight.shape, x.dtype)
    assert config is not None, f"no skinny-GEMM configuration for M={x.shape[0]} {tuple(weight.shape)} {x.dtype}"
    return decode_gemm.decode_linear(x, weight, config=config)


SHAPES = {  # name: (N, K) of W [N, K], Llama-3-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYERS = 32  # distinct weights per graph (lm_head: 4, it is far larger than L2 anyway)


def graph_time_us(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per GEMM: fn (making `calls` GEMMs) replayed from a CUDA graph, median of `reps`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, n: int, k: int, m: int, sweep: bool) -> dict[str, float]:
    layers = 4 if name == "lm_head" else LAYERS
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    results: dict[str, float] = {}

    results["cublas"] = graph_time_us(lambda: [F.linear(x, w) for w in weights], layers)
    weights_kn = [w.t().contiguous() for w in weights]
    results["cublas-kn"] = graph_time_us(lambda kn=weights_kn: [torch.mm(x, w) for w in kn], layers)
    del weights_kn
    configs = CONFIGS if sweep else [c for c in [pick_config(m, n, k)] if c is not None]
    best = None
    for cfg in configs:
        try:
            got = skinny_linear(x, weights[0], config=cfg)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"rel err {err}"
            us = graph_time_us(
                lambda cfg=cfg: [skinny_linear(x, w, config=cfg) for w in weights], layers
            )
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
            print(f"    {name} M={m} {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
            continue
        if sweep:
            print(f"    {name} M={m} {cfg}: {us:7.1f} us {n * k * 2 / us / 1e6:5.2f} TB/s", flush=True)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        results["triton"] = best[0]
        results["triton_config"] = best[1]  # type: ignore[assignment]
    return results


def chain_bench(m: int) -> None:
    """Microseconds per decoder layer of the GEMM chain (see the module docstring), one graph of 32 layers."""
    from worker.engine.kernels import decode_gemm as dg
    from worker.engine.kernels import fused as fk

    hidden, dt = 4096, torch.bfloat16
    names = ("qkv", "o", "gate_up", "down")
    layers = [
        {name: torch.randn(*SHAPES[name], device="cuda", dtype=dt) * 0.02 for name in names} for _ in range(LAYERS)
    ]
    norm_w = torch.ones(hidden, device="cuda", dtype=dt)
    x0 = torch.randn(m, hidden, device="cuda", dtype=dt)

    def run(triton_names: tuple[str, ...], pdl: bool, gated: dg.Config | None = None) -> None:
        def linear(x, w, name):
            if name not in triton_names:
                return F.linear(x, w)
            config = dg.config_for(*w.shape) or (32, 256, 4, 4)  # down (cuBLAS in the decoder): the sweep's best
            return dg.decode_linear(x, w, pdl=pdl, config=config)

        def gate_up_silu(x, w):
            if gated is None:
                return fk.silu_mul(linear(x, w, "gate_up"), pdl=pdl)
            return dg.decode_gate_up_silu(x, w, pdl=pdl, config=gated)

        hidden_x, residual = x0, x0.clone()
        for w in layers:
            normed, residual = fk.add_rmsnorm(hidden_x, residual, norm_w, 1e-5, pdl=pdl)
            linear(normed, w["qkv"], "qkv")  # attention, left out, would read its output
            hidden_x = linear(normed, w["o"], "o")
            normed, residual = fk.add_rmsnorm(hidden_x, residual, norm_w, 1e-5, pdl=pdl)
            hidden_x = linear(gate_up_silu(normed, w["gate_up"]), w["down"], "down")

    weight_bytes = sum(SHAPES[name][0] * SHAPES[name][1] * 2 for name in names)
    variants: list[tuple[str, tuple[str, ...], bool, dg.Config | None]] = [
        ("cublas", (), False, None),
        ("cublas, pdl element-wise", (), True, None),
        ("triton", names, False, None),
        ("triton+pdl", names, True, None),
        ("triton+pdl, down cublas", names[:3], True, None),
        ("triton+pdl qkv/o only", names[:2], True, None),
    ]
    # SiLU·mul in the gate/up GEMM's epilogue (dg.decode_gate_up_silu), down on cuBLAS as in the decoder
    for gated in (dg.GATED_CONFIG, (32, 128, 4, 4), (64, 64, 4, 8)):
        variants.append((f"triton+pdl, gated {gated}", names[:3], True, gated))
    for label, triton_names, pdl, gated in variants:
        us = graph_time_us(lambda t=triton_names, p=pdl, g=gated: run(t, p, g), LAYERS)
        print(f"M={m:3d} {label:40s} {us:7.1f} us/layer  {weight_bytes / us / 1e6:5.2f} TB/s of weights", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, action="append", help="token counts (default 32 and 64)")
    parser.add_argument("--sweep", action="store_true", help="time every Triton configuration")
    parser.add_argument("--chain", action="store_true", help="time the decoder layer's GEMM chain instead")
    args = parser.parse_args()
    if args.chain:
        for m in args.m or [32]:
            chain_bench(m)
        return
    ms = args.m or [32, 64]
    torch.manual_seed(0)
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; us per GEMM (weight TB/s)")
    for m in ms:
        for name, (n, k) in SHAPES.items():
            r = bench_shape(name, n, k, m, args.sweep)
            gbs = {key: n * k * 2 / us / 1e6 for key, us in r.items() if isinstance(us, float)}
            cells = "  ".join(f"{key} {r[key]:6.1f} ({gbs[key]:4.0f})" for key in gbs)
            print(f"M={m:4d} {name:8s} {cells}  {r.get('triton_config', '')}", flush=True)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
