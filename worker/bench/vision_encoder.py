"""`cbq bench vision-encoder`: the Qwen2.5-VL vision tower alone over W6's pictures, transformers' sdpa (a call per
window and image, in a Python loop) against cbq's packed attention (worker/engine/models/vision_attention.py: one
call a block), in one process, on the same module and pixels.

The tower of `--shape` (Qwen2.5-VL-7B-Instruct's: 32 blocks, 28 windowed; random weights built on the device in
the model dtype, no language model) runs `--batches` calls of `--images` pictures each (bench vision's seeded
1024x768 pictures: 3,996 patches, ~62 windows each) after one warm-up call per implementation. Reports each
implementation's milliseconds per image and the speed-up, how far the two outputs are apart (the CPU tests prove
them equal in fp32; in bf16 they differ by rounding), and the host's image processing per picture (what the
engine's admission spends on each, worker/media/qwen_vl.py). Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from worker.bench.common import run_header
from worker.bench.qwen_vl_checkpoint import QWEN2_5_VL_SHAPES, QWEN_VL_FAMILY, write_qwen_vl_files
from worker.bench.vision import W6_IMAGE_SIZE, w6_picture

IMPLEMENTATIONS = ("sdpa", "packed")


@click.command("vision-encoder")
@click.option(
    "--shape", type=click.Choice(list(QWEN2_5_VL_SHAPES)), default="qwen2.5-vl-7b", show_default=True
)
@click.option("--images", type=int, default=8, show_default=True, help="Pictures a tower call.")
@click.option(
    "--batches", type=int, default=4, show_default=True, help="Timed tower calls an implementation."
)
@click.option(
    "--image-size", type=(int, int), default=W6_IMAGE_SIZE, show_default=True, help="Width, height."
)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto: bf16 on CUDA, fp32 on the CPU.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default="vision_encoder.json", show_default=True)
def vision_encoder_bench(shape, images, batches, image_size, device, dtype, seed, json_out):
    """The vision tower over W6's pictures: transformers' sdpa vs cbq's packed attention, ms per image."""
    import numpy as np
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from worker.engine.models.loader import resolve_device, resolve_dtype
    from worker.engine.models.vision_attention import use_packed_attention
    from worker.media.qwen_vl import QwenVLImages

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    spec = QWEN2_5_VL_SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:  # preprocessor_config.json, which the image processing reads
        config, _, _ = write_qwen_vl_files(
            Path(tmp),
            Qwen2_5_VLConfig,
            spec.text,
            spec.vision,
            QWEN_VL_FAMILY,
            spec.preprocessor,
            spec.vocab_size,
        )
        processor = QwenVLImages(tmp)
    torch.manual_seed(seed)
    with torch.device(torch_device):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=torch_dtype)
    tower = tower.eval().requires_grad_(False)

    pictures = [w6_picture(seed + i, tuple(image_size)) for i in range((batches + 1) * images)]
    t0 = time.perf_counter()
    encoded = [processor.encode(p) for p in pictures]
    host_ms = (time.perf_counter() - t0) * 1000 / len(pictures)
    calls = []  # (pixels, grids) of each call, on the device; the first is the warm-up
    for first in range(0, len(encoded), images):
        part = encoded[first : first + images]
        pixels = torch.from_numpy(np.concatenate([e.pixel_values for e in part])).to(
            torch_device, torch_dtype
        )
        grids = torch.tensor([[e.grid.t, e.grid.h, e.grid.w] for e in part], device=torch_device)
        calls.append((pixels, grids))

    def synchronize() -> None:
        if torch_device.type == "cuda":
            torch.cuda.synchronize(torch_device)

    results: dict[str, dict[str, Any]] = {}
    first_outputs: dict[str, torch.Tensor] = {}
    for name in IMPLEMENTATIONS:
        if name == "packed":
            use_packed_attention(tower.config)
        else:
            tower.config._attn_implementation = "sdpa"
        with torch.inference_mode():
            first_outputs[name] = tower(*calls[0]).pooler_output.float().cpu()  # warm-up
            synchronize()
            start = time.perf_counter()
            for pixels, grids in calls[1:]:
                tower(pixels, grid_thw=grids)
            synchronize()
            seconds = time.perf_counter() - start
        num = batches * images
        results[name] = {
            "seconds": seconds,
            "ms_per_image": seconds * 1000 / num,
            "images_per_s": num / seconds,
        }
    diff = (first_outputs["packed"] - first_outputs["sdpa"]).abs()
    row = {
        "shape": shape,
        "image_size": list(image_size),
        "patches_per_image": calls[0][0].shape[0] // images,
        "images_per_call": images,
        "calls": batches,
        "device": str(torch_device),
        "dtype": str(torch_dtype).removeprefix("torch."),
        **results,
        "speedup": results["sdpa"]["seconds"] / results["packed"]["seconds"],
        "max_abs_diff": diff.max().item(),
        "relative_diff": (diff.norm() / first_outputs["sdpa"].norm()).item(),
        "host_processing_ms_per_image": host_ms,
    }
    click.echo(
        f"\nvision tower of {shape} ({row['dtype']}, {row['device']}): {batches} calls of {images} pictures of "
        f"{image_size[0]}x{image_size[1]} ({row['patches_per_image']} patches each)"
    )
    for name in IMPLEMENTATIONS:
        r = results[name]
        click.echo(f"{name:<7} {r['ms_per_image']:>9.2f} ms/image {r['images_per_s']:>9.1f} images/s")
    click.echo(
        f"packed / sdpa speed-up {row['speedup']:.2f}x; outputs apart by {row['max_abs_diff']:.3g} at most "
        f"({row['relative_diff']:.2g} relative); host image processing {host_ms:.1f} ms/image"
    )
    report = {
        **run_header(),
        "rows": [row],
    }
    Path(json_out).write_text(json.dumps(report, indent=2))
    click.echo(f"wrote {json_out}")
