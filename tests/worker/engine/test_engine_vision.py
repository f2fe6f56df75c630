"""Qwen2.5-VL and Qwen3-VL with images in the engine (worker/engine/multimodal.py, models/vision.py), on their tiny
release-shaped checkpoints (tests/fixtures/vision_checkpoints.py): in fp32 on the CPU, greedy tokens equal the
transformers model's `generate` on the processor's inputs, sync and async, with chunked prefill through an image,
preemption, an evicted embedding, and the prefix cache on and off (a shared image and text prefix shares blocks; the
same text with another image does not), on both decoders: transformers' forward ("hf") and the owned decoder (image
rows as input embeddings, M-RoPE tables per token: image_inputs.py). The tests that hold for both families take the
`checkpoint` fixture over both; Qwen3-VL's own (DeepStack, a prefix hit inside an image) are in
test_engine_qwen3_vl.py, and the tests here that read one family's numbers pin Qwen2.5-VL (`QWEN2_5_ONLY`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.chat import ChatMessage
from tests.fixtures.vision_checkpoints import build_qwen2_5_vl, build_qwen3_vl
from worker.engine.api import EngineImage, EngineRequest, ErrorCode, FinishReason, SamplingParams
from worker.engine.engine import Engine
from worker.engine.multimodal import step_images
from worker.media.load import content_hash
from worker.media.qwen_vl import QwenVLImages

MAX_NEW = 10
DECODERS = ["hf", "owned"]  # the language model's forward: transformers' or the owned decoder (CPU: forced)


# family -> (fixture builder, transformers class, picture side scale): Qwen3-VL's merged patches are 32 pixels wide
# where Qwen2.5-VL's are 28, and its fixture's pictures are twice as large, for images of 24 tokens and more
FAMILIES = {
    "qwen2.5-vl": (build_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration", 1),
    "qwen3-vl": (build_qwen3_vl, "Qwen3VLForConditionalGeneration", 2),
}
QWEN2_5_ONLY = pytest.mark.parametrize("checkpoint", ["qwen2.5-vl"], indirect=True)
_FAMILY: dict[str, str] = {}  # checkpoint path -> its family (a key of FAMILIES)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    built = FAMILIES[request.param][0](tmp_path_factory.mktemp(request.param))
    _FAMILY[str(built.path)] = request.param
    return built


def reference_class(checkpoint):
    """The transformers class of the checkpoint's family (`FAMILIES`)."""
    import transformers

    return getattr(transformers, FAMILIES[_FAMILY[str(checkpoint.path)]][1])


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_class(checkpoint).from_pretrained(checkpoint.path, dtype=torch.float32).eval()


def sized(checkpoint, width: int, height: int) -> tuple[int, int]:
    """A picture size for Qwen2.5-VL's fixture, scaled to the checkpoint's family (`FAMILIES`; another module's
    fixture: unscaled)."""
    scale = FAMILIES[_FAMILY[str(checkpoint.path)]][2] if str(checkpoint.path) in _FAMILY else 1
    return width * scale, height * scale


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def chat_ids(checkpoint, text: str, num_images: int, after: str = "") -> list[int]:
    """The rendered chat's ids (one pad per image, as a worker's tokenizer gives the engine)."""
    from transformers import AutoTokenizer

    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * num_images
    if after:
        content.append({"type": "text", "text": after})
    message = ChatMessage.model_validate({"role": "user", "content": content}).for_template()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    return list(tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=False))


def request(checkpoint, rid: str, text: str, images: list[Image.Image], after: str = "", **sampling) -> EngineRequest:
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "repetition_penalty": 1.0, **sampling}
    return EngineRequest(
        rid,
        chat_ids(checkpoint, text, len(images), after),
        SamplingParams(**sampling),
        images=tuple(EngineImage(content_hash(image), image) for image in images),
    )


def generate(checkpoint, model, req: EngineRequest) -> list[int]:
    """transformers' greedy tokens on the processor's inputs for `req` (its eos ends them, as the engine's)."""
    vl = QwenVLImages(checkpoint.path)
    encoded = [vl.encode(image.image) for image in req.images]
    ids = vl.expand(req.prompt_ids, [e.grid for e in encoded])
    inputs = torch.tensor([ids])
    extra = {}
    if encoded:
        extra = dict(
            pixel_values=torch.from_numpy(np.concatenate([e.pixel_values for e in encoded])),
            image_grid_thw=torch.tensor([[e.grid.t, e.grid.h, e.grid.w] for e in encoded]),
            mm_token_type_ids=(inputs == vl.image_token_id).int(),
        )
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=req.sampling.max_new_tokens,
        min_new_tokens=req.sampling.min_tokens,
        do_sample=False,
        repetition_penalty=1.0,
        **extra,
    )
    return out[0, len(ids) :].tolist()


