"""schemas/media.py: OpenAI's image_url content parts in chat lines and bodies: the URL forms a line may name,
where each image sits, the per-request bound, and the messages a chat template receives."""

from __future__ import annotations

import json

import pytest

from schemas.errors import InvalidRequest
from schemas.limits import MAX_IMAGES_PER_REQUEST
from schemas.lines import parse_request_line
from schemas.media import ImageRef, image_refs

PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def image(url: str = PNG_URL, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def chat(*content, role: str = "user") -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": role, "content": list(content)}]}


def batch_line(body: dict) -> str:
    return json.dumps(
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", **body}}
    )


def refusal(line: dict | str) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(line if isinstance(line, str) else json.dumps(line), 4)
    return str(info.value)


def test_image_parts_keep_their_place_and_the_template_sees_image_placeholders():
    text = {"type": "text", "text": "What is this?"}
    for line in (json.dumps(chat(text, image(detail="high"), image("https://example.com/a.png"))),
                 batch_line(chat(text, image(detail="high"), image("https://example.com/a.png")))):  # fmt: skip
        parsed = parse_request_line(line, 4)
        assert image_refs(parsed.messages) == [
            ImageRef("messages[1].content[1].image_url.url", PNG_URL),
            ImageRef("messages[1].content[2].image_url.url", "https://example.com/a.png"),
        ]
        assert parsed.messages[1].for_template() == {
            "role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}, {"type": "image"}],
        }
    text_only = parse_request_line(json.dumps(chat(text, {"type": "text", "text": "Be exact."})), 4)
    assert text_only.messages[1].content == "What is this?\nBe exact."  # as before: no list without an image


def test_an_image_url_is_a_data_http_or_file_url():
    for url in ("https://example.com/a.png", "http://example.com/a", "file:///data/a.png", PNG_URL,
                "data:image/jpeg;name=a.jpg;base64,/9j/"):  # fmt: skip
        parse_request_line(json.dumps(chat(image(url))), 4)
    assert "an image url is a data: URL (base64), an http(s) URL or a file: URL" in refusal(chat(image("ftp://x/a")))
    assert "content[0].image_url.url: an image data URL is data:image/<type>;base64" in refusal(
        chat(image("data:text/html;base64,PGh0bWw+"))
    )
    assert "content[0].image_url.detail: Input should be 'auto', 'low' or 'high'" in refusal(chat(image(detail="max")))
    assert "content[0].image_url.size: Extra inputs are not permitted" in refusal(chat(image(size=3)))


def test_images_only_in_user_messages_and_at_most_the_bound_per_request():
    assert "messages[1]: only a user message may hold image_url parts" in refusal(chat(image(), role="assistant"))
    too_many = [image()] * (MAX_IMAGES_PER_REQUEST + 1)
    assert f"line 4: messages: {MAX_IMAGES_PER_REQUEST + 1} images in one request; at most {MAX_IMAGES_PER_REQUEST}" in refusal(
        chat(*too_many)
    )
    assert "line 4: body.messages: 17 images" in refusal(batch_line(chat(*too_many)))
    parse_request_line(json.dumps(chat(*too_many[:-1])), 4)
