"""Load seconds, peak host RSS and peak GPU memory of loading one checkpoint (issue 46: one loader).

Each measurement runs in a fresh child process, so its peak RSS is the load's own. Routes:
  cbq  `worker.engine.models.load_model`: what the engine loads (by slice through the parallel layers' methods)
  hf   transformers' `AutoModelForCausalLM.from_pretrained(..., dtype).to(device)`: the one-process route before
       issue 46, as a baseline on the same machine

A checkpoint folder is given (`--checkpoint`), or made once from a preset's shape with random weights
(`--preset llama3-8b --save-dir /scratch/llama3-8b`: the model built on the device, saved in safetensors shards).

On the H200 (the commands the lead runs; qwen3-30b-a3b is ~61 GB in bf16 on disk):
  python benchmarks/load_model.py --preset llama3-8b --save-dir /tmp/ckpt/llama3-8b --routes cbq hf --json out/load_llama3_8b.json
  python benchmarks/load_model.py --preset qwen3-30b-a3b --save-dir /tmp/ckpt/qwen3-30b-a3b --routes cbq hf --json out/load_qwen3_30b.json
  python benchmarks/load_model.py --checkpoint /tmp/ckpt/llama3-8b --quantization fp8 --routes cbq --json out/load_llama3_8b_fp8.json
On the CPU (a small fixture, ~480 MB in fp32): --preset small-llama --override hidden_size=1024
  intermediate_size=4096 num_hidden_layers=8 --save-dir /tmp/small-llama-1k --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(preset: str, folder: Path, device: str, dtype: str, overrides: list[str]) -> None:
    """The preset's shape (config fields replaced by `overrides`, "field=int") with random weights, saved once
    (skipped when the folder holds a config already)."""
    if (folder / "config.json").exists():
        return
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.models import preset_config, resolve_dtype

    config = preset_config(preset)
    for override in overrides:
        field, value = override.split("=")
        setattr(config, field, int(value))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, torch.device(device)))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="5GB")


def measure(checkpoint: str, route: str, device: str, dtype: str, quantization: str | None) -> dict:
    """In this process (the child): load once, report seconds, peak RSS and peak GPU memory."""
    import torch

    from worker.engine.models import load_model, resolve_dtype

    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    if route == "cbq":
        model, _ = load_model(checkpoint, dev, torch_dtype, quantization=quantization)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    return {
        "route": route,
        "checkpoint": checkpoint,
        "device": device,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "quantization": quantization,
        "load_seconds": round(seconds, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),  # Linux: KiB
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated(dev) / 1e9, 3) if dev.type == "cuda" else None,
        "values": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a checkpoint folder")
    parser.add_argument("--preset", help="make a checkpoint of this preset's shape (random weights) in --save-dir")
    parser.add_argument("--save-dir", type=Path)
    parser.add_argument("--override", nargs="*", default=[], help="config fields of the made checkpoint, field=int")
    parser.add_argument("--routes", nargs="+", default=["cbq", "hf"], choices=["cbq", "hf"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--repeats", type=int, default=1, help="loads per route (the page cache warms after the first)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.checkpoint, args.child[0], args.device, args.dtype, args.quantization)))
        return
    if args.preset:
        assert args.save_dir is not None, "--preset needs --save-dir"
        make_checkpoint(args.preset, args.save_dir, args.device, args.dtype, args.override)
        args.checkpoint = str(args.save_dir)
    assert args.checkpoint, "give --checkpoint or --preset with --save-dir"
    results = []
    for route in args.routes:
        for _ in range(args.repeats):
            command = [sys.executable, __file__, "--child", route, "--checkpoint", args.checkpoint, "--device",
                       args.device, "--dtype", args.dtype] + (["--quantization", args.quantization] if args.quantization else [])  # fmt: skip
            env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results.append(result)
            print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
