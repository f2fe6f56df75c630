"""`cbq run` on the tiny Qwen2.5-VL checkpoint (tests/fixtures/vision_checkpoints.py) with OpenAI chat lines whose
image parts are data: URLs: the image line's answer is `generate`'s greedy one on the processor's inputs, its usage
counts the image's tokens in prompt_tokens, and a text line beside it runs as usual."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from producer.cli import main
from tests.fixtures.vision_checkpoints import build_qwen2_5_vl
from tests.worker.media.conftest import data_url
from worker.media.qwen_vl import QwenVLImages

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own

MAX_TOKENS = 8


def picture_png(seed: int) -> tuple[Image.Image, bytes]:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (70, 100, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, buffer.getvalue()


def chat_line(custom_id: str, content) -> dict:
    body = {
        "model": "qwen-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "repetition_penalty": 1.0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def reference_tokens(
    path, image: Image.Image, text: str, model_class: str = "Qwen2_5_VLForConditionalGeneration"
) -> tuple[list[int], int]:
    """generate's greedy tokens for one user turn of `text` then the image, and its prompt's length."""
    import transformers
    from transformers import AutoTokenizer

    model = getattr(transformers, model_class).from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    message = {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}
    ids = tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=False)
    vl = QwenVLImages(path)
    encoded = vl.encode(image)
    ids = vl.expand(list(ids), [encoded.grid])
    inputs = torch.tensor([ids])
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        pixel_values=torch.from_numpy(encoded.pixel_values),
        image_grid_thw=torch.tensor([[encoded.grid.t, encoded.grid.h, encoded.grid.w]]),
        mm_token_type_ids=(inputs == vl.image_token_id).int(),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        repetition_penalty=1.0,
    )
    return out[0, len(ids) :].tolist(), len(ids)


def test_cbq_run_answers_an_image_line_as_generate_does(tmp_path):
    checkpoint = build_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    image, png = picture_png(0)
    lines = [
        chat_line(
            "image",
            [{"type": "text", "text": "Describe:"}, {"type": "image_url", "image_url": {"url": data_url(png)}}],
        ),
        chat_line("text", "Just words."),
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(source), "-o", str(out), "--format", "openai", "--model", str(checkpoint.path)]
    ran = CliRunner().invoke(main, [*args, "--device", "cpu", "--dtype", "float32", "--served-model-name", "qwen-vl"])
    assert ran.exit_code == 0, ran.output
    responses = {line["custom_id"]: line["response"] for line in map(json.loads, out.read_text().splitlines())}
    assert {r["status_code"] for r in responses.values()} == {200}, responses

    expected, prompt_len = reference_tokens(checkpoint.path, image, "Describe:")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    body = responses["image"]["body"]
    stop = {checkpoint.token_ids["<|im_end|>"], checkpoint.token_ids["<|endoftext|>"]}
    kept = expected[: next((i for i, t in enumerate(expected) if t in stop), len(expected))]
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(kept, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == prompt_len  # the image's tokens count
    assert body["usage"]["completion_tokens"] == len(expected[: len(kept) + (len(kept) < len(expected))])
    assert responses["text"]["body"]["usage"]["prompt_tokens"] < prompt_len


def test_cbq_run_answers_a_responses_line_with_an_input_image(tmp_path):
    """A /v1/responses line's `input_image` (a data: URL, with `detail`) runs as the chat line's image_url part."""
    checkpoint = build_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    image, png = picture_png(0)
    body = {
        "model": "qwen-vl",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe:"},
                    {"type": "input_image", "image_url": data_url(png), "detail": "low"},
                ],
            }
        ],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "repetition_penalty": 1.0,
    }
    lines = [{"custom_id": "image", "method": "POST", "url": "/v1/responses", "body": body}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(source), "-o", str(out), "--format", "openai", "--model", str(checkpoint.path)]
    ran = CliRunner().invoke(main, [*args, "--device", "cpu", "--dtype", "float32", "--served-model-name", "qwen-vl"])
    assert ran.exit_code == 0, ran.output
    [line] = map(json.loads, out.read_text().splitlines())
    assert line["response"]["status_code"] == 200, line
    response = line["response"]["body"]

    expected, prompt_len = reference_tokens(checkpoint.path, image, "Describe:")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    stop = {checkpoint.token_ids["<|im_end|>"], checkpoint.token_ids["<|endoftext|>"]}
    kept = expected[: next((i for i, t in enumerate(expected) if t in stop), len(expected))]
    [message] = [item for item in response["output"] if item["type"] == "message"]
    assert message["content"][0]["text"] == tokenizer.decode(kept, skip_special_tokens=True)
    assert response["usage"]["input_tokens"] == prompt_len  # the image's tokens count


def test_cbq_run_takes_gemma3_images_unless_the_run_is_deterministic(tmp_path):
    """Either decoder takes a Gemma 3 4B-27B checkpoint's images (transformers' under auto off CUDA, the owned one);
    --deterministic runs its text alone and fails an image line alone, naming what takes images."""
    from tests.fixtures.vision_checkpoints import build_gemma3_vision

    checkpoint = build_gemma3_vision(tmp_path / "gemma3")
    _, png = picture_png(0)
    lines = [
        chat_line("image", [{"type": "text", "text": "Describe:"}, {"type": "image_url", "image_url": {"url": data_url(png)}}]),
        chat_line("text", "Just words."),
    ]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    statuses = {}
    for run in ("auto", "owned", "deterministic"):
        out = tmp_path / f"{run}.jsonl"
        args = ["run", str(source), "-o", str(out), "--format", "openai", "--model", str(checkpoint.path)]
        flags = ["--device", "cpu", "--dtype", "float32", "--served-model-name", "qwen-vl"]
        flags += ["--decoder", "owned", "--deterministic"] if run == "deterministic" else ["--decoder", run]
        ran = CliRunner().invoke(main, [*args, *flags])
        responses = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
        statuses[run] = {cid: line["response"]["status_code"] for cid, line in responses.items()}
        if run == "deterministic":
            assert ran.exit_code == 2, ran.output  # a request failed
            error = responses["image"]["response"]["body"]["error"]["message"]
            assert "takes text only: images run on qwen2_5_vl, gemma3" in error
        else:
            assert ran.exit_code == 0, ran.output
    assert statuses == {
        "auto": {"image": 200, "text": 200},
        "owned": {"image": 200, "text": 200},
        "deterministic": {"image": 400, "text": 200},
    }