def engine(checkpoint, **config) -> Engine:
    """An fp32 CPU engine on the checkpoint; with `decoder` ("hf" or "owned"), asserts which one runs."""
    eng = Engine.from_model(str(checkpoint.path), device="cpu", dtype="float32", **config)
    if "decoder" in config:
        assert (eng.runner.decoder is not None) == (config["decoder"] == "owned")
    return eng


def mixed_requests(checkpoint) -> list[EngineRequest]:
    a, b, c = (picture(sized(checkpoint, *size), seed) for seed, size in enumerate(((100, 70), (60, 150), (120, 90))))
    return [
        request(checkpoint, "one", "describe the picture", [a]),
        request(checkpoint, "two", "compare", [b, c], after="which is brighter?"),
        request(checkpoint, "text", "no picture at all, just words", []),
        request(checkpoint, "again", "describe the picture", [a], max_new_tokens=6),
    ]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_images_equal_generate(checkpoint, reference, mode, decoder):
    reqs = mixed_requests(checkpoint)
    eng = engine(checkpoint, mode=mode, decoder=decoder)
    assert eng.accepts_images
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.finish_reason != FinishReason.ERROR, result.error
        assert result.token_ids == generate(checkpoint, reference, req), req.request_id
    # image tokens are prompt tokens: usage counts them (OpenAI does)
    expanded = QwenVLImages(checkpoint.path).expand(reqs[0].prompt_ids, [grid_of(checkpoint, reqs[0])])
    assert results[0].usage.prompt_tokens == len(expanded) > len(reqs[0].prompt_ids)


def grid_of(checkpoint, req: EngineRequest):
    """The grid of the request's first image, as the processor sizes it."""
    return QwenVLImages(checkpoint.path).encode(req.images[0].image).grid


def test_parallel_samples_share_the_images(checkpoint, reference):
    req = request(checkpoint, "pair", "describe the picture", [picture(sized(checkpoint, 100, 70), 3)])
    req.n = 2
    (result,) = engine(checkpoint, mode="async").generate([req])
    expected = generate(checkpoint, reference, req)
    assert [sample.token_ids for sample in result.samples] == [expected, expected]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunked_prefill_splits_inside_an_image(checkpoint, reference, mode, decoder):
    # 7 tokens a step: every image (8 and more tokens) is cut by at least one chunk boundary
    reqs = mixed_requests(checkpoint)[:2]
    eng = engine(checkpoint, mode=mode, max_num_batched_tokens=7, enable_prefix_caching=False, decoder=decoder)
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(checkpoint, reference, req), req.request_id
    assert eng.runner.images is not None and eng.runner.images.num_encoded == 3  # each image encoded once
    assert 0 < eng.runner.images.encode_seconds < eng.stats().busy_seconds  # the tower's share of the steps


@pytest.mark.parametrize("decoder", DECODERS)
def test_preemption_recomputes_the_images(checkpoint, reference, decoder):
    # each grows to ~80 tokens (10 blocks of 8) where the cache holds 15 blocks: the running ones preempt each other
    reqs = [
        request(checkpoint, f"r{i}", f"look {i}", [picture(sized(checkpoint, 100, 70), i)], max_new_tokens=24, min_tokens=24)
        for i in range(3)
    ]
    eng = engine(
        checkpoint, mode="async", num_kv_blocks=16, block_size=8, enable_prefix_caching=False, decoder=decoder
    )
    results = eng.generate(reqs)
    assert eng.stats().num_preemptions > 0
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(checkpoint, reference, req), req.request_id


