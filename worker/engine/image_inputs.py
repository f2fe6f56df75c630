"""A vision-language step's inputs to the language model, typed, for both decoders: the owned one (decoder.py) and
transformers' forward (`hf_kwargs`). Owns the decoder's side of images: the per-token rotary tables of M-RoPE and
the DeepStack add; multimodal.py's `ImageEncoder.step_inputs` makes the inputs.

M-RoPE (Qwen2.5-VL, Qwen3-VL): each rotary dimension d of a head rotates by one of the token's three positions
(temporal, height, width), the row `mrope_axes()[d]` picks (families/spec.py `MRopeLayout`). transformers computes
cos/sin of position x inv_freq in fp32 per row, then picks each dimension's row; the model's 1-D table holds the
same products at every position, so a token's cos/sin is gathered from it, dimension by dimension, bit-equal.
The decoder then reads the step's tables at rows 0..T-1 (`mrope_rope`): every rotary kernel reads a position only
as a table row, so the Triton kernels and the torch references take them unchanged. Only a step with image rows
needs this: outside an image the three rows are alike, so text and decode steps (and decode CUDA graphs) rotate
with row 0, which the batch builder writes as the step's positions (batch.py: a generated token's index + the
request's delta).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .families.spec import MRopeLayout

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [rows, D]


@dataclass(frozen=True)
class ImageInputs:
    """A step's inputs when image rows are in it, on the device; T (the positions') counts the step's padding rows."""

    embeds: torch.Tensor  # [T, hidden]: the token embeddings, each image row replaced by its encoder output
    positions: torch.Tensor  # [3, T] int64 M-RoPE positions, or [1, T] for 1-D rotary (padding rows: 0)
    # DeepStack (Qwen3-VL): the image rows in step order [R], and per level their features [R, hidden], added to
    # the output of decoder layer `level` at those rows. Empty without DeepStack.
    deepstack_rows: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def is_mrope(self) -> bool:
        return self.positions.shape[0] == 3

    def hf_kwargs(self) -> dict[str, Any]:
        """transformers' forward arguments (models/vision.py `VisionLanguageModel.forward`): `inputs_embeds`
        [1, T, hidden], `position_ids` ([3, 1, T] for M-RoPE, else [1, T]), and with DeepStack
        `visual_pos_masks` [1, T] and `deepstack_visual_embeds` (per level, the image rows' features in row
        order)."""
        out: dict[str, Any] = {
            "inputs_embeds": self.embeds[None],
            "position_ids": self.positions[:, None] if self.is_mrope else self.positions,
        }
        if self.deepstack:
            assert self.deepstack_rows is not None, "DeepStack features without their rows"
            mask = torch.zeros(1, self.positions.shape[1], dtype=torch.bool, device=self.embeds.device)
            mask[0, self.deepstack_rows] = True
            out["visual_pos_masks"] = mask
            out["deepstack_visual_embeds"] = list(self.deepstack)
        return out

    def add_deepstack(self, level: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Decoder layer `level`'s output, `residual + hidden` (the sum the next add+norm would make), with the
        level's features added at the image rows: in transformers' order (the layer's sum, then the features), so
        the next layer takes it as its residual stream's start (residual None). The caller checks the level
        exists; the gate refuses DeepStack where a post-norm or residual multiplier would change the sum."""
        assert self.deepstack_rows is not None, "DeepStack features without their rows"
        out = hidden if residual is None else residual + hidden
        rows = self.deepstack_rows
        return out.index_copy(0, rows, out[rows] + self.deepstack[level])


def mrope_axes(layout: MRopeLayout, sections: list[int] | tuple[int, ...], rotary_dim: int) -> torch.Tensor:
    """[rotary_dim] int64: the position row (0 temporal, 1 height, 2 width) each rotary dimension reads, as
    transformers' rotary modules recompose their frequencies (Qwen2.5-VL's `recomposition_frequencies`: one
    section after another; Qwen3-VL's: height and width take every third frequency from 1 and 2)."""
    half = rotary_dim // 2
    if sum(sections) != half or len(sections) != 3:
        raise ValueError(f"mrope_section {list(sections)} does not split {half} rotary frequencies in three")
    if layout == MRopeLayout.SECTIONS:
        axes = torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    else:
        axes = torch.zeros(half, dtype=torch.int64)
        for axis in (1, 2):
            axes[axis : 3 * sections[axis] : 3] = axis
    return torch.cat((axes, axes))


def mrope_rope(
    positions: torch.Tensor, layer_rope: list[Rope | None], axes: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, list[Rope | None]]:
    """The step's rotary for M-RoPE `positions` [3, T]: positions 0..T-1 (in `dtype`, the step's) and, per
    layer, (cos, sin) [T, D] whose row t is token t's, each dimension from the model's table at the position of
    its row (None stays None: a NoPE layer)."""
    num_tokens = positions.shape[1]
    rows = positions.index_select(0, axes).T.contiguous()  # [T, D]: each dimension's row (axes: on its device)
    tables: dict[int, Rope] = {}  # by table: layers that share one gather it once
    step_rope: list[Rope | None] = []
    for rope in layer_rope:
        if rope is None:
            step_rope.append(None)
            continue
        cos, sin = rope
        if id(cos) not in tables:
            assert cos.shape[-1] == rows.shape[1], "M-RoPE's sections span the head's rotary dimensions"
            tables[id(cos)] = (cos.gather(0, rows), sin.gather(0, rows))
        step_rope.append(tables[id(cos)])
    return torch.arange(num_tokens, device=positions.device, dtype=dtype), step_rope
