"""M-RoPE on the owned decoder (worker/engine/image_inputs.py): each token's cos/sin gathered from the model's 1-D
table equal transformers' multimodal rotary forward bit for bit, for Qwen2.5-VL's sections and Qwen3-VL's
interleaving at the releases' section sizes, and the other layout does not (so the test tells them apart)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.decoder import cos_sin_table
from worker.engine.families.spec import MRopeLayout
from worker.engine.image_inputs import mrope_axes, mrope_rope


def rotary(family: str):
    """transformers' text rotary module of the family, at its release's head size and sections."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

        parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        config = Qwen2_5_VLTextConfig(hidden_size=256, num_attention_heads=2, rope_parameters=parameters)
        return Qwen2_5_VLRotaryEmbedding(config), MRopeLayout.SECTIONS
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    parameters = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    config = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=parameters)
    return Qwen3VLTextRotaryEmbedding(config), MRopeLayout.INTERLEAVED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_tables_equal_transformers_rotary(family, dtype):
    module, layout = rotary(family)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 1000, (3, 1, 41), generator=generator)
    positions[:, :, :5] = torch.arange(5)  # text tokens: the three rows alike
    like = torch.zeros(1, dtype=dtype)
    cos, sin = module(like, positions)  # [1, T, 128]
    table = cos_sin_table(module.inv_freq, module.attention_scaling, 1024, like)
    axes = mrope_axes(layout, module.mrope_section, table[0].shape[-1])
    rows, step_rope = mrope_rope(positions[:, 0], [table, None, table], axes, torch.int32)
    assert rows.dtype == torch.int32 and torch.equal(rows, torch.arange(41, dtype=torch.int32))
    assert step_rope[1] is None and step_rope[0] is step_rope[2]  # a NoPE layer stays so; one table, one gather
    step_cos, step_sin = step_rope[0]
    assert torch.equal(step_cos, cos[0]) and torch.equal(step_sin, sin[0])
    assert torch.equal(step_cos[:5], table[0][:5])  # text rows: the 1-D table's, as text and decode steps read it
    other = MRopeLayout.INTERLEAVED if layout == MRopeLayout.SECTIONS else MRopeLayout.SECTIONS
    _, wrong = mrope_rope(positions[:, 0], [table], mrope_axes(other, module.mrope_section, 128), torch.int32)
    assert not torch.equal(wrong[0][0], cos[0])


def test_mrope_sections_must_split_the_rotary_frequencies():
    with pytest.raises(ValueError, match=r"mrope_section \[16, 24, 20\] does not split 64 rotary frequencies"):
        mrope_axes(MRopeLayout.SECTIONS, [16, 24, 20], 128)
