"""Mistral Small 3.1 (Mistral3ForConditionalGeneration, Pixtral's vision encoder) image inputs from a
checkpoint's own files: each image resized (aspect kept, longest edge at most the processor's bound) to a
multiple of the merged patch (`patch_size` x `spatial_merge_size`, 28 pixels in the releases) and normalized, and
a prompt's `[IMG]` expanded as transformers' `PixtralProcessor` expands it: a row of `[IMG]` per row of merged
patches, each row closed by `[IMG_BREAK]`, the last by `[IMG_END]`. Owns nothing the engine keeps.

Built without `AutoProcessor` (PixtralProcessor needs torchvision): the PIL image processor
(`PixtralImageProcessorPil`) reads preprocessor_config.json, the merge and patch sizes come from
processor_config.json (config.json's when it has none). The image's region in the prompt holds break tokens
between its `[IMG]` rows: `layout` gives the region's ids, and the engine (multimodal.py) fills the `[IMG]`
places with the encoder's rows and the others with their token embeddings, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PIXTRAL_MODEL_TYPES = ("mistral3",)


@dataclass(frozen=True)
class PixtralImage:
    pixel_values: np.ndarray  # [1, 3, height, width] float32, normalized
    grid: tuple[int, int]  # (height, width) in pixels: what the tower reads beside the pixels (`image_sizes`)
    rows: int  # merged patches down
    cols: int  # merged patches across


class PixtralImages:
    """A Mistral 3 checkpoint's image processing: `encode`, `expand_encoded` (each `[IMG]` placeholder -> the
    image's region), `layout` (the region's ids), `positions` (plain)."""

    mrope = False
    bidirectional = False  # the language model attends causally over image tokens

    def __init__(self, checkpoint: str | Path):
        from transformers import AutoTokenizer
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        path = Path(checkpoint)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") not in PIXTRAL_MODEL_TYPES:
            raise ValueError(f"{path} is a {config.get('model_type')!r} checkpoint, not Mistral 3")
        processor_file = path / "processor_config.json"
        processor = json.loads(processor_file.read_text()) if processor_file.exists() else {}
        self.patch_size: int = processor.get("patch_size", config["vision_config"]["patch_size"])
        self.merge_size: int = processor.get("spatial_merge_size", config.get("spatial_merge_size", 2))
        if self.merge_size != config.get("spatial_merge_size", 2):
            raise ValueError(
                f"processor_config.json merges {self.merge_size} patches a side, config.json "
                f"{config.get('spatial_merge_size', 2)}"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_token_id: int = config.get("image_token_index", config.get("image_token_id"))
        self.placeholder_id = self.image_token_id  # the template writes one [IMG] per image
        self.break_id: int = tokenizer.convert_tokens_to_ids(processor.get("image_break_token", "[IMG_BREAK]"))
        self.end_id: int = tokenizer.convert_tokens_to_ids(processor.get("image_end_token", "[IMG_END]"))
        self.processor = PixtralImageProcessorPil.from_pretrained(path)

    def encode(self, image: Any) -> PixtralImage:
        """A PIL RGB image as the vision encoder reads it."""
        side = self.patch_size * self.merge_size
        out = self.processor(images=[image], patch_size=side, return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)[:, :, :height, :width]
        return PixtralImage(np.ascontiguousarray(pixels), (height, width), height // side, width // side)

    def layout(self, encoded: PixtralImage) -> list[int]:
        """The image's region: `cols` [IMG] and a break per row, the last break an [IMG_END]."""
        region = ([self.image_token_id] * encoded.cols + [self.break_id]) * encoded.rows
        region[-1] = self.end_id
        return region

    def num_tokens(self, encoded: PixtralImage) -> int:
        return encoded.rows * (encoded.cols + 1)

    def expand_encoded(self, prompt_ids: Sequence[int], encoded: Sequence[PixtralImage]) -> list[int]:
        """`prompt_ids` with its k-th [IMG] replaced by image k's region. ValueError when the chat template wrote
        another number of placeholders than there are images."""
        num_placeholders = sum(1 for token in prompt_ids if token == self.placeholder_id)
        if num_placeholders != len(encoded):
            raise ValueError(f"the chat template wrote {num_placeholders} image placeholders for {len(encoded)} images")
        out: list[int] = []
        images = iter(encoded)
        for token in prompt_ids:
            out.extend(self.layout(next(images)) if token == self.placeholder_id else [token])
        return out

    def positions(self, expanded: Sequence[int], encoded: Sequence[PixtralImage]) -> tuple[np.ndarray, int]:
        return np.broadcast_to(np.arange(len(expanded), dtype=np.int64), (3, len(expanded))).copy(), 0
