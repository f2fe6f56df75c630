"""Decode-shaped weight GEMMs on the H200: cuBLAS (as the owned decoder calls it) vs alternatives.

    python3 benchmarks/skinny_gemm.py [--m 32 --m 64] [--sweep]

For each Llama-3-8B projection (QKV, O, gate/up, down, lm_head) and token count M, times y = x @ W^T
replayed from a CUDA graph over 32 distinct weights (one per layer, so L2 never holds the next one),
and reports microseconds per GEMM and the weight bytes per second (the floor is the copy bandwidth):
  cublas      F.linear(x, W) with W [N, K] (what the decoder runs)
  cublas-kn   x @ W' with W' = W^T made contiguous [K, N] (another cuBLAS layout and kernel family)
  triton      worker.engine.skinny_gemm (best of its configurations with --sweep, else its default)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine import skinny_gemm as sg  # noqa: E402

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
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    results: dict[str, float] = {}

    results["cublas"] = graph_time_us(lambda: [F.linear(x, w) for w in weights], layers)
    weights_kn = [w.t().contiguous() for w in weights]
    results["cublas-kn"] = graph_time_us(lambda kn=weights_kn: [torch.mm(x, w) for w in kn], layers)
    del weights_kn
    configs = sg.CONFIGS if sweep else [sg.pick_config(m, n, k)]
    best = None
    for cfg in configs:
        try:
            got = sg.skinny_linear(x, weights[0], out=out, config=cfg)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"rel err {err}"
            us = graph_time_us(
                lambda cfg=cfg: [sg.skinny_linear(x, w, out=out, config=cfg) for w in weights], layers
            )
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
            print(f"    {name} M={m} {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
            continue
        if sweep:
            print(f"    {name} M={m} {cfg}: {us:7.1f} us {n * k * 2 / us / 1e6:6.0f} GB/s", flush=True)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        results["triton"] = best[0]
        results["triton_config"] = best[1]  # type: ignore[assignment]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, action="append", help="token counts (default 32 and 64)")
    parser.add_argument("--sweep", action="store_true", help="time every Triton configuration")
    args = parser.parse_args()
    ms = args.m or [32, 64]
    torch.manual_seed(0)
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; us per GEMM (weight GB/s)")
    for m in ms:
        for name, (n, k) in SHAPES.items():
            r = bench_shape(name, n, k, m, args.sweep)
            gbs = {key: n * k * 2 / us / 1e6 for key, us in r.items() if isinstance(us, float)}
            cells = "  ".join(f"{key} {r[key]:6.1f} ({gbs[key]:4.0f})" for key in gbs)
            print(f"M={m:4d} {name:8s} {cells}  {r.get('triton_config', '')}", flush=True)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
