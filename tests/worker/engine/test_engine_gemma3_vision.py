"""Gemma 3 with images in the engine (families/gemma3_vision.py, worker/media/gemma3.py, multimodal.py) on the tiny
release-shaped checkpoint (tests/fixtures/vision_checkpoints.py `build_gemma3_vision`): in fp32 on the CPU, greedy
tokens equal `Gemma3ForConditionalGeneration.generate` on `Gemma3Processor`'s inputs (its `token_type_ids`: an
image's tokens attend both ways in prefill), sync and async, with chunked prefill around images, preemption, and the
prefix cache on and off (a shared image shares blocks, a cached prefix may end inside an image; another image with
the same text does not match), on both decoders ("hf" and the owned one: the image rows as input embeddings, the
token rows' embedding scale from the model's own embedding module, the image's rows attending both ways through
the attention's key limits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.chat import ChatMessage
from tests.fixtures.vision_checkpoints import build_gemma3_vision
from worker.engine.api import EngineImage, EngineRequest, ErrorCode, FinishReason, SamplingParams
from worker.media.gemma3 import Gemma3Images
from worker.media.load import content_hash

from .test_engine_vision import DECODERS, engine
from .test_fused_kernels import _interpret, needs_triton

MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return make_processor(checkpoint)


def make_processor(checkpoint):
    """transformers' Gemma3Processor from the checkpoint's files (AutoProcessor would want torchvision)."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(checkpoint.path),
        tokenizer=AutoTokenizer.from_pretrained(checkpoint.path),
        image_seq_length=256,
    )


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def chat(text: str, num_images: int, after: str = "") -> list[dict]:
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * num_images
    if after:
        content.append({"type": "text", "text": after})
    return [ChatMessage.model_validate({"role": "user", "content": content}).for_template()]


def request(
    processor, rid: str, text: str, images: list[Image.Image], after: str = "", **sampling
) -> EngineRequest:
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "repetition_penalty": 1.0, **sampling}
    messages = chat(text, len(images), after)
    ids = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return EngineRequest(
        rid,
        list(ids),
        SamplingParams(**sampling),
        images=tuple(EngineImage(content_hash(image), image) for image in images),
    )


def processor_inputs(processor, req: EngineRequest) -> dict:
    text = processor.tokenizer.decode(req.prompt_ids)  # the rendered chat, as the template wrote it
    images = [image.image for image in req.images] or None
    return dict(processor(text=text, images=images, return_tensors="pt", add_special_tokens=False))


