"""worker/media/decode.py and load.py: Pillow decoding (PNG, JPEG, WebP, a GIF's first frame) into RGB, the
pixel cap before decoding, truncated or foreign data refused, the count checked before any fetch, and the
content hash of the pixels."""

from __future__ import annotations

import pytest

from schemas.media import ImageRef
from tests.worker.media.conftest import data_url, gif_two_frames, image_bytes
from worker.media.decode import decode_image
from worker.media.load import ImageAdmission, content_hash, load_images
from worker.media.policy import MediaError, MediaPolicy

PARAM = "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt):
    image = decode_image(PARAM, image_bytes(fmt, size=(7, 5)), MediaPolicy())
    assert (image.mode, image.size) == ("RGB", (7, 5))


def test_a_gif_gives_its_first_frame():
    image = decode_image(PARAM, gif_two_frames(), MediaPolicy())
    assert image.getpixel((0, 0)) == (255, 0, 0)


def test_undecodable_truncated_and_oversized_images_fail_naming_the_part():
    png = image_bytes(size=(64, 64))
    cases = {
        b"not an image at all": "is not a PNG, JPEG, WebP or GIF",
        image_bytes("BMP"): "is not a PNG, JPEG, WebP or GIF",  # a format Pillow reads, but not one taken
        png[: len(png) // 2]: "truncated or corrupt",
        image_bytes("JPEG", size=(64, 64))[:300]: "truncated or corrupt",
    }
    for data, message in cases.items():
        with pytest.raises(MediaError, match=message) as info:
            decode_image(PARAM, data, MediaPolicy())
        assert info.value.param == PARAM
    with pytest.raises(MediaError, match="64x64 pixels, more than this worker's 4095"):
        decode_image(PARAM, png, MediaPolicy(max_image_pixels=4095))


def test_too_many_images_fail_before_any_is_read():
    refs = [ImageRef(f"messages[0].content[{i}].image_url.url", "http://never.fetched/x.png") for i in range(3)]
    with pytest.raises(MediaError, match="3 images in one request; this worker takes at most 2") as info:
        load_images(refs, MediaPolicy(max_images_per_request=2))
    assert info.value.param == "messages[0].content[2].image_url.url"


def test_the_content_hash_is_of_the_pixels():
    png, webp = image_bytes("PNG"), image_bytes("WEBP", lossless=True)
    other = image_bytes("PNG", color=(200, 30, 41))
    refs = [ImageRef(f"p{i}", data_url(data)) for i, data in enumerate([png, webp, other])]
    first, lossless_twin, different = load_images(refs, MediaPolicy())
    assert first.content_hash == lossless_twin.content_hash == content_hash(first.image)
    assert first.content_hash != different.content_hash


def test_a_text_only_model_refuses_images_before_reading_them():
    refs = [ImageRef("messages[1].content[0].image_url.url", "http://never.fetched/x.png")]
    with pytest.raises(MediaError, match="tiny-llama takes text only: images run on") as info:
        ImageAdmission(MediaPolicy(), accepts_images=False, model_name="tiny-llama").images_of(refs)
    assert info.value.param == "messages[1].content[0].image_url.url"
    assert ImageAdmission().images_of([]) == ()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and whose pixel data is one byte: nothing to allocate for."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def test_a_huge_header_is_refused_before_any_pixel_is_decoded():
    for width, height in ((8000, 8000), (20000, 20000)):  # under Pillow's own bomb bound, and over it
        with pytest.raises(MediaError, match="pixels"):
            decode_image(PARAM, png_header_only(width, height), MediaPolicy())
