"""worker/media/qwen_vl.py on a tiny Qwen2.5-VL checkpoint (tests/fixtures/vision_checkpoints.py): the image
processor built from the checkpoint's files (no AutoProcessor, no torchvision), image pads expanded per image,
M-RoPE positions equal to transformers' `get_rope_index`, and `generate` on these inputs: the reference an
engine's exactness test compares with (and the images change its output: the fixture's constant-init
parameters are randomized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.chat import ChatMessage
from tests.fixtures.vision_checkpoints import build_qwen2_5_vl
from worker.media.qwen_vl import ImageGrid, QwenVLImages, mrope_positions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def prompt_of(checkpoint, num_images: int) -> list[int]:
    from transformers import AutoTokenizer

    content = [{"type": "text", "text": "the answer is"}]
    content += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * num_images
    message = ChatMessage.model_validate({"role": "user", "content": content}).for_template()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    return list(tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=False))


def inputs_for(checkpoint, images: list[Image.Image]):
    vl = QwenVLImages(checkpoint.path)
    encoded = [vl.encode(image) for image in images]
    ids = vl.expand(prompt_of(checkpoint, len(images)), [e.grid for e in encoded])
    return vl, encoded, ids


def test_images_are_encoded_and_their_pads_expanded_per_image(checkpoint):
    vl, encoded, ids = inputs_for(checkpoint, [picture((100, 70), 0), picture((60, 150), 1)])
    assert [e.grid for e in encoded] == [ImageGrid(1, 4, 8), ImageGrid(1, 10, 4)]  # resized to 28-pixel multiples
    for e in encoded:
        assert e.pixel_values.shape == (e.grid.t * e.grid.h * e.grid.w, 3 * 2 * 14 * 14)
    pad = checkpoint.token_ids["<|image_pad|>"]
    assert ids.count(pad) == 8 + 10
    start, end = checkpoint.token_ids["<|vision_start|>"], checkpoint.token_ids["<|vision_end|>"]
    first = ids.index(start)
    assert ids[first + 1 : first + 10] == [pad] * 8 + [end]
    with pytest.raises(ValueError, match="wrote 2 image placeholders for 1 images"):
        vl.expand(prompt_of(checkpoint, 2), [encoded[0].grid])


def test_mrope_positions_equal_transformers(checkpoint, model):
    vl, encoded, ids = inputs_for(checkpoint, [picture((100, 70), 0), picture((60, 150), 1)])
    grids = [e.grid for e in encoded]
    positions, delta = mrope_positions(ids, grids, vl.image_token_id, vl.merge_size)
    input_ids = torch.tensor([ids])
    expected, expected_delta = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == vl.image_token_id).int(),
        image_grid_thw=torch.tensor([[g.t, g.h, g.w] for g in grids]),
    )
    assert np.array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta.flatten()[0])


def test_generate_on_these_inputs_reads_the_image(checkpoint, model):
    def greedy(image: Image.Image) -> list[int]:
        _, (e,), ids = inputs_for(checkpoint, [image])
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=torch.from_numpy(e.pixel_values),
            image_grid_thw=torch.tensor([[e.grid.t, e.grid.h, e.grid.w]]),
            mm_token_type_ids=(torch.tensor([ids]) == checkpoint.token_ids["<|image_pad|>"]).int(),
            max_new_tokens=8,
            do_sample=False,
        )
        return out[0, len(ids) :].tolist()

    first, again, other = greedy(picture((100, 70), 0)), greedy(picture((100, 70), 0)), greedy(picture((100, 70), 5))
    assert first == again and len(first) == 8
    assert first != other  # a different image, the same text: another output
