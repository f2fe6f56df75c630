"""Gemma 3 (4B-27B, Gemma3ForConditionalGeneration) image inputs from a checkpoint's own files: each image resized
to the vision tower's square (SigLIP, 896 pixels a side in the releases) and normalized, and a prompt's
`<start_of_image>` expanded as transformers' `Gemma3Processor` expands it in the text: `\\n\\n<start_of_image>`, one
`<image_soft_token>` per token of the image (`mm_tokens_per_image`, 256), `<end_of_image>\\n\\n`. Owns nothing the
engine keeps; admission and the reference tests call it.

Built without `AutoProcessor` (torchvision is not needed): the PIL image processor (`Gemma3ImageProcessorPil`) and
the tokenizer are read from the checkpoint's files. The processor expands the rendered text before tokenizing it;
this expands token ids, so the two `\\n\\n` around an image are tokenized together with the newline-only tokens
next to the placeholder (Gemma's vocabulary has tokens for runs of newlines; no token joins a newline to text).
Pan-and-scan crops are not run: a preprocessor_config.json that turns them on is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GEMMA3_MODEL_TYPES = ("gemma3",)


@dataclass(frozen=True)
class Gemma3Image:
    pixel_values: np.ndarray  # [1, 3, size, size] float32, normalized
    num_tokens: int  # its soft tokens in the prompt (mm_tokens_per_image)
    grid: None = None  # (a Qwen-VL image's patch grid; Gemma 3's images are all one square)


class Gemma3Images:
    """A Gemma 3 checkpoint's image processing: `encode` (picture -> pixels), `expand` (each `<start_of_image>` of
    a rendered prompt -> the image's whole sequence), `positions` (plain: one rotary position per token)."""

    mrope = False  # position_ids are one row
    # In prefill an image's tokens attend to each other both ways (transformers' `token_type_ids` mask), so a
    # prefill chunk never ends inside an image (scheduler.py, `SequenceImages.whole_images`).
    bidirectional = True

    def __init__(self, checkpoint: str | Path):
        from transformers import AutoTokenizer
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        path = Path(checkpoint)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") not in GEMMA3_MODEL_TYPES:
            raise ValueError(f"{path} is a {config.get('model_type')!r} checkpoint, not Gemma 3")
        self.image_token_id: int = config.get("image_token_index", config.get("image_token_id"))
        self.placeholder_id: int = config.get(
            "boi_token_index", config.get("boi_token_id")
        )  # what templates write
        self.end_id: int = config.get("eoi_token_index", config.get("eoi_token_id"))
        self.tokens_per_image: int = config.get("mm_tokens_per_image", 256)
        window = config.get("text_config", {}).get("sliding_window") or 0
        if 0 < window < self.tokens_per_image:
            # NOTE: transformers 5 releases differ on an image's both-ways block in a sliding layer (inside the
            # window or beside it); they agree when the window holds a whole image, as in every release (1024).
            raise ValueError(f"a sliding window of {window} is shorter than an image's {self.tokens_per_image} tokens")
        self.processor = Gemma3ImageProcessorPil.from_pretrained(path)
        if self.processor.do_pan_and_scan:
            raise ValueError("preprocessor_config.json turns on pan-and-scan crops, which cbq does not run")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._newline_cache: dict[str, list[int]] = {}

    def encode(self, image: Any) -> Gemma3Image:
        """A PIL RGB image as the vision tower reads it (resized to its square, rescaled, normalized)."""
        out = self.processor(images=[image], do_pan_and_scan=False, return_tensors="np")
        return Gemma3Image(np.asarray(out["pixel_values"], dtype=np.float32), self.tokens_per_image)

    def num_tokens(self, encoded: Gemma3Image) -> int:
        return encoded.num_tokens

    def expand(self, prompt_ids: Sequence[int], encoded: Sequence[Gemma3Image]) -> list[int]:
        """`prompt_ids` with its k-th `<start_of_image>` replaced by image k's sequence. ValueError when the chat
        template wrote another number of placeholders than there are images."""
        num_placeholders = sum(1 for token in prompt_ids if token == self.placeholder_id)
        if num_placeholders != len(encoded):
            raise ValueError(
                f"the chat template wrote {num_placeholders} image placeholders for {len(encoded)} images"
            )
        ids = list(prompt_ids)
        out: list[int] = []
        images = iter(encoded)
        index = 0
        while index < len(ids):
            if ids[index] != self.placeholder_id:
                out.append(ids[index])
                index += 1
                continue
            before = 0  # the newline-only tokens just before it, which the image's "\n\n" joins
            while out and before < len(out) and self._is_newlines(out[len(out) - 1 - before]):
                before += 1
            run = self.tokenizer.decode(out[len(out) - before :]) if before else ""
            del out[len(out) - before :]
            after = index + 1
            while after < len(ids) and self._is_newlines(ids[after]):
                after += 1
            run_after = self.tokenizer.decode(ids[index + 1 : after])
            image = next(images)
            out += self._newlines(run + "\n\n")
            out += [self.placeholder_id] + [self.image_token_id] * image.num_tokens + [self.end_id]
            out += self._newlines("\n\n" + run_after)
            index = after
        return out

    expand_encoded = expand

    def positions(self, expanded: Sequence[int], encoded: Sequence[Gemma3Image]) -> tuple[np.ndarray, int]:
        """[3, len] rotary positions (the three rows alike: Gemma 3 rotates by the token's index) and delta 0."""
        return np.broadcast_to(np.arange(len(expanded), dtype=np.int64), (3, len(expanded))).copy(), 0

    def _is_newlines(self, token: int) -> bool:
        if token == self.placeholder_id:
            return False
        text = self.tokenizer.decode([token])
        return bool(text) and set(text) == {"\n"}

    def _newlines(self, text: str) -> list[int]:
        if text not in self._newline_cache:
            self._newline_cache[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._newline_cache[text]
