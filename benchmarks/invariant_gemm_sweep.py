"""Deterministic mode's weight GEMMs on the H200: which one launch configuration to use for every M (issue 32).

    python3 benchmarks/invariant_gemm_sweep.py [--m 32 --m 128 --m 256 --m 1024 --m 8192] [--json-out FILE]

Deterministic mode (kernels/invariant_gemm.py) runs every weight product of a step through decode_gemm.py's kernel
with one configuration per weight shape for every row count M, so that a row's bits never depend on the step. On
2026-12-01 W2 --deterministic ran at 0.461x the default (88.0 vs 40.5 GPU ms per 8,192-token step): the
configuration is decode_gemm's, tuned for M = 32 (BLOCK_M 64, 64-row weight tiles), and at M = 8,192 every
64-row block of x rereads its whole weight. This script measures, per Llama-3-8B projection and per M, the
microseconds of each candidate configuration (BLOCK_N, BLOCK_K, num_warps, num_stages, BLOCK_M, GROUP_N) against
cuBLAS, and sums a decoder step's GEMMs (32 layers + lm_head) per candidate, so the choice is made by measurement.

It also answers the question that decides the design: are a row's output bits the same under two configurations
that share BLOCK_K (the K tile order), i.e. does only the reduction over K fix the bits? It computes the same
64 rows under every candidate and reports which candidates agree bit for bit with which. If all those with one
BLOCK_K agree, deterministic mode may pick the tile shape by M (small tiles for decode, large for prefill) and
stay batch-invariant; if not, one configuration must serve every M and this table says which costs least.
Every candidate is also checked to be batch-invariant itself: the first 32 rows of the largest M's product equal
the M = 32 product bit for bit. `--smoke` runs it all at 1/32 of the shapes in Triton's interpreter (CPU, fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (BLOCK_N, BLOCK_K, num_warps, num_stages, BLOCK_M, GROUP_N). The first two are today's (invariant_gemm.py:
# decode_gemm's NARROW and WIDE configurations at BLOCK_M 64, a 2-D grid); GROUP_N > 0 launches the same programs
# grouped (decode_gemm `_grouped_tile`: same bits, L2 reuse at large M); the rest trade decode-step efficiency for
# large-M tiles.
CANDIDATES: list[tuple[int, int, int, int, int, int]] = [
    (64, 64, 4, 8, 64, 0),
    (64, 128, 4, 4, 64, 0),
    (64, 64, 4, 8, 64, 8),
    (64, 128, 4, 4, 64, 8),
    (128, 64, 4, 4, 64, 8),
    (128, 64, 8, 3, 128, 0),
    (128, 64, 8, 3, 128, 8),
    (128, 64, 4, 4, 128, 8),
    (128, 128, 8, 3, 128, 8),
    (256, 64, 8, 3, 128, 8),
    (128, 64, 8, 3, 256, 8),
    (64, 64, 4, 4, 128, 8),
    # around today's large plan (invariant_gemm.LARGE_TILE, BLOCK_M 128, GROUP_N 8), after the 2026-12-01 sweep
    (128, 64, 8, 4, 128, 8),
    (128, 64, 8, 3, 128, 16),
    (128, 128, 8, 2, 128, 8),
    (256, 64, 8, 2, 128, 8),
    (128, 64, 8, 3, 64, 8),
]
# Llama-3-8B's weight products per layer (name, N, K, gated) and the lm_head, in bf16.
SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 14336, 4096, True),
          ("down", 4096, 14336, False), ("lm_head", 128256, 4096, False)]  # fmt: skip
LAYERS = 32


def _time_us(fn, iters: int) -> float:
    fn()
    if not torch.cuda.is_available():  # --smoke in Triton's interpreter: wall time, meaningless but exercised
        start_s = time.perf_counter()
        fn()
        return (time.perf_counter() - start_s) * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _product(dg, x, w, gated: bool, cand):
    config, block_m, group_n = cand[:4], cand[4], cand[5]
    if gated:
        return dg.decode_gate_up_silu(x, w, config=config, block_m=block_m, group_n=group_n)
    return dg.decode_linear(x, w, config=config, block_m=block_m, group_n=group_n)


def _cublas(x, w, gated: bool):
    import torch.nn.functional as F

    from worker.engine.kernels import fused as fk

    return fk.act_mul(F.linear(x, w)) if gated else F.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, action="append", help="row counts (default 32, 1024, 8192)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="shapes / 32 on the CPU (TRITON_INTERPRET=1): runs the code")
    args = parser.parse_args()
    ms = args.m or ([16, 64] if args.smoke else [32, 128, 256, 1024, 8192])  # 128-256: where the plans cross
    big_m = max(ms)
    shapes = [(s, n // 32, k // 32, g) for s, n, k, g in SHAPES] if args.smoke else SHAPES
    dtype = torch.float32 if args.smoke else torch.bfloat16
    from worker.engine.kernels import decode_gemm as dg

    torch.manual_seed(0)
    dev = torch.device("cpu" if args.smoke else "cuda")
    device_name = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    results: dict = {"device": device_name, "candidates": [list(c) for c in CANDIDATES], "shapes": {}}
    step_us = {key: {m: 0.0 for m in ms} for key in [str(c) for c in CANDIDATES] + ["cublas"]}
    for name, n, k, gated in shapes:
        rows = 2 * n if gated else n
        w = torch.randn(rows, k, device=dev, dtype=dtype) / k**0.5
        x_all = torch.randn(big_m, k, device=dev, dtype=dtype)
        times_per_layer = 1 if name == "lm_head" else LAYERS
        entry: dict = {"us": {}, "invariant": {}, "same_bits_as": {}}
        outs = {}
        for cand in CANDIDATES:
            if n % cand[0] or k % cand[1]:
                continue
            key = str(cand)
            try:
                small = _product(dg, x_all[:32].contiguous(), w, gated, cand)
                big = _product(dg, x_all, w, gated, cand)
            except Exception as exc:  # a configuration that does not compile (shared memory): reported, skipped
                entry["us"][key] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                continue
            entry["invariant"][key] = bool(torch.equal(small, big[:32]))
            outs[key] = big[:64]
            entry["us"][key] = {}
            for m in ms:
                x = x_all[:m].contiguous()
                us = _time_us(partial(_product, dg, x, w, gated, cand), 20 if m >= 4096 else 100)
                entry["us"][key][m] = us
                step_us[key][m] += us * times_per_layer
        entry["us"]["cublas"] = {}
        for m in ms:
            x = x_all[:m].contiguous()
            us = _time_us(partial(_cublas, x, w, gated), 20 if m >= 4096 else 100)
            entry["us"]["cublas"][m] = us
            step_us["cublas"][m] += us * times_per_layer
        for key, out in outs.items():
            entry["same_bits_as"][key] = [other for other, o in outs.items() if other != key and torch.equal(out, o)]
        results["shapes"][name] = entry
        print(f"\n{name} [{rows} x {k}] us per product (cuBLAS: "
              + ", ".join(f"M={m} {entry['us']['cublas'][m]:.1f}" for m in ms) + ")")  # fmt: skip
        for key, value in entry["us"].items():
            if isinstance(value, str):
                print(f"  {key:27} {value}")
        for key in outs:
            cells = " | ".join(f"M={m} {entry['us'][key][m]:9.1f}" for m in ms)
            print(f"  {key:27} {cells} | invariant {entry['invariant'][key]} | same bits as {entry['same_bits_as'][key]}")
        del w, x_all
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    complete = {
        key: per_m
        for key, per_m in step_us.items()
        if key == "cublas" or all(key in results["shapes"][s]["invariant"] for s, *_ in shapes)
    }
    print("\nA Llama-3-8B step's weight GEMMs (32 layers + lm_head), ms; ratio to cuBLAS:")
    for key, per_m in complete.items():
        cells = " | ".join(f"M={m} {per_m[m] / 1000:7.2f} ({per_m[m] / step_us['cublas'][m]:.2f}x)" for m in ms)
        print(f"  {key:27} {cells}")
    results["step_ms"] = {key: {m: v / 1000 for m, v in per_m.items()} for key, per_m in complete.items()}
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
