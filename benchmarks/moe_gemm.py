"""The routed experts' Triton grouped GEMMs (worker/engine/moe/triton_moe.py) per launch configuration, on the GPU.

    python3 benchmarks/moe_gemm.py [--shape deepseek-v2-lite qwen3-30b-a3b] [--tokens 8192 2048 512 64]

Per MoE shape and step size T: one layer's whole expert path (count, align, gate/up with SiLU·mul, down, the sum
over the k pairs) as `experts_triton` runs it in a step, for each configuration of CONFIGS and the one
`config_for` picks today, in us per layer replayed from a CUDA graph over distinct layers' weights (L2 holds none
of them), and the TFLOP/s of the two GEMMs' multiply-adds (2 * T * k * 3 * H * I). Random bf16 weights; each
token's k experts are the top k of random scores (about T * k / E pairs an expert, as W2's steps see them).
What the numbers decide: triton_moe.LAUNCH_CONFIGS for the GPU they ran on. Prints a table and the best per
(shape, T); `--json-out` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from skinny_gemm import graph_time_us  # noqa: E402 (benchmarks/ is the script's directory)

from worker.engine.moe import triton_moe  # noqa: E402
from worker.engine.moe.spec import MoeSpec  # noqa: E402
from worker.engine.moe.triton_moe import LaunchConfig, MoeWorkspace, experts_triton  # noqa: E402
from worker.engine.moe.weights import ExpertWeights  # noqa: E402

# (num_experts, top_k, hidden, expert intermediate): DeepSeek-V2-Lite and Moonlight-16B-A3B share theirs
SHAPES = {
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
LAYERS = 8  # distinct layers' experts a graph cycles through (V2-Lite: 8 x 1.1 GB)
# (block_m, block_n, block_k, group_m, num_warps, num_stages)
CONFIGS = [
    (16, 64, 128, 1, 4, 4),
    (32, 64, 128, 4, 4, 4),
    (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 3),
    (64, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 8, 4),
    (64, 256, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4),
    (128, 64, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 16, 8, 3),
    (128, 128, 32, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
]


def bench(shape: str, num_tokens: int) -> dict[str, float]:
    num_experts, top_k, hidden, inter = SHAPES[shape]
    spec = MoeSpec(shape, num_experts, top_k, hidden, inter)
    device = torch.device("cuda")
    layers = [
        ExpertWeights(
            torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02,
            torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(LAYERS)
    ]
    x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    scores = torch.randn(num_tokens, num_experts, device=device).softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)
    workspace = MoeWorkspace.allocate(spec, num_tokens, torch.bfloat16, device)
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    times: dict[str, float] = {}
    default = triton_moe.config_for(spec, num_tokens, device)
    candidates = {"default " + _label(default): default}
    candidates |= {_label(LaunchConfig(*c)): LaunchConfig(*c) for c in CONFIGS}
    # one untimed run first: the GPU's clocks ramp from idle, and the first configuration timed would pay for it
    graph_time_us(lambda: experts_triton(x, weights, ids, layers[0], spec, workspace, default), 1)
    for label, config in candidates.items():

        def all_layers(config=config) -> None:
            for experts in layers:
                experts_triton(x, weights, ids, experts, spec, workspace, config)

        try:
            times[label] = graph_time_us(all_layers, LAYERS)
        except Exception as exc:  # a tile that does not fit (shared memory, registers): say so, go on
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"  {shape:16s} T={num_tokens:5d} {label:34s} {times[label]:9.1f} us  {flops / times[label] / 1e6:6.0f} TFLOP/s")
    return times


def _label(config: LaunchConfig) -> str:
    c = config
    return f"({c.block_m},{c.block_n},{c.block_k},{c.group_m},{c.num_warps},{c.num_stages})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 2048, 512, 64])
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}: routed experts per layer (bf16), us per layer (graph replay)")
    results = {}
    for shape in args.shape:
        for num_tokens in args.tokens:
            times = bench(shape, num_tokens)
            torch.cuda.empty_cache()  # the shape's weights went with bench's frame
            if not times:
                continue
            best = min(times, key=times.__getitem__)
            default = next(label for label in times if label.startswith("default"))
            print(f"  {shape:16s} T={num_tokens:5d} best {best}: {times[default] / times[best]:.2f}x the default")
            results[f"{shape} T={num_tokens}"] = {"best": best, "us": times}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
