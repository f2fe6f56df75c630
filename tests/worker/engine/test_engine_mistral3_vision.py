"""Mistral Small 3.1 with images in the engine (families/mistral3.py, worker/media/pixtral.py, multimodal.py) on the
tiny release-shaped checkpoint (tests/fixtures/vision_checkpoints.py `build_mistral3`): in fp32 on the CPU, greedy
tokens equal `Mistral3ForConditionalGeneration.generate` on the inputs PixtralProcessor makes (the PIL image
processor pads the request's images into one batch; the text is expanded here by the processor's rule, since
PixtralProcessor itself cannot be imported without torchvision), sync and async, chunked prefill through an image
and its row breaks, and the prefix cache on and off, on both decoders ("hf" and the owned one, whose language model
is Mistral's with 1-D rotary: image rows as input embeddings)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.chat import ChatMessage
from tests.fixtures.vision_checkpoints import MISTRAL3_PROCESSOR, build_mistral3
from worker.engine.api import EngineImage, EngineRequest, FinishReason, SamplingParams
from worker.media.load import content_hash
from worker.media.pixtral import PixtralImages

from .test_engine_vision import DECODERS, engine

MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_mistral3(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint.path)


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def request(tokenizer, rid: str, text: str, images: list[Image.Image], after: str = "", **sampling) -> EngineRequest:
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "repetition_penalty": 1.0, **sampling}
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * len(images)
    if after:
        content.append({"type": "text", "text": after})
    message = ChatMessage.model_validate({"role": "user", "content": content}).for_template()
    ids = tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=False)
    return EngineRequest(
        rid, list(ids), SamplingParams(**sampling), images=tuple(EngineImage(content_hash(i), i) for i in images)
    )


def processor_inputs(checkpoint, tokenizer, req: EngineRequest) -> dict:
    """What PixtralProcessor gives for `req`: each [IMG] in the rendered text replaced by a row of [IMG] per row of
    merged patches, each row ended by [IMG_BREAK] and the last by [IMG_END], then tokenized."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    text = tokenizer.decode(req.prompt_ids)
    if not req.images:
        return {"input_ids": torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])}
    side = MISTRAL3_PROCESSOR["patch_size"] * MISTRAL3_PROCESSOR["spatial_merge_size"]
    images = PixtralImageProcessorPil.from_pretrained(checkpoint.path)(
        images=[image.image for image in req.images], patch_size=side, return_tensors="pt"
    )
    regions = []
    for height, width in images["image_sizes"].tolist():
        region = ("[IMG]" * (width // side) + "[IMG_BREAK]") * (height // side)
        regions.append(region.removesuffix("[IMG_BREAK]") + "[IMG_END]")
    pieces = text.split("[IMG]")
    expanded = pieces[0] + "".join(region + piece for region, piece in zip(regions, pieces[1:], strict=True))
    ids = torch.tensor([tokenizer(expanded, add_special_tokens=False)["input_ids"]])
    return {"input_ids": ids, "pixel_values": images["pixel_values"], "image_sizes": images["image_sizes"]}


def generate(checkpoint, tokenizer, model, req: EngineRequest) -> list[int]:
    inputs = processor_inputs(checkpoint, tokenizer, req)
    out = model.generate(
        **inputs,
        attention_mask=torch.ones_like(inputs["input_ids"]),
        max_new_tokens=req.sampling.max_new_tokens,
        do_sample=False,
        repetition_penalty=1.0,
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def mixed_requests(tokenizer) -> list[EngineRequest]:
    a, b, c = picture((100, 70), 0), picture((30, 64), 1), picture((64, 64), 2)
    return [
        request(tokenizer, "one", "describe the picture", [a]),
        request(tokenizer, "two", "compare", [b, c], after="which is brighter?"),
        request(tokenizer, "text", "no picture at all, just words", []),
        request(tokenizer, "again", "describe the picture", [a], max_new_tokens=5),
    ]


def test_expansion_equals_the_processors(checkpoint, tokenizer):
    images = PixtralImages(checkpoint.path)
    for req in mixed_requests(tokenizer):
        encoded = [images.encode(image.image) for image in req.images]
        expected = processor_inputs(checkpoint, tokenizer, req)["input_ids"][0].tolist()
        assert images.expand_encoded(req.prompt_ids, encoded) == expected, req.request_id
        if encoded:
            assert checkpoint.token_ids["[IMG_BREAK]"] in expected and checkpoint.token_ids["[IMG_END]"] in expected


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_images_equal_generate(checkpoint, tokenizer, reference, mode, decoder):
    reqs = mixed_requests(tokenizer)
    eng = engine(checkpoint, mode=mode, decoder=decoder)
    assert eng.accepts_images
    results = eng.generate(reqs)
    expected = [generate(checkpoint, tokenizer, reference, req) for req in reqs]
    assert expected[0] != expected[2]  # the picture shows in the output
    for req, result, tokens in zip(reqs, results, expected, strict=True):
        assert result.finish_reason != FinishReason.ERROR, result.error
        assert result.token_ids == tokens, req.request_id
    assert results[0].usage.prompt_tokens == processor_inputs(checkpoint, tokenizer, reqs[0])["input_ids"].shape[1]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunked_prefill_splits_inside_an_image(checkpoint, tokenizer, reference, mode, decoder):
    # 7 tokens a step: every image region (its rows and breaks) is cut by chunk boundaries
    reqs = mixed_requests(tokenizer)[:2]
    eng = engine(checkpoint, mode=mode, max_num_batched_tokens=7, enable_prefix_caching=False, decoder=decoder)
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(checkpoint, tokenizer, reference, req), req.request_id
    assert eng.runner.images is not None and eng.runner.images.num_encoded == 3


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_shares_an_image_and_never_matches_another(
    checkpoint, tokenizer, reference, prefix_caching, decoder
):
    a, b = picture((100, 70), 0), picture((100, 70), 9)
    text = "a long shared question about the picture, written out so that several blocks fill before it"
    first = request(tokenizer, "first", text, [a], after="and what else?")
    same = request(tokenizer, "same", text, [a], after="and what else?", max_new_tokens=6)
    other = request(tokenizer, "other", text, [b], after="and what else?")
    eng = engine(checkpoint, mode="sync", block_size=8, enable_prefix_caching=prefix_caching, decoder=decoder)
    expected = [generate(checkpoint, tokenizer, reference, r) for r in (first, same, other)]
    assert expected[0] != expected[2]
    got, cached = [], []
    for req in (first, same, other):
        (result,) = eng.generate([req])
        got.append(result.token_ids)
        cached.append(result.usage.cached_tokens)
    assert got == expected
    prompt = processor_inputs(checkpoint, tokenizer, first)["input_ids"][0].tolist()
    image_start = prompt.index(checkpoint.token_ids["[IMG]"])
    if prefix_caching:
        assert cached[1] >= len(prompt) - 8
        assert 0 < cached[2] <= image_start // 8 * 8
    else:
        assert cached == [0, 0, 0]


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "idefics3", "gemma3n", "pixtral"])
def test_a_vision_checkpoint_cbq_does_not_run_is_refused_naming_those_it_runs(tmp_path, model_type):
    import json

    from worker.engine.models import ModelLoadError, load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    message = str(info.value)
    assert f"model type {model_type!r} is not supported" in message and "\n" not in message
    assert all(name in message for name in ("qwen2_5_vl", "gemma3", "mistral3"))


def test_the_owned_decoder_reads_a_vision_model_through_its_whole(checkpoint):
    """decoder "auto" asks `unsupported_reason` on CUDA before it builds the owned decoder: a vision-language model
    loaded whole (no `model.rotary_emb` of its own: an AttributeError on an H100 once) is read through transformers'
    whole model, whose paths its family names (models/vision.py `family_root`)."""
    from worker.engine.decoder import OwnedDecoder, unsupported_reason
    from worker.engine.models import load_model

    model, _ = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
    assert unsupported_reason(model) is None
    decoder = OwnedDecoder(model, 64, use_triton=False)
    language_model = model.whole.model.language_model
    assert decoder.embed_weight.data_ptr() == language_model.embed_tokens.weight.data_ptr()
    assert decoder.lm_head is model.whole.lm_head.weight and decoder.mrope_axes is None  # Mistral: 1-D rotary



def test_pixtral_runs_a_steps_images_in_calls_of_bounded_patches(checkpoint, monkeypatch):
    """Pixtral attends over all of a call's patches under one block-diagonal mask, so a step's images go to its
    tower in runs of at most PIXTRAL_PATCHES_PER_CALL patches: the same embeddings as one call over all of them."""
    from worker.engine.models import load_model, vision

    model, _ = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
    side = model.vision_config.patch_size * 2  # the merged patch
    sizes = torch.tensor([[3 * side, 5 * side], [2 * side, 2 * side], [4 * side, 3 * side]])
    pixels = torch.randn(3, 3, 4 * side, 5 * side, generator=torch.Generator().manual_seed(0))
    whole = model.encode_images(pixels, sizes)
    assert model._pixtral_calls(sizes) == [slice(0, 3)]
    monkeypatch.setattr(vision, "PIXTRAL_PATCHES_PER_CALL", 64)  # patches 60, 16, 48: the first alone, then two
    assert model._pixtral_calls(sizes) == [slice(0, 1), slice(1, 3)]
    torch.testing.assert_close(model.encode_images(pixels, sizes), whole, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(vision, "PIXTRAL_PATCHES_PER_CALL", 1)  # one image a call, however large
    assert model._pixtral_calls(sizes) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    torch.testing.assert_close(model.encode_images(pixels, sizes), whole, rtol=1e-5, atol=1e-5)


def test_auto_takes_the_owned_decoder_for_a_vision_model_through_its_whole(checkpoint, monkeypatch):
    """`auto` on CUDA takes the owned decoder for a vision-language model as for a text one, asking the model, whose
    `config` is its language model's: a reason found through the whole model keeps it on transformers' layers."""
    from worker.engine import decoder
    from worker.engine.models import load_model

    model, _ = load_model(str(checkpoint.path), torch.device("cpu"), torch.float32)
    assert getattr(model.config, "vision_config", None) is None  # a check of the config alone would see a text model
    assert decoder._auto_owned(model)
    monkeypatch.setattr(decoder, "unsupported_reason", lambda m: "its vision tower's family says no" if m is model else None)
    assert not decoder._auto_owned(model)
