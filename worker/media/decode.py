"""Decoding an image's bytes with Pillow into RGB pixels (PNG, JPEG, WebP; a GIF's first frame), under the
pixel cap, which is checked from the header before any pixel is decoded."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from worker.media.policy import MediaError, MediaPolicy

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_image(param: str, data: bytes, policy: MediaPolicy) -> Image.Image:
    """`data` as an RGB image; MediaError(param, why) for anything Pillow cannot read whole."""
    try:
        with warnings.catch_warnings():  # the pixel cap below is this worker's; Pillow's own warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise MediaError(param, "the image is not a PNG, JPEG, WebP or GIF that can be read") from None
    except Image.DecompressionBombError:  # Pillow's own bound, far above the worker's default
        raise MediaError(param, f"the image has more pixels than this worker's {policy.max_image_pixels}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(param, f"the image is truncated or corrupt: {exc}") from None
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise MediaError(
            param, f"the image has {width}x{height} pixels, more than this worker's {policy.max_image_pixels}"
        )
    if width < 1 or height < 1:
        raise MediaError(param, f"the image is {width}x{height} pixels")
    try:
        image.seek(0)  # a GIF (or animated WebP): its first frame
        image.load()
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's truncated and corrupt data
        raise MediaError(param, f"the image is truncated or corrupt: {exc}") from None
