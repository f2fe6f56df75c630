"""Qwen3-VL's own tests (families/qwen3_vl.py, models/vision.py, multimodal.py), on the tiny release-shaped checkpoint
(tests/fixtures/vision_checkpoints.py `build_qwen3_vl`): the fixture's DeepStack levels and interleaved M-RoPE
sections both change `generate`'s output (so an engine that left either out fails test_engine_vision.py, whose
exactness tests run over this fixture too: sync and async, chunked prefill through an image, preemption, an evicted
embedding, the prefix cache on and off, both decoders), a prefix hit that ends inside an image, and DeepStack's
inputs at a chunk's image rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fixtures.vision_checkpoints import build_qwen3_vl
from worker.engine.api import EngineRequest
from worker.engine.multimodal import step_images
from worker.media.qwen_vl import QwenVLImages

from .test_engine_vision import DECODERS, engine, generate, picture, request


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()


def mixed_requests(checkpoint) -> list[EngineRequest]:
    # 24, 36 and 48 tokens (32-pixel merged patches)
    a, b, c = picture((200, 140), 0), picture((120, 300), 1), picture((240, 180), 2)
    return [
        request(checkpoint, "one", "describe the picture", [a]),
        request(checkpoint, "two", "compare", [b, c], after="which is brighter?"),
        request(checkpoint, "text", "no picture at all, just words", []),
        request(checkpoint, "again", "describe the picture", [a], max_new_tokens=6),
    ]


def grid_of(checkpoint, req: EngineRequest):
    return QwenVLImages(checkpoint.path).encode(req.images[0].image).grid


def test_fixture_exercises_deepstack_and_interleaved_mrope(checkpoint, reference):
    # the image's DeepStack features and the interleaving of M-RoPE's rows both move the greedy tokens
    reqs = mixed_requests(checkpoint)[:2]
    expected = [generate(checkpoint, reference, r) for r in reqs]
    assert reference.config.vision_config.deepstack_visual_indexes == [1, 2]
    mergers = reference.model.visual.deepstack_merger_list
    saved = [(m.linear_fc2.weight.clone(), m.linear_fc2.bias.clone()) for m in mergers]
    try:
        with torch.no_grad():
            for merger in mergers:
                merger.linear_fc2.weight.zero_()
                merger.linear_fc2.bias.zero_()
        assert [generate(checkpoint, reference, r) for r in reqs] != expected
    finally:
        with torch.no_grad():
            for merger, (weight, bias) in zip(mergers, saved, strict=True):
                merger.linear_fc2.weight.copy_(weight)
                merger.linear_fc2.bias.copy_(bias)
    rotary = reference.model.language_model.rotary_emb
    section = rotary.mrope_section
    try:
        rotary.mrope_section = [16, 0, 0]  # every frequency on the temporal row: M-RoPE without its h and w rows
        assert [generate(checkpoint, reference, r) for r in reqs] != expected
    finally:
        rotary.mrope_section = section
    assert [generate(checkpoint, reference, r) for r in reqs] == expected


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_prefix_hit_that_ends_inside_an_image(checkpoint, reference, decoder):
    # the two prompts share the text and the image (48 tokens) and part ways after it; with the image's end inside
    # a block, the second request's cached blocks end inside the image: its first chunk starts mid-image and takes
    # the image's embeddings and DeepStack rows from there
    a = picture((240, 180), 4)
    pad = QwenVLImages(checkpoint.path).image_token_id
    for text in ("look", "look here", "look at this", "look at this one", "now look at this one"):
        first = request(checkpoint, "first", text, [a], after="first question")
        pad_start = first.prompt_ids.index(pad)
        if (pad_start + 48) % 8 not in (0, 7):  # the block that holds the image's end is not shared whole
            break
    second = request(checkpoint, "second", text, [a], after="another, longer question about it")
    eng = engine(
        checkpoint, mode="sync", block_size=8, enable_prefix_caching=True, max_num_batched_tokens=5, decoder=decoder
    )
    (r1,) = eng.generate([first])
    (r2,) = eng.generate([second])
    assert pad_start < r2.usage.cached_tokens < pad_start + 48  # the hit ends inside the image
    assert r1.token_ids == generate(checkpoint, reference, first)
    assert r2.token_ids == generate(checkpoint, reference, second)


def test_deepstack_inputs_follow_the_image_rows(checkpoint):
    eng = engine(checkpoint, mode="sync")
    assert eng.runner.model.deepstack_levels == 2
    req = request(checkpoint, "one", "describe the picture", [picture((200, 140), 0)])
    prompt_ids, images = eng.image_prompts.prepare(req.prompt_ids, req.images)
    assert images is not None
    encoder = eng.runner.images
    start = images.images[0].start + 5  # a chunk that starts inside the image and ends after it
    end = images.images[0].start + images.images[0].num_tokens + 3
    step = step_images([(images, start, end - start)])
    ids = torch.tensor(prompt_ids[start:end])
    with torch.inference_mode():
        inputs = encoder.inputs(ids, step, end - start + 2)  # two padding rows
        whole = encoder._cache[images.images[0].content_hash]  # noqa: SLF001 - [tokens, 1 + levels, hidden]
    assert whole.shape == (24, 3, 64)
    mask = inputs["visual_pos_masks"]
    assert mask.shape == (1, end - start + 2) and mask[0].tolist() == [True] * 19 + [False] * 5
    levels = inputs["deepstack_visual_embeds"]
    assert len(levels) == 2 and all(torch.equal(level, whole[5:, i + 1]) for i, level in enumerate(levels))
    assert torch.equal(inputs["inputs_embeds"][0, :19], whole[5:, 0])
    assert inputs["position_ids"].shape == (3, 1, end - start + 2)
    assert np.array_equal(inputs["position_ids"][:, 0, : end - start].numpy(), images.positions[:, start:end])
