"""worker/media/qwen_vl.py on a tiny Qwen3-VL checkpoint (tests/fixtures/vision_checkpoints.py `build_qwen3_vl`):
the release's preprocessor_config.json (`Qwen2VLImageProcessorFast`, 16-pixel patches, pixel bounds as `size`) read
without AutoProcessor, image pads expanded per image at 32 pixels a merged token, M-RoPE positions equal to
transformers' Qwen3-VL `get_rope_index`, and `cbq run` answering an image line as `generate` does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from producer.cli import main
from tests.fixtures.vision_checkpoints import build_qwen3_vl
from tests.worker.media.conftest import data_url
from worker.media.qwen_vl import ImageGrid, QwenVLImages, mrope_positions

from .test_qwen_vl import picture, prompt_of
from .test_vision_run import chat_line, picture_png, reference_tokens

# Qwen3-VL-8B-Instruct's config.json (the text model's rotary in the legacy `rope_scaling` form) and
# preprocessor_config.json, as the release ships them: read without its weights.
RELEASE_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
RELEASE_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


def test_images_are_encoded_in_16_pixel_patches(checkpoint):
    vl = QwenVLImages(checkpoint.path)
    encoded = [
        vl.encode(picture((200, 140), 0)),
        vl.encode(picture((120, 300), 1)),
        vl.encode(picture((20, 20), 2)),
    ]
    # resized to 32-pixel multiples within the bounds: 4 to 64 merged tokens
    assert [e.grid for e in encoded] == [ImageGrid(1, 8, 12), ImageGrid(1, 18, 8), ImageGrid(1, 4, 4)]
    for e in encoded:
        assert e.pixel_values.shape == (e.grid.t * e.grid.h * e.grid.w, 3 * 2 * 16 * 16)
    ids = vl.expand(prompt_of(checkpoint, 3), [e.grid for e in encoded])
    assert ids.count(checkpoint.token_ids["<|image_pad|>"]) == 24 + 36 + 4


def test_the_release_files_are_read(tmp_path):
    from worker.engine.models.loader import _load_config, family_for

    (tmp_path / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(RELEASE_PREPROCESSOR))
    family, _ = family_for(_load_config(str(tmp_path)))  # interleaved M-RoPE is accepted, not refused
    assert family.name == "qwen3_vl" and family.vision is not None and family.vision.deepstack
    vl = QwenVLImages(tmp_path)
    encoded = vl.encode(picture((1024, 768), 0))
    assert encoded.grid == ImageGrid(1, 48, 64) and vl.num_tokens(encoded) == 768  # docs/input.md's count


def test_mrope_positions_equal_transformers(checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
    vl = QwenVLImages(checkpoint.path)
    encoded = [vl.encode(picture((200, 140), 0)), vl.encode(picture((120, 300), 1))]
    grids = [e.grid for e in encoded]
    ids = vl.expand(prompt_of(checkpoint, 2), grids)
    positions, delta = mrope_positions(ids, grids, vl.image_token_id, vl.merge_size)
    input_ids = torch.tensor([ids])
    expected, expected_delta = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == vl.image_token_id).int(),
        image_grid_thw=torch.tensor([[g.t, g.h, g.w] for g in grids]),
    )
    assert np.array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta.flatten()[0])


@pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own
def test_cbq_run_answers_an_image_line_as_generate_does(checkpoint, tmp_path):
    image, png = picture_png(0)
    lines = [
        chat_line(
            "image",
            [
                {"type": "text", "text": "Describe:"},
                {"type": "image_url", "image_url": {"url": data_url(png)}},
            ],
        ),
        chat_line("text", "Just words."),
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(source), "-o", str(out), "--format", "openai", "--model", str(checkpoint.path)]
    ran = CliRunner().invoke(
        main, [*args, "--device", "cpu", "--dtype", "float32", "--served-model-name", "qwen-vl"]
    )
    assert ran.exit_code == 0, ran.output
    responses = {
        line["custom_id"]: line["response"] for line in map(json.loads, out.read_text().splitlines())
    }
    assert {r["status_code"] for r in responses.values()} == {200}, responses

    expected, prompt_len = reference_tokens(
        checkpoint.path, image, "Describe:", "Qwen3VLForConditionalGeneration"
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    body = responses["image"]["body"]
    stop = {checkpoint.token_ids["<|im_end|>"], checkpoint.token_ids["<|endoftext|>"]}
    kept = expected[: next((i for i, t in enumerate(expected) if t in stop), len(expected))]
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(kept, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == prompt_len  # the image's tokens count
    assert responses["text"]["body"]["usage"]["prompt_tokens"] < prompt_len
