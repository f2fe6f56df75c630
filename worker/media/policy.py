"""`MediaPolicy`: what a worker may read for a request's images (its flags), and `MediaError`, the one error a
bad image raises. Owns the defaults of those flags."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from schemas.limits import MAX_IMAGES_PER_REQUEST

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # OpenAI's bound on one image
DEFAULT_MAX_IMAGE_PIXELS = 2**25  # 33.5 million: a 300 dpi A3 scan; its RGB pixels take 100 MB
DEFAULT_FETCH_TIMEOUT_SECONDS = 10.0
MAX_REDIRECTS = 5


class MediaError(ValueError):
    """An image a request cannot have: undecodable, too large, not allowed, not fetched in time. `param` names
    its part as OpenAI names a body field (`messages[0].content[1].image_url.url`); the request fails alone,
    as an invalid request (a 400 in OpenAI's output)."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class MediaPolicy:
    """What the worker reads for images. By default only `data:` URLs: a local file needs
    `allowed_local_media_path` (vLLM's `--allowed-local-media-path`) and an http(s) URL a host listed in
    `allowed_media_domains` (vLLM's `--allowed-media-domains`; host names, matched exactly, no IP literals)."""

    allowed_local_media_path: str | None = None  # a directory; files under it by their real path only
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_seconds: float = DEFAULT_FETCH_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            root = os.path.realpath(self.allowed_local_media_path)
            if not os.path.isdir(root):
                raise ValueError(f"allowed local media path {self.allowed_local_media_path!r} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", root)
        domains = frozenset(d.strip().lower().rstrip(".") for d in self.allowed_media_domains)
        literals = sorted(d for d in domains if is_ip_literal(d))
        if literals:
            raise ValueError(f"allowed media domains are host names, not addresses: {', '.join(literals)}")
        if "" in domains:
            raise ValueError("an allowed media domain is empty")
        object.__setattr__(self, "allowed_media_domains", domains)
        if not 1 <= self.max_images_per_request <= MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"images per request is between 1 and {MAX_IMAGES_PER_REQUEST}")
        if self.max_image_bytes < 1 or self.max_image_pixels < 1 or self.fetch_timeout_seconds <= 0:
            raise ValueError("image byte, pixel and time limits are positive")
