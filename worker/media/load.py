"""A request's images, from its chat's image parts to decoded, hashed pixels: the one entry point admission
calls. The count is checked before anything is fetched."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from schemas.media import ImageRef
from worker.engine.api import EngineImage
from worker.media.decode import decode_image
from worker.media.fetch import read_image_bytes
from worker.media.policy import MediaError, MediaPolicy


def content_hash(image: Image.Image) -> str:
    """A hash of the decoded pixels (mode and size included), so the same picture from two URLs or two lossless
    encodings shares its cached encoding and KV blocks, and two different pictures never do."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def load_images(refs: Sequence[ImageRef], policy: MediaPolicy) -> tuple[EngineImage, ...]:
    """Each referenced image read, decoded and hashed, in order; MediaError naming the first bad part."""
    if len(refs) > policy.max_images_per_request:
        raise MediaError(
            refs[policy.max_images_per_request].param,
            f"{len(refs)} images in one request; this worker takes at most {policy.max_images_per_request}",
        )
    images = []
    for ref in refs:
        image = decode_image(ref.param, read_image_bytes(ref.param, ref.url, policy), policy)
        images.append(EngineImage(content_hash=content_hash(image), image=image))
    return tuple(images)


# The model families whose images this cbq runs (model_type values); a text-only model's refusal names them.
IMAGE_MODEL_TYPES: tuple[str, ...] = ("qwen2_5_vl", "gemma3", "mistral3", "qwen3_vl")  # worker/engine/families/: those with `vision`


def text_only_refusal(model_name: str) -> str:
    runs = ", ".join(IMAGE_MODEL_TYPES) if IMAGE_MODEL_TYPES else "no model this cbq runs yet"
    return f"{model_name} takes text only: images run on {runs} (gemma3 unquantized, not under --deterministic)"


@dataclass(frozen=True)
class ImageAdmission:
    """What admission needs to turn a chat's image parts into the engine's images: the worker's policy, and
    whether its engine takes images at all (refused before anything is fetched when it does not)."""

    policy: MediaPolicy = MediaPolicy()
    accepts_images: bool = False
    model_name: str = "this worker's model"  # named in the refusal

    def images_of(self, refs: Sequence[ImageRef]) -> tuple[EngineImage, ...]:
        if refs and not self.accepts_images:
            raise MediaError(refs[0].param, text_only_refusal(self.model_name))
        return load_images(refs, self.policy) if refs else ()