def generate(processor, model, req: EngineRequest, bidirectional: bool = True) -> list[int]:
    """transformers' greedy tokens on the processor's inputs for `req`."""
    inputs = processor_inputs(processor, req)
    if not bidirectional:
        inputs.pop("token_type_ids")
    out = model.generate(
        **inputs,
        max_new_tokens=req.sampling.max_new_tokens,
        min_new_tokens=req.sampling.min_tokens,
        do_sample=False,
        repetition_penalty=1.0,
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def mixed_requests(processor) -> list[EngineRequest]:
    a, b, c = picture((100, 70), 0), picture((60, 150), 1), picture((120, 90), 2)
    return [
        request(processor, "one", "describe the picture", [a]),
        request(processor, "two", "compare", [b, c], after="which is brighter?"),
        request(processor, "text", "no picture at all, just words", []),
        request(processor, "again", "describe the picture", [a], max_new_tokens=5),
        # the image first: the template's "user\n" and the image's "\n\n" are one newline run in the text
        request(processor, "lead", "", [c], after="what is this?"),
    ]


def test_expansion_equals_the_processors(checkpoint, processor):
    images = Gemma3Images(checkpoint.path)
    for req in mixed_requests(processor):
        encoded = [images.encode(image.image) for image in req.images]
        expected = processor_inputs(processor, req)
        assert images.expand(req.prompt_ids, encoded) == expected["input_ids"][0].tolist(), req.request_id
        if encoded:
            pixels = np.concatenate([e.pixel_values for e in encoded])
            assert np.array_equal(pixels, expected["pixel_values"].numpy())


def test_image_tokens_attend_both_ways_in_generate(processor, reference):
    # what the engine must match: transformers' mask over the image block changes the greedy tokens
    req = mixed_requests(processor)[0]
    assert generate(processor, reference, req) != generate(processor, reference, req, bidirectional=False)


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_images_equal_generate(checkpoint, processor, reference, mode, decoder):
    reqs = mixed_requests(processor)
    eng = engine(checkpoint, mode=mode, decoder=decoder)
    assert eng.accepts_images
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.finish_reason != FinishReason.ERROR, result.error
        assert result.token_ids == generate(processor, reference, req), req.request_id
    assert results[0].usage.prompt_tokens == processor_inputs(processor, reqs[0])["input_ids"].shape[1]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunked_prefill_never_cuts_an_image(checkpoint, processor, reference, mode, decoder):
    # 270 tokens a step: the two-image prompt (~540 tokens) and its neighbours are chunked around the images
    reqs = mixed_requests(processor)[:3]
    eng = engine(checkpoint, mode=mode, max_num_batched_tokens=270, enable_prefix_caching=False, decoder=decoder)
    results = eng.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(processor, reference, req), req.request_id
    assert eng.runner.images is not None and eng.runner.images.num_encoded == 3


def test_an_image_longer_than_the_token_budget_is_refused(checkpoint, processor):
    eng = engine(checkpoint, mode="sync", max_num_batched_tokens=200)
    image_req, text_req = mixed_requests(processor)[0], mixed_requests(processor)[2]
    results = eng.generate([image_req, text_req])
    assert results[0].error_code == ErrorCode.INVALID_PROMPT
    assert "an image takes 256 tokens, more than the step's token budget" in results[0].error
    assert results[1].finish_reason != FinishReason.ERROR


@pytest.mark.parametrize("decoder", DECODERS)
def test_preemption_recomputes_the_images(checkpoint, processor, reference, decoder):
    reqs = [
        request(processor, f"r{i}", f"look {i}", [picture((100, 70), i)], max_new_tokens=48, min_tokens=48)
        for i in range(2)
    ]
    # each prompt (281 tokens) takes 18 blocks of 16 and grows to 21: 37 blocks admit both, not both whole
    eng = engine(
        checkpoint, mode="async", num_kv_blocks=38, block_size=16, enable_prefix_caching=False, decoder=decoder
    )
    results = eng.generate(reqs)
    assert eng.stats().num_preemptions > 0
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate(processor, reference, req), req.request_id


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize(("prefix_caching", "block_size"), [(True, 16), (True, 128), (False, 16)])
def test_prefix_cache_shares_an_image_and_never_matches_another(
    checkpoint, processor, reference, prefix_caching, block_size, decoder
):
    a, b = picture((100, 70), 0), picture((100, 70), 9)
    text = "a long shared question about the picture"
    first = request(processor, "first", text, [a], after="and what else?")
    same = request(processor, "same", text, [a], after="and what else?", max_new_tokens=6)
    other = request(processor, "other", text, [b], after="and what else?")
    assert first.prompt_ids == other.prompt_ids
    eng = engine(checkpoint, mode="sync", block_size=block_size, enable_prefix_caching=prefix_caching, decoder=decoder)
    expected = [generate(processor, reference, r) for r in (first, same, other)]
    assert expected[0] != expected[2]
    got, cached = [], []
    for req in (first, same, other):
        (result,) = eng.generate([req])
        got.append(result.token_ids)
        cached.append(result.usage.cached_tokens)
    assert got == expected
    prompt = processor_inputs(processor, first)["input_ids"][0].tolist()
    soft = checkpoint.token_ids["<image_soft_token>"]
    image_start, image_end = prompt.index(soft), len(prompt) - prompt[::-1].index(soft)
    if not prefix_caching:
        assert cached == [0, 0, 0]
    elif block_size == 16:
        assert cached[1] >= len(prompt) - 16
        assert 0 < cached[2] <= image_start // 16 * 16
    else:  # the cached prefix ends inside the image: the rest of it is computed whole
        assert image_start < cached[1] < image_end
        assert cached[2] <= image_start


def test_a_deterministic_run_takes_the_text_alone(checkpoint, processor):
    # the batch-invariant path takes no images: the checkpoint's language model loads alone (families/gemma3.py)
    eng = engine(checkpoint, decoder="owned", deterministic=True)
    assert not eng.accepts_images
    text = mixed_requests(processor)[2]
    image = mixed_requests(processor)[0]
    results = eng.generate([text, image])
    assert results[0].finish_reason != FinishReason.ERROR
    assert "takes text only" in results[1].error


def test_a_sliding_window_shorter_than_an_image_is_refused(checkpoint, tmp_path):
    import json
    import shutil

    folder = tmp_path / "short_window"
    shutil.copytree(checkpoint.path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sliding_window"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a sliding window of 32 is shorter than an image's 256 tokens"):
        Gemma3Images(folder)


def test_expansion_joins_newline_runs_as_the_processors_text(checkpoint, tmp_path):
    """With tokens for runs of newlines (Gemma's vocabulary has them), the image's "\\n\\n" and the newlines the
    template wrote next to `<start_of_image>` tokenize as one run, as in the processor's expanded text."""
    import shutil

    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = tmp_path / "newline_tokens"
    shutil.copytree(checkpoint.path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["\n\n", "\n\n\n", "\n\n\n\n"])
    tokenizer.save_pretrained(folder)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(folder), tokenizer=tokenizer, image_seq_length=256
    )
    images = Gemma3Images(folder)
    newline_runs = {tokenizer.convert_tokens_to_ids(t) for t in ("\n\n", "\n\n\n", "\n\n\n\n")}
    for req in mixed_requests(processor):
        if not req.images:
            continue
        expected = processor_inputs(processor, req)["input_ids"][0].tolist()
        assert newline_runs & set(expected)
        got = images.expand(req.prompt_ids, [images.encode(image.image) for image in req.images])
        assert got == expected, req.request_id


