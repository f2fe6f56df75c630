"""Images in the engine, for a vision-language family (families/spec.py `VisionSpec`; models/vision.py).

Three owners, one per place the images pass through:

- `ImagePrompts` (admission, off the step loop, on the engine's admission pool: admission.py): a request's images
  through the checkpoint's own image processor (the family's image format: worker/media/qwen_vl.py,
  worker/media/gemma3.py), its prompt's image
  placeholders expanded to the image's tokens, and the prompt's rotary positions (Qwen-VL's M-RoPE, or plain). The result, `SequenceImages`, is immutable and shared by the
  request's samples; it also names the KV blocks an image's pads start in (`block_salt`), so the prefix cache
  never matches one image's K/V for another's. A format whose image tokens attend to each other both ways in
  prefill (Gemma 3) marks its images `bidirectional`: the scheduler never ends a chunk inside one
  (`whole_images`), and each image row's attention reaches its image's last token (`key_limits_of`).
- `step_images` (the step description): the step's positions ([3, T]: a prompt token's own rows, a generated
  token's text position + the request's delta in all three), which rows of the step take which image's embedding
  rows (a chunk of prefill may start or end inside a causal image), and for bidirectional images the last key
  position each row sees.
- `ImageEncoder` (the model runner): runs the vision tower batched over the step's images that its cache does
  not hold, keeps their embeddings by content hash (least recently used first out, bounded in bytes), and makes
  the step's input embeddings (image_inputs.py `ImageInputs`, for either decoder): the token embeddings with the
  image rows put in their places. With DeepStack
  (Qwen3-VL) each image row's embedding is cached with its features of every level, and the step's forward also
  takes the features of its image rows, with a mask of where they sit: a row's features depend on its image
  alone and are added to that row only, so a chunk that starts or ends inside an image is exact.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker.media.gemma3 import Gemma3Images
from worker.media.pixtral import PixtralImages
from worker.media.qwen_vl import ImageGrid, QwenVLImages

from .image_inputs import ImageInputs

ImageFormat = QwenVLImages | Gemma3Images | PixtralImages
# The image formats, by the name a family's `VisionSpec.images` gives (models/vision.py keeps it on the model).
IMAGE_FORMATS: dict[str, type[ImageFormat]] = {
    "qwen_vl": QwenVLImages,
    "gemma3": Gemma3Images,
    "pixtral": PixtralImages,
}

# The encoder cache's default bound: embeddings of ~1,300 images of 1024x768 on a 7B model in bf16.
ENCODER_CACHE_BYTES = 4 << 30


def is_vision_model(model: Any) -> bool:
    """Whether the engine's model takes images (models/vision.py `VisionLanguageModel`)."""
    return hasattr(model, "vision_tower")


