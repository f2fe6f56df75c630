"""Qwen-VL checkpoints' files, shaped like their releases, for random-weight models: the one place the benchmarks
(`bench vision`, W6) and the tests' fixtures (tests/fixtures/vision_checkpoints.py) take them from.

- Qwen's special tokens, a chat template that writes `<|vision_start|><|image_pad|><|vision_end|>` for each image
  part and the release's default system turn, and generation_config.json's fields (`QWEN_VL_FAMILY`).
- `QWEN2_5_VL_PREPROCESSOR`: Qwen2.5-VL-7B-Instruct's preprocessor_config.json (`Qwen2VLImageProcessor`, pixel
  bounds 56x56 to 14x14x4x16384, CLIP's mean and std): a 1024x768 picture becomes a 74x54 patch grid, 999 tokens.
- `QWEN2_5_VL_SHAPES`: the text and vision config fields of Qwen2.5-VL-7B-Instruct's config.json, and the tests'
  tiny shape. transformers' `Qwen2_5_VLConfig()` defaults differ from the 7B release (its text model is 72B's,
  its vision hidden size 3584 where the release's is 1280, tokens_per_second 4 where it is 2, rms_norm_eps 1e-5
  where it is 1e-6), so every field is written out.
- `write_qwen_vl_files`: config.json, generation_config.json, the tokenizer and preprocessor_config.json, no
  weights; the config it returns builds the model (`random_qwen2_5_vl` on a device; the fixtures save theirs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.bench.tokenizer_files import Family, train_tokenizer

QWEN_VL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip
QWEN_VL_TEMPLATE = (  # the release's shape: a default system turn, an image as its three tokens
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_VL_FAMILY = Family(
    "qwen2_5_vl",
    QWEN_VL_SPECIALS,
    bos=None,
    tokenizer_eos="<|im_end|>",
    config_eos="<|im_end|>",
    generation_eos=("<|im_end|>", "<|endoftext|>"),
    end_of_turn="<|im_end|>",
    chat_template=QWEN_VL_TEMPLATE,
    sampling={"do_sample": True, "temperature": 0.1, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05},
)
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json
QWEN2_5_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
# The tests' pixel bounds: 4 to 64 merged tokens an image, small enough for the CPU.
TINY_PREPROCESSOR = dict(QWEN2_5_VL_PREPROCESSOR, min_pixels=56 * 56, max_pixels=28 * 28 * 64)


@dataclass(frozen=True)
class QwenVLShape:
    """A Qwen2.5-VL shape: config fields of its text and vision models (the vocabulary size and special ids are
    the tokenizer's, filled in by `write_qwen_vl_files`; `vocab_size` here pads it up, as the releases' embedding
    matrices are), and its preprocessor_config.json."""

    text: dict[str, Any]
    vision: dict[str, Any]
    preprocessor: dict[str, Any]
    vocab_size: int | None = None  # None: the tokenizer's length rounded up to 64


QWEN2_5_VL_SHAPES: dict[str, QwenVLShape] = {
    # Qwen2.5-VL-7B-Instruct's config.json (random weights at transformers' init)
    "qwen2.5-vl-7b": QwenVLShape(
        text=dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            tie_word_embeddings=False,
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
        ),
        preprocessor=QWEN2_5_VL_PREPROCESSOR,
        vocab_size=152064,
    ),
    # the tests' fixture (tests/fixtures/vision_checkpoints.py build_qwen2_5_vl)
    "tiny": QwenVLShape(
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            initializer_range=0.25,  # the tiny presets' scale: diverse greedy text
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [2, 3, 3],
            },  # head_dim 16
            tie_word_embeddings=False,
        ),
        vision=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,  # the language model's hidden size
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,  # two merged tokens a side: the windows matter at these image sizes
            fullatt_block_indexes=[1, 3],
            tokens_per_second=2,
            initializer_range=0.25,  # so that images move the output as much as text does
        ),
        preprocessor=TINY_PREPROCESSOR,
    ),
}


def write_qwen_vl_files(
    path: Path,
    config_class: Any,
    text: dict[str, Any],
    vision: dict[str, Any],
    family: Family,
    preprocessor: dict[str, Any],
    vocab_size: int | None = None,
) -> tuple[Any, Any, dict[str, int]]:
    """A Qwen-VL checkpoint's files but its weights, in `path`: config.json (the whole config, with the tokenizer's
    vocabulary size, or `vocab_size`, and Qwen's vision token ids), generation_config.json, the tokenizer (a BPE
    trained here with Qwen's special tokens and `family`'s chat template) and preprocessor_config.json. Returns
    the config, the generation config and the special tokens' ids."""
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(family)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    text = dict(
        text,
        vocab_size=vocab_size or -(-len(tokenizer) // 64) * 64,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    generation = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids[t] for t in family.generation_eos],
        pad_token_id=ids["<|endoftext|>"],
        **family.sampling,
    )
    config.save_pretrained(path)
    generation.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return config, generation, ids


def random_qwen2_5_vl(shape: str, path: Path, device: Any, dtype: Any, seed: int = 0) -> Any:
    """The random-weight `Qwen2_5_VLForConditionalGeneration` of `shape`, built on `device` in `dtype` (a 7B model
    in bf16 is made on the GPU in seconds: no fp32 copy on the CPU, no weights written or read), its other files in
    `path` (which the engine's image processing reads: `name_or_path`)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = QWEN2_5_VL_SHAPES[shape]
    config, generation, _ = write_qwen_vl_files(
        path, Qwen2_5_VLConfig, spec.text, spec.vision, QWEN_VL_FAMILY, spec.preprocessor, spec.vocab_size
    )
    config._name_or_path = str(path)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config = generation
    return model.eval().requires_grad_(False)