@pytest.mark.parametrize("block_size", [16, 128])
def test_parallel_samples_share_the_images(checkpoint, processor, reference, block_size):
    # the follower computes from the leader's last full prompt block: with 128 that block ends inside the image
    req = request(processor, "pair", "describe the picture", [picture((100, 70), 3)])
    req.n = 2
    (result,) = engine(checkpoint, mode="async", block_size=block_size).generate([req])
    expected = generate(processor, reference, req)
    assert [sample.token_ids for sample in result.samples] == [expected, expected]



# The engine on the Triton attention kernels (in Triton's interpreter on the CPU; on CUDA they are the default): an
# image's rows attend both ways through the prefill kernel's key limits (kernels/attention.py `HAS_LIMITS`), where
# they used to fall back to the torch reference. A subprocess, since TRITON_INTERPRET must be set before triton loads.
TRITON_KEY_LIMITS_CHECK = """
import pathlib, tempfile
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
_patch_triton_interpreter()
from tests.fixtures.vision_checkpoints import build_gemma3_vision
from tests.worker.engine import test_engine_gemma3_vision as g
from worker.engine import attention
from worker.engine.engine import Engine
from transformers import Gemma3ForConditionalGeneration

checkpoint = build_gemma3_vision(pathlib.Path(tempfile.mkdtemp()))
processor = g.make_processor(checkpoint)
reference = Gemma3ForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
reqs = g.mixed_requests(processor)[:2]  # one image; two images in one prompt
expected = [g.generate(processor, reference, r) for r in reqs]
calls = []
reference_attention = attention.paged_attention_ref
attention.paged_attention_ref = lambda *a, **k: calls.append(1) or reference_attention(*a, **k)
engine = Engine.from_model(str(checkpoint.path), device="cpu", dtype="float32", attention_backend="triton", decoder="hf")
got = [r.token_ids for r in engine.generate(reqs)]
assert got == expected, (got, expected)
assert not calls, "an image step fell back to the torch reference"
print("gemma 3 images on the triton kernels equal generate")
"""


@needs_triton
def test_images_on_the_triton_kernels_equal_generate_in_the_interpreter():
    _interpret(TRITON_KEY_LIMITS_CHECK, "gemma 3 images on the triton kernels equal generate")
