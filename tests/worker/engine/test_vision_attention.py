"""The vision towers' packed attention (worker/engine/models/vision_attention.py): in fp32 on the CPU, Qwen2.5-VL's
and Qwen3-VL's towers give transformers' sdpa output for several images of different sizes in one call (windows
and whole images of unequal lengths: the padded keys masked), with one attention call per block, not one per piece;
the function alone against per-piece sdpa, with equal pieces (no mask) and unequal; the engine's model sets it
on the tower alone; on CUDA (a `gpu` test), the tower against sdpa in fp32 and bf16."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from tests.fixtures.vision_checkpoints import build_qwen2_5_vl, build_qwen3_vl
from worker.engine.models import vision_attention
from worker.engine.models.vision_attention import PACKED_ATTENTION, packed_attention, use_packed_attention
from worker.media.qwen_vl import QwenVLImages

SIZES = [(200, 120), (64, 64), (150, 260), (96, 200)]  # width, height: unequal grids and windows


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def checkpoint(request, tmp_path_factory):
    build = build_qwen2_5_vl if request.param == "qwen2_5_vl" else build_qwen3_vl
    return build(tmp_path_factory.mktemp(request.param))


def tower_and_inputs(checkpoint):
    from transformers import AutoModelForImageTextToText

    whole = AutoModelForImageTextToText.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
    processor = QwenVLImages(checkpoint.path)
    encoded = [processor.encode(picture(size, seed)) for seed, size in enumerate(SIZES)]
    pixels = torch.from_numpy(np.concatenate([e.pixel_values for e in encoded]))
    grids = torch.tensor([[e.grid.t, e.grid.h, e.grid.w] for e in encoded])
    return whole, pixels, grids


def test_tower_equals_sdpa(checkpoint, monkeypatch):
    whole, pixels, grids = tower_and_inputs(checkpoint)
    tower = whole.model.visual
    assert tower.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        expected = tower(pixels, grid_thw=grids)
    packed = copy.deepcopy(tower)
    use_packed_attention(packed.config)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["cu_seq_lens_q"])
        return packed_attention(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, counted)
    try:
        with torch.inference_mode():
            got = packed(pixels, grid_thw=grids)
    finally:
        AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    assert len(calls) == len(packed.blocks)  # one call a block, each with the pieces' cuts
    lengths = [(cu[1:] - cu[:-1]).tolist() for cu in calls]
    assert any(len(set(pieces)) > 1 for pieces in lengths), "the padded (masked) path went untested"
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    levels = getattr(expected, "deepstack_features", None) or []  # Qwen3-VL's, fed to the language model too
    assert len(levels) == (2 if "qwen3" in type(tower).__name__.lower() else 0)
    for mine, theirs in zip(got.deepstack_features if levels else [], levels, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [7, 1, 12, 3]])
def test_function_equals_per_piece_sdpa(lengths):
    generator = torch.Generator().manual_seed(0)
    heads, dim, total = 3, 8, sum(lengths)
    q, k, v = (torch.randn(1, heads, total, dim, generator=generator) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    got, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    pieces = [
        torch.nn.functional.scaled_dot_product_attention(*(x[:, :, a:b] for x in (q, k, v)), scale=0.3)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    ]
    expected = torch.cat(pieces, dim=2).transpose(1, 2)
    assert got.shape == (1, total, heads, dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    # the same cuts again: the cached packing, the same answer
    again, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert id(cu) in vision_attention._packings
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_refuses_what_it_does_not_do():
    x = torch.zeros(1, 1, 4, 2)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="bidirectional"):
        packed_attention(None, x, x, x, None, cu_seq_lens_q=cu, is_causal=True)
    with pytest.raises(ValueError, match="self-attention"):
        packed_attention(None, x, x, x, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())


def test_engine_model_sets_it_on_the_tower_alone(checkpoint):
    from worker.engine.models import family_for
    from worker.engine.models.vision import VisionLanguageModel

    whole, _, _ = tower_and_inputs(checkpoint)
    family = family_for(whole.config)[0]
    model = VisionLanguageModel(whole, family.vision)
    model.set_attn_implementation("sdpa")
    assert model.vision_tower.blocks[0].attn.config._attn_implementation == PACKED_ATTENTION
    assert whole.config.get_text_config()._attn_implementation == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tower_on_cuda_equals_sdpa(checkpoint, dtype):
    """On CUDA (benchmarks/run_gpu.sh visiongpu): the padded, masked windows take the memory-efficient kernel and
    equal-length pieces may take flash; fp32 as close as on the CPU, bf16 within its rounding."""
    whole, pixels, grids = tower_and_inputs(checkpoint)
    tower = whole.model.visual.to("cuda", dtype)
    pixels, grids = pixels.to("cuda", dtype), grids.cuda()
    with torch.inference_mode():
        expected = tower(pixels, grid_thw=grids).pooler_output.float()
        use_packed_attention(tower.config)
        got = tower(pixels, grid_thw=grids).pooler_output.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:
        assert ((got - expected).norm() / expected.norm()).item() < 2e-2