def image_format(model: Any) -> ImageFormat:
    """The model's image processing, read from its checkpoint's files."""
    return IMAGE_FORMATS[model.image_format](model.name_or_path)


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: what the vision tower reads, and where its pads sit in the expanded prompt."""

    content_hash: str
    image: Any = field(repr=False)  # the decoded picture (PIL), from which its pixels are made again if need be
    # What the tower reads beside the pixels: Qwen-VL's patch grid, Pixtral's (height, width); None for a format
    # whose images are all one shape (Gemma 3).
    grid: ImageGrid | tuple[int, int] | None
    start: int  # index of its first pad in the prompt
    num_tokens: int  # of its region in the prompt
    # The region's token ids where it holds more than image tokens (Pixtral's row breaks): the encoder's rows go
    # to its image tokens, in order, and the others keep their token embeddings. None: all image tokens.
    layout: tuple[int, ...] | None
    # [t*h*w patches, patch values] float32, made at admission (off the step loop); the encoder empties it once
    # the image's embeddings are cached (a 1024x768 image's are ~19 MB, its picture 2.4 MB), and makes them
    # again from `image` if the cache dropped them before the image's last chunk or a preemption's recompute.
    pixels: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)


@dataclass(frozen=True)
class SequenceImages:
    """A request's images and its prompt's M-RoPE positions (the request's samples share it)."""

    images: tuple[PromptImage, ...]
    positions: np.ndarray = field(repr=False)  # [3, prompt_len] int64
    delta: int  # a generated token at index i rotates at i + delta in all three rows
    bidirectional: bool = False  # an image's tokens attend to each other both ways in prefill (Gemma 3)

    def budget_refusal(self, budget: int) -> str | None:
        """Why the request cannot run with `budget` tokens a step, or None: a bidirectional image is computed in
        one step (`whole_images`)."""
        longest = max(image.num_tokens for image in self.images)
        if not self.bidirectional or longest <= budget:
            return None
        return (
            f"an image takes {longest} tokens, more than the step's token budget (max_num_batched_tokens "
            f"{budget}); its tokens attend to each other both ways, so one step computes it whole"
        )

    def whole_images(self, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, shortened so that the chunk does not end inside a bidirectional image
        (0: the chunk would end in the image it starts in; the next step computes the rest of it whole)."""
        if not self.bidirectional:
            return num_new
        end = start + num_new
        for image in self.images:
            if image.start < end < image.start + image.num_tokens:
                return max(0, image.start - start)
        return num_new

    def key_limits_of(self, start: int, end: int) -> np.ndarray:
        """[end - start] the last key position each of tokens start..end-1 sees: its own, or for a bidirectional
        image's token, the image's last."""
        limits = np.arange(start, end, dtype=np.int64)
        if self.bidirectional:
            for image in self.images:
                lo, hi = max(image.start, start), min(image.start + image.num_tokens, end)
                if lo < hi:
                    limits[lo - start : hi - start] = image.start + image.num_tokens - 1
        return limits

    def block_salt(self, block_index: int, block_size: int) -> bytes:
        """What block `block_index`'s hash mixes in besides its tokens: the content hashes of the images whose pads
        start in it (the hash chain carries them to every later block)."""
        return b"".join(
            image.content_hash.encode()
            for image in self.images
            if image.start // block_size == block_index
        )

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] rotary positions of tokens start..end-1 (prompt, then generated)."""
        prompt_len = self.positions.shape[1]
        out = np.empty((3, end - start), dtype=np.int64)
        split = min(max(prompt_len, start), end)
        out[:, : split - start] = self.positions[:, start:split]
        out[:, split - start :] = np.arange(split, end) + self.delta
        return out


class ImagePrompts:
    """A vision-language checkpoint's image processing, for admission (runs on the engine's admission threads,
    several requests at once: it keeps no state between calls)."""

    def __init__(self, model: Any):
        self.processor = image_format(model)
        self.image_token_id = self.processor.image_token_id

    @property
    def bidirectional(self) -> bool:
        return self.processor.bidirectional

    def prepare(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], SequenceImages | None]:
        """The prompt with its image pads expanded, and its images; ValueError (one line) when the prompt's pads
        and the images do not pair up. `images`: `EngineImage`s in the order the chat template wrote them."""
        if not images:
            if self.image_token_id in prompt_ids or self.processor.placeholder_id in prompt_ids:
                raise ValueError("the prompt holds image placeholder tokens but the request has no images")
            return list(prompt_ids), None
        encoded = [self.processor.encode(image.image) for image in images]
        expanded = self.processor.expand_encoded(prompt_ids, encoded)  # type: ignore[arg-type]
        positions, delta = self.processor.positions(expanded, encoded)  # type: ignore[arg-type]
        prompt_images = []
        start = 0
        for image, e in zip(images, encoded, strict=True):
            start = expanded.index(self.image_token_id, start)
            num_tokens = self.processor.num_tokens(e)  # type: ignore[arg-type]
            layout = tuple(self.processor.layout(e)) if isinstance(self.processor, PixtralImages) else None  # type: ignore[arg-type]
            prompt_images.append(
                PromptImage(image.content_hash, image.image, e.grid, start, num_tokens, layout, [e.pixel_values])
            )
            start += num_tokens
        return expanded, SequenceImages(tuple(prompt_images), positions, delta, self.processor.bidirectional)


@dataclass(frozen=True)
class ImageSpan:
    """Rows of a step that take rows of an image's embeddings."""

    content_hash: str
    step_row: int  # the first, among the step's tokens
    embed_row: int  # the first of the image's embedding rows it takes
    num_rows: int


@dataclass(frozen=True)
class StepImages:
    """A step's multimodal inputs, as plain values (part of the step description). Outside image tokens the three
    rows are alike: a step without spans runs on token ids and row 0 as its positions (a decode graph too)."""

    positions: np.ndarray  # [3, T] int64: every real token's M-RoPE position
    spans: tuple[ImageSpan, ...]
    images: dict[str, list[PromptImage]]  # by content hash: the images the spans name (one picture, any request)
    # [T] int64, the last key position (in its sequence) each real token's attention sees, when a chunk holds a
    # bidirectional image's rows (attention.py `key_limits`); None: causal everywhere.
    key_limits: np.ndarray | None = None


def step_images(chunks: Iterable[tuple[SequenceImages | None, int, int]]) -> StepImages | None:
    """The step's positions and image rows from its chunks, each (the sequence's images, first token, number of
    tokens), in step order; None when no sequence of the step has images (its positions are the plain ones)."""
    chunks = list(chunks)
    if all(images is None for images, _, _ in chunks):
        return None
    positions: list[np.ndarray] = []
    limits: list[np.ndarray] = []
    any_bidirectional = False
    spans: list[ImageSpan] = []
    named: dict[str, list[PromptImage]] = {}
    offset = 0  # the chunk's first row among the step's
    for images, start, num_tokens in chunks:
        end = start + num_tokens
        if images is None:
            positions.append(np.broadcast_to(np.arange(start, end), (3, num_tokens)))
            limits.append(np.arange(start, end, dtype=np.int64))
        else:
            positions.append(images.positions_of(start, end))
            limits.append(images.key_limits_of(start, end))
            for image in images.images:
                lo, hi = max(image.start, start), min(image.start + image.num_tokens, end)
                if lo < hi:
                    spans.append(ImageSpan(image.content_hash, offset + lo - start, lo - image.start, hi - lo))
                    named.setdefault(image.content_hash, []).append(image)
                    any_bidirectional |= images.bidirectional
        offset += num_tokens
    key_limits = np.concatenate(limits) if any_bidirectional else None
    return StepImages(np.concatenate(positions, axis=1), tuple(spans), named, key_limits)


class ImageEncoder:
    """The model runner's image side: the vision tower, the embeddings cache (by content hash, LRU, at most
    `cache_bytes`), and each image step's input embeddings and rotary positions."""

    def __init__(self, model: Any, device: torch.device, cache_bytes: int = ENCODER_CACHE_BYTES):
        self.model = model
        self.processor = image_format(model)  # for pixels made again (PromptImage.pixels)
        self.device = device
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._num_bytes = 0
        self.num_encoded = 0  # images the tower ran on (cache misses), for tests and profiles
        self._seconds = 0.0  # the tower's device time, of the runs whose events were read
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: runs not read yet

    def step_inputs(self, input_ids: torch.Tensor, step: StepImages, num_tokens: int) -> ImageInputs:
        """The language model's inputs for the step's `input_ids` [num_tokens] (image_inputs.py): the token
        embeddings with the image rows' put in their places, the positions ([3, T] for M-RoPE, else [1, T];
        padding rows past the real tokens sit at position 0), and with DeepStack the image rows (in row order) and
        their features of each level."""
        embeddings = self._embeddings(step)
        embeds = self.model.embed_tokens(input_ids)
        rows = None
        deepstack: tuple[torch.Tensor, ...] = ()
        if step.spans:
            spans = sorted(step.spans, key=lambda s: s.step_row)  # DeepStack's features are taken in row order
            rows = torch.cat([torch.arange(s.step_row, s.step_row + s.num_rows) for s in spans]).to(self.device)
            values = torch.cat([embeddings[s.content_hash][s.embed_row : s.embed_row + s.num_rows] for s in spans])
            if values.ndim == 3:  # [rows, 1 + levels, hidden]: the embeddings, then each DeepStack level
                deepstack = tuple(level.to(embeds.dtype) for level in values[:, 1:].unbind(1))
                values = values[:, 0]
            embeds = embeds.index_copy(0, rows, values.to(embeds.dtype))
        positions = np.zeros((3, num_tokens), dtype=np.int64)
        positions[:, : step.positions.shape[1]] = step.positions
        host = torch.from_numpy(positions if self.processor.mrope else positions[:1])
        if self.device.type == "cuda":
            host = host.pin_memory()
        return ImageInputs(embeds, host.to(self.device, non_blocking=True), rows if deepstack else None, deepstack)

    def inputs(self, input_ids: torch.Tensor, step: StepImages, num_tokens: int) -> dict[str, Any]:
        """`step_inputs` as transformers' forward takes them (`ImageInputs.hf_kwargs`)."""
        return self.step_inputs(input_ids, step, num_tokens).hf_kwargs()

    def attention(self, attn: Any, step: StepImages, num_tokens: int) -> Any:
        """The step's attention metadata (attention_backend.AttentionMetadata), with `key_limits` [num_tokens]
        int32 on the device when a bidirectional image's rows see past themselves (padding rows: 0)."""
        if step.key_limits is None:
            return attn
        limits = np.zeros(num_tokens, dtype=np.int32)
        limits[: len(step.key_limits)] = step.key_limits
        return dataclasses.replace(attn, key_limits=torch.from_numpy(limits).to(self.device))

    def _embeddings(self, step: StepImages) -> dict[str, torch.Tensor]:
        """Each image the step's spans name: its embeddings [tokens, hidden] (DeepStack: [tokens, 1 + levels,
        hidden]), encoding the ones not cached in one
        batch through the vision tower. Held here for the step, whatever the cache evicts meanwhile."""
        held: dict[str, torch.Tensor] = {}
        missing: list[PromptImage] = []
        for content_hash, images in step.images.items():
            cached = self._cache.get(content_hash)
            if cached is None:
                missing.append(next((i for i in images if i.pixels), images[0]))
            else:
                self._cache.move_to_end(content_hash)
                held[content_hash] = cached
        if missing:
            for image, embeddings in zip(missing, self._encode(missing), strict=True):
                held[image.content_hash] = embeddings
                self._put(image.content_hash, embeddings)
        for content_hash, images in step.images.items():
            if content_hash in self._cache:
                for image in images:
                    image.pixels.clear()
        return held

    @property
    def encode_seconds(self) -> float:
        """The vision tower's time so far (its share of a run's step time, for profiles). On CUDA this waits for
        the runs queued: read it after a run, not in the step loop."""
        for start, end in self._events:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
        self._events.clear()
        return self._seconds

    def _encode(self, images: list[PromptImage]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        arrays = [self._pixels_of(image) for image in images]
        if arrays[0].ndim == 4:  # [1, 3, H, W] pictures: zero-padded to the batch's largest, as the processors do
            height, width = max(a.shape[2] for a in arrays), max(a.shape[3] for a in arrays)
            arrays = [np.pad(a, ((0, 0), (0, 0), (0, height - a.shape[2]), (0, width - a.shape[3]))) for a in arrays]
        pixels = torch.from_numpy(np.concatenate(arrays)).to(self.device)
        grids = None
        if images[0].grid is not None:
            grids = torch.tensor([_grid_values(i.grid) for i in images]).to(self.device)
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
            merged = self.model.encode_images(pixels, grids)
            events[1].record()
            self._events.append(events)
        else:
            merged = self.model.encode_images(pixels, grids)
            self._seconds += time.perf_counter() - t0
        self.num_encoded += len(images)
        counts = [image.num_tokens if image.layout is None else image.layout.count(self.processor.image_token_id) for image in images]
        features = torch.split(merged, counts)  # of [sum of the images' image tokens, hidden]
        return [self._region(image, rows) for image, rows in zip(images, features, strict=True)]

    def _region(self, image: PromptImage, features: torch.Tensor) -> torch.Tensor:
        """The rows of the image's region in the prompt: its features, between its layout's other tokens'
        embeddings (Pixtral's row breaks)."""
        if image.layout is None:
            return features
        ids = torch.tensor(image.layout, device=self.device)
        region = self.model.embed_tokens(ids).to(features.dtype)
        region[ids == self.processor.image_token_id] = features
        return region

    def _pixels_of(self, image: PromptImage) -> np.ndarray:
        if image.pixels:
            return image.pixels[0]
        encoded = self.processor.encode(image.image)
        assert encoded.grid == image.grid, f"image {image.content_hash[:12]}: its pixels made again differ in shape"
        return encoded.pixel_values

    def _put(self, content_hash: str, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        if size > self.cache_bytes:
            return  # used for this step only
        while self._num_bytes + size > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._num_bytes -= evicted.numel() * evicted.element_size()
        self._cache[content_hash] = embeddings
        self._num_bytes += size


def _grid_values(grid: ImageGrid | tuple[int, int] | None) -> list[int]:
    if isinstance(grid, ImageGrid):
        return [grid.t, grid.h, grid.w]
    assert grid is not None, "an image of a format with grids has none"
    return list(grid)