def test_an_evicted_embedding_is_encoded_again(checkpoint, reference):
    reqs = mixed_requests(checkpoint)[:2]
    eng = engine(checkpoint, mode="sync", max_num_batched_tokens=7, enable_prefix_caching=False)
    assert eng.runner.images is not None
    eng.runner.images.cache_bytes = 1  # nothing fits: every step that needs an image encodes it
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(checkpoint, reference, req), req.request_id
    assert eng.runner.images.num_encoded > 3


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_shares_an_image_and_never_matches_another(checkpoint, reference, prefix_caching, decoder):
    size = sized(checkpoint, 100, 70)
    a, b = picture(size, 0), picture(size, 9)  # the same size: the same pads, another picture
    text = "a long shared question about the picture, written out so that several blocks fill before it"
    first = request(checkpoint, "first", text, [a], after="and what else?")
    same = request(checkpoint, "same", text, [a], after="and what else?", max_new_tokens=7)
    other = request(checkpoint, "other", text, [b], after="and what else?")
    assert first.prompt_ids == other.prompt_ids  # only the pictures differ
    eng = engine(checkpoint, mode="sync", block_size=8, enable_prefix_caching=prefix_caching, decoder=decoder)
    expected = [generate(checkpoint, reference, r) for r in (first, same, other)]
    assert expected[0] != expected[2]  # the picture shows in the output
    got = []
    cached = []
    for req in (first, same, other):  # one at a time: each finds the blocks the ones before left
        (result,) = eng.generate([req])
        got.append(result.token_ids)
        cached.append(result.usage.cached_tokens)
    assert got == expected
    if prefix_caching:
        prompt_len = len(QwenVLImages(checkpoint.path).expand(first.prompt_ids, [grid_of(checkpoint, first)]))
        pad_start = first.prompt_ids.index(QwenVLImages(checkpoint.path).image_token_id)
        assert cached[1] >= prompt_len - 8  # the image and the text after it: all but the last block
        assert 0 < cached[2] <= pad_start // 8 * 8  # the text before the image only
    else:
        assert cached == [0, 0, 0]


@QWEN2_5_ONLY
def test_bad_image_requests_fail_alone(checkpoint):
    eng = engine(checkpoint, mode="sync")
    good = request(checkpoint, "good", "describe", [picture((100, 70), 0)])
    missing = EngineRequest("missing", good.prompt_ids, good.sampling)  # a pad and no image
    extra = request(checkpoint, "extra", "describe", [picture((100, 70), 0)])
    extra.images = extra.images * 2  # two images, one pad
    thin = request(checkpoint, "thin", "describe", [Image.new("RGB", (2000, 5))])
    results = eng.generate([good, missing, extra, thin])
    assert results[0].finish_reason != FinishReason.ERROR
    assert "image placeholder" in results[1].error and "no images" in results[1].error
    assert "wrote 1 image placeholders for 2 images" in results[2].error
    assert "aspect ratio must be smaller than 200" in results[3].error  # the processor's own bound
    assert all(r.error_code == ErrorCode.INVALID_PROMPT for r in results[1:])


@QWEN2_5_ONLY
def test_decoder_choice_for_images(checkpoint):
    # "auto" keeps transformers' forward on the CPU (as for text models) and takes the owned decoder on CUDA
    # (test_engine_vision_gpu.py); neither takes a deterministic run's batch-invariant path with images
    assert engine(checkpoint, decoder="auto").runner.decoder is None
    with pytest.raises(ValueError, match="a vision-language model runs on one rank, not deterministic"):
        engine(checkpoint, decoder="owned", deterministic=True)


@QWEN2_5_ONLY
def test_pixels_are_dropped_once_cached_and_made_again_after_an_eviction(checkpoint):
    eng = engine(checkpoint, mode="sync")
    req = request(checkpoint, "one", "describe the picture", [picture((100, 70), 0)])
    prompt_ids, images = eng.image_prompts.prepare(req.prompt_ids, req.images)
    assert images is not None and images.images[0].pixels  # made at admission
    step = step_images([(images, 0, len(prompt_ids))])
    ids = torch.tensor(prompt_ids)
    encoder = eng.runner.images
    with torch.inference_mode():
        inputs = encoder.inputs(ids, step, len(prompt_ids))
        first, positions = inputs["inputs_embeds"], inputs["position_ids"]
        assert "deepstack_visual_embeds" not in inputs  # Qwen2.5-VL has no DeepStack
        assert not images.images[0].pixels  # its embeddings are cached: the request keeps its picture only
        encoder._cache.clear()  # noqa: SLF001 - as an eviction leaves it
        again = encoder.inputs(ids, step, len(prompt_ids))["inputs_embeds"]
    assert encoder.num_encoded == 2 and torch.equal(first, again)
    assert positions.shape == (3, 1, len(prompt_ids)) and torch.equal(positions[:, 0], torch.from_numpy(images.positions))
    # outside image tokens the three rows are alike: a step without image rows runs on row 0 (batch.py), graphs too
    is_text = np.asarray(prompt_ids) != eng.image_prompts.image_token_id
    assert (images.positions[:, is_text] == images.positions[0, is_text]).all()
    decode = step_images([(images, len(prompt_ids) + 4, 1)])
    assert decode is not None and not decode.spans
    assert (decode.positions == len(prompt_ids) + 4 + images.delta).all() and images.delta < 0
