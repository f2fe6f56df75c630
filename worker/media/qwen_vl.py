"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL image inputs from a checkpoint's own files (olmOCR-style fine-tunes ship the
same): each image's pixels as the model's patches and its grid, and a prompt's image placeholders expanded to one
token per merged patch. Owns nothing the engine keeps; admission and the reference tests call it.

Built without `AutoProcessor`: transformers' `Qwen2_5_VLProcessor` and `Qwen3VLProcessor` insist on a video
processor, which needs torchvision, so the image processor (`Qwen2VLImageProcessorPil`, the PIL path) and the
tokenizer are read from the checkpoint's files directly, on the CPU and the device alike. Qwen3-VL's release names
`Qwen2VLImageProcessorFast` with 16-pixel patches: the same processing (the file's patch size, merge size, pixel
bounds, mean and std are what is read). Its M-RoPE positions are Qwen2.5-VL's for still images; only how the
language model interleaves the three rows over the rotary frequencies differs, which transformers' rotary does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class ImageGrid:
    """One image's patch grid before merging: t (temporal patches; 1 for a still image), h and w."""

    t: int
    h: int
    w: int

    def num_tokens(self, merge_size: int) -> int:
        """Its tokens in the prompt: one per merged (merge_size x merge_size) patch group."""
        return self.t * self.h * self.w // (merge_size * merge_size)


@dataclass(frozen=True)
class EncodedImage:
    pixel_values: np.ndarray  # [t*h*w, channels * temporal_patch * patch * patch], float32, normalized
    grid: ImageGrid


class QwenVLImages:
    """A Qwen-VL checkpoint's image processing: `encode` (pixels -> patches and grid), `expand` (each image pad of
    a rendered prompt -> its image's tokens), `positions` (M-RoPE). multimodal.py reads every image format through
    the same names (`placeholder_id`, `mrope`, `bidirectional`, `num_tokens`, `expand_encoded`, `positions`)."""

    mrope = True  # position_ids are [3, T]: temporal, height, width
    bidirectional = False  # the language model attends causally over image tokens too

    def __init__(self, checkpoint: str | Path):
        from transformers import Qwen2VLImageProcessorPil

        path = Path(checkpoint)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") not in QWEN_VL_MODEL_TYPES:
            raise ValueError(f"{path} is a {config.get('model_type')!r} checkpoint, not Qwen-VL")
        self.image_token_id: int = config["image_token_id"]
        self.placeholder_id = self.image_token_id  # the template writes one pad per image, expanded in place
        self.vision_start_token_id: int = config["vision_start_token_id"]
        self.merge_size: int = config["vision_config"]["spatial_merge_size"]
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        if self.processor.merge_size != self.merge_size:
            raise ValueError(
                f"preprocessor_config.json merges {self.processor.merge_size} patches a side, config.json "
                f"{self.merge_size}"
            )

    def encode(self, image: Any) -> EncodedImage:
        """A PIL RGB image as the vision encoder reads it (resized within the processor's pixel bounds)."""
        out = self.processor(images=[image], return_tensors="np")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return EncodedImage(np.asarray(out["pixel_values"], dtype=np.float32), ImageGrid(t, h, w))

    def num_tokens(self, encoded: EncodedImage) -> int:
        return encoded.grid.num_tokens(self.merge_size)

    def expand_encoded(self, prompt_ids: Sequence[int], encoded: Sequence[EncodedImage]) -> list[int]:
        return self.expand(prompt_ids, [e.grid for e in encoded])

    def positions(self, expanded: Sequence[int], encoded: Sequence[EncodedImage]) -> tuple[np.ndarray, int]:
        return mrope_positions(expanded, [e.grid for e in encoded], self.image_token_id, self.merge_size)

    def expand(self, prompt_ids: Sequence[int], grids: Sequence[ImageGrid]) -> list[int]:
        """`prompt_ids` with its k-th image pad repeated once per token of image k. ValueError when the chat
        template wrote another number of image pads than there are images."""
        num_pads = sum(1 for token in prompt_ids if token == self.image_token_id)
        if num_pads != len(grids):
            raise ValueError(f"the chat template wrote {num_pads} image placeholders for {len(grids)} images")
        expanded: list[int] = []
        images = iter(grids)
        for token in prompt_ids:
            if token == self.image_token_id:
                expanded.extend([token] * next(images).num_tokens(self.merge_size))
            else:
                expanded.append(token)
        return expanded


def mrope_positions(
    prompt_ids: Sequence[int], grids: Sequence[ImageGrid], image_token_id: int, merge_size: int
) -> tuple[np.ndarray, int]:
    """Qwen-VL's multimodal rotary positions of an expanded prompt: [3, len] (temporal, height, width rows) and
    the delta that continues them for generated tokens (position = index + delta, the same in all three rows).

    Text tokens advance all three rows together; an image's tokens sit at (start + t, start + row, start + col)
    of its merged grid, and the text after it starts past the image's largest row or column."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    positions = np.empty((3, len(ids)), dtype=np.int64)
    images = iter(grids)
    index = next_position = 0
    while index < len(ids):
        if ids[index] != image_token_id:
            end = index
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            positions[:, index:end] = next_position + np.arange(end - index)
            next_position += end - index
            index = end
            continue
        grid = next(images)
        t, h, w = grid.t, grid.h // merge_size, grid.w // merge_size
        num = t * h * w
        if not np.all(ids[index : index + num] == image_token_id):
            raise ValueError(f"an image of {num} tokens is cut short at position {index}")
        positions[0, index : index + num] = next_position + np.repeat(np.arange(t), h * w)
        positions[1, index : index + num] = next_position + np.tile(np.repeat(np.arange(h), w), t)
        positions[2, index : index + num] = next_position + np.tile(np.arange(w), t * h)
        next_position += max(h, w)  # a still image spans one temporal position
        index += num
    delta = next_position - len(ids)
    return positions, delta
