"""W4A16 weight GEMMs on the H200: kernels/w4a16.py against the bf16 GEMMs the same step runs today.

    python3 benchmarks/w4a16_gemm.py [--m 1 8 32 512 8192] [--sweep]

Per Llama-3-8B projection (QKV, O, fused gate/up, down) at M tokens, us per GEMM replayed from a CUDA graph over
distinct weights (skinny_gemm.graph_time_us: 32 layers' weights, so L2 holds none of them; 4 above M = 512), and
the bytes per second of the weight as each variant reads it:
  bf16          what a bf16 model runs: kernels/decode_gemm.py's kernel for M <= 32 where it tiles the shape
                (down: cuBLAS), cuBLAS above
  w4a16         kernels/w4a16.py's GEMM at its default launch (small steps: split over K by the fill rule, with
                PDL; large steps: the tiled launch, whatever w4a16.large_step_kernel would choose), each K tile
                unpacked both ways (`w4a16.UNPACK`: reshaped into column order, or a dot per nibble position)
  dequant+cublas  w4a16.dequantize_weight (one kernel: the packed weight to bf16), then cuBLAS: large steps' other
                path (its bytes counted as the packed weight's)
Group 128, symmetric (what `bench engine --precision int4` packs). --sweep times the W4A16 kernel in each of
SWEEP_CONFIGS, each split for M <= 32 and each unpacking its K tile allows. What the numbers decide:
SMALL_STEP_CONFIG, LARGE_STEP_CONFIG, the split rule (SPLIT_FILL, SPLIT_CHOICES), UNPACK and DEQUANTIZE_FROM_M in
kernels/w4a16.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from skinny_gemm import LAYERS, graph_time_us  # noqa: E402 (benchmarks/ is the script's directory)

from worker.engine.kernels import decode_gemm as dg  # noqa: E402
from worker.engine.kernels import w4a16  # noqa: E402
from worker.engine.kernels.pdl import pdl_usable  # noqa: E402
from worker.engine.quant.int4 import quantize_rtn  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
# (BLOCK_N, BLOCK_K, num_warps, num_stages) for --sweep; BLOCK_K at most the group size
SWEEP_CONFIGS = [
    (64, 128, 4, 2),
    (64, 128, 4, 4),
    (64, 128, 8, 3),
    (64, 64, 4, 4),
    (128, 128, 4, 3),
    (128, 128, 8, 4),
    (128, 64, 8, 3),
    (256, 64, 8, 3),
]
UNPACKS = {"reshape": w4a16.UNPACK_RESHAPE, "nibbles": w4a16.UNPACK_NIBBLES}


def packed_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * (k // GROUP) * 2  # the words, then the bf16 scales


def bench_shape(name: str, n: int, k: int, m: int, sweep: bool) -> dict[str, float]:
    count = LAYERS if m <= 512 else 4  # large steps are compute-bound: a few weights, and less memory for outputs
    layers = [quantize_rtn(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, GROUP) for _ in range(count)]
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    pdl = pdl_usable(x.device) and m <= w4a16.MAX_TOKENS
    times: dict[str, float] = {}

    def timed(label: str, one) -> None:
        def all_layers() -> None:
            for i in range(count):
                one(i)  # the output is dropped: the graph's pool reuses its memory

        try:
            times[label] = graph_time_us(all_layers, count)
        except Exception as exc:  # a tile that does not fit (shared memory): say so, go on
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}")

    if m <= dg.MAX_TOKENS:
        timed("bf16", lambda i: dg.decode_linear(x, dense[i], pdl=dg.pdl_usable(x.device)))
    else:
        timed("bf16", lambda i: F.linear(x, dense[i]))

    def w4(i: int, config=None, split=None, unpack=None):
        layer = layers[i]
        return w4a16.w4a16_gemm(
            x, layer.qweight, layer.scales, layer.zeros, GROUP, pdl=pdl, config=config, split_k=split, unpack=unpack
        )

    for how, unpack in UNPACKS.items():
        timed(f"w4a16 {how}", lambda i, u=unpack: w4(i, unpack=u))
    timed(
        "dequant+cublas",
        lambda i: F.linear(x, w4a16.dequantize_weight(layers[i].qweight, layers[i].scales, None, GROUP, x.dtype)),
    )
    if sweep:
        splits = [1, 2, 4, 8] if m <= w4a16.MAX_TOKENS else [None]
        for config in SWEEP_CONFIGS:
            for how, unpack in UNPACKS.items():
                if w4a16.unpack_for(config[1], unpack) != unpack:
                    continue  # a K tile too shallow to unpack by nibble position
                for split in splits:
                    if split is not None and (k // config[1]) % split:
                        continue
                    timed(f"w4a16 {config} {how} split {split}", lambda i, c=config, s=split, u=unpack: w4(i, c, s, u))
    dense_bytes, int4_bytes = n * k * 2, packed_bytes(n, k)
    for label, us in times.items():
        read = dense_bytes if label == "bf16" else int4_bytes
        print(f"  {name:8s} M={m:5d} {label:38s} {us:9.1f} us  {read / us / 1e3:7.0f} GB/s")
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32, 512, 8192])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=list(SHAPES))
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}: W4A16 (group {GROUP}, symmetric) vs bf16, us per GEMM (graph replay)")
    for m in args.m:
        for name in args.shape:
            times = bench_shape(name, *SHAPES[name], m, args.sweep)
            best = min((t, label) for label, t in times.items() if label != "bf16")
            print(f"  {name:8s} M={m:5d} best {best[1]}: {times.get('bf16', float('nan')) / best[0]:.2f}x bf16")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
