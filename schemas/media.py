"""Image content parts of chat messages, as OpenAI's chat bodies give them. Owns the part shapes, which URLs
a line may name (checked at submit, before anything is fetched) and where each image sits in a request.

Submit reads no image: it checks a URL's form only. The worker fetches and decodes (`worker/media/`), under
its own flags (allowed local root, allowed domains, size and pixel caps), so a line fails there alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import AfterValidator, Field

from schemas.limits import MAX_IMAGE_URL_CHARS, MAX_IMAGES_PER_REQUEST
from schemas.strict import StrictModel

# data:<image mime>[;param=value...];base64,<payload>: the only data URLs an image part may carry.
DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)((?:;[A-Za-z0-9_.-]+=[^;,]*)*);base64,", re.ASCII)
URL_SCHEMES = ("data:", "http://", "https://", "file:")


def _image_url_form(url: str) -> str:
    lowered = url[:16].lower()
    if not lowered.startswith(URL_SCHEMES):
        raise ValueError("an image url is a data: URL (base64), an http(s) URL or a file: URL")
    if lowered.startswith("data:") and DATA_URL.match(url) is None:
        raise ValueError("an image data URL is data:image/<type>;base64,<payload>")
    return url


class ImageUrl(StrictModel):
    url: Annotated[str, Field(min_length=1, max_length=MAX_IMAGE_URL_CHARS), AfterValidator(_image_url_form)]
    # OpenAI's resolution hint. The open models have no such switch: their processor sizes every image
    # between its own pixel bounds, so the value is accepted and changes nothing (as in vLLM).
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: where it sits (`param`, as OpenAI names a body field) and its URL."""

    param: str  # e.g. "messages[0].content[1].image_url.url"
    url: str


class _HasParts(Protocol):
    @property
    def content(self) -> str | Sequence[Any] | None: ...


def image_refs(messages: Sequence[_HasParts] | None) -> list[ImageRef]:
    """The images of a chat in the order its template renders them."""
    refs = []
    for i, message in enumerate(messages or ()):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImageUrlPart):
                    refs.append(ImageRef(f"messages[{i}].content[{j}].image_url.url", part.image_url.url))
    return refs


def at_most_images(messages: list[Any]) -> list[Any]:
    """A request's messages under MAX_IMAGES_PER_REQUEST images (an AfterValidator of a messages field)."""
    num_images = len(image_refs(messages))
    if num_images > MAX_IMAGES_PER_REQUEST:
        raise ValueError(f"{num_images} images in one request; at most {MAX_IMAGES_PER_REQUEST}")
    return messages
