"""A text-only model refuses images: the offline LLM and the queue worker fail the line (a 400 naming the part
and the families that take images) before anything is fetched; the engine refuses an `EngineRequest` with
images too, should one reach it."""

from __future__ import annotations

import pytest

from tests.worker.media.conftest import image_bytes
from worker.engine.api import EngineImage, EngineRequest, FinishReason, SamplingParams
from worker.offline import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", device="cpu", max_model_len=64)


def test_a_text_only_model_fails_an_image_line_alone_without_fetching(llm, local_server):
    local_server.serve_bytes("/a.png", image_bytes())
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": local_server.url("/a.png")}}]
    image_chat, text_chat = [{"role": "user", "content": content}], [{"role": "user", "content": "hi"}]
    refused, ran = llm.chat([image_chat, text_chat], {"max_new_tokens": 2})
    assert (refused.finish_reason, refused.error_code, refused.error_param) == (
        "error", "invalid_value", "messages[0].content[1].image_url.url"
    )  # fmt: skip
    assert refused.error.startswith("tiny-llama takes text only: images run on")
    assert ran.finish_reason in ("stop", "length")
    assert local_server.hits == []


def test_the_engine_refuses_images_for_a_text_only_model(llm):
    engine = llm.engine
    assert engine.accepts_images is False
    picture = EngineImage(content_hash="0" * 64, image=None)
    request = EngineRequest("img", [1, 2, 3], SamplingParams(max_new_tokens=2), images=(picture,))
    engine.start()
    try:
        engine.add_request(request)
        (result,) = engine.get_results(timeout=30)
    finally:
        engine.shutdown()
    assert result.finish_reason == FinishReason.ERROR and "takes text only" in (result.error or "")
