"""One attention call per vision block for Qwen2.5-VL's and Qwen3-VL's towers (issue 50 item 6), and per layer for a
packed encoder embedding model (worker/embedding/packed_encoder.py).

transformers' Qwen-VL vision attention holds every image's patches in one packed sequence, cut by `cu_seqlens`
(each image in the full-attention blocks; each window of at most 64 patches in Qwen2.5-VL's windowed blocks). Under
sdpa or eager it splits q/k/v at those cuts and calls attention once per piece in a Python loop: a 1024x768 image is
~62 windows, so a step's tower made thousands of tiny calls (W6 on the H100: 93 ms an image, where its FLOPs need
under 10). Only an implementation whose name contains "flash" is handed the cuts themselves (`cu_seq_lens_q`,
`max_length_q`: transformers' `is_flash_attention_requested` tests the name, in 5.17 as in 5.25), hence this
function's name; it needs no flash-attn package. `packed_attention` scatters the pieces into a zero-padded
[pieces, heads, longest, head_dim] batch, runs one `scaled_dot_product_attention` with a key-padding mask (none
when every piece has the same length, so CUDA may take its flash kernel), and gathers the rows back in order.
torch's `varlen_attn` would skip the padding, but it runs on CUDA only, and the CPU tests are the exactness proof.

`use_packed_attention` sets it on a tower's config alone (the language model keeps its own attention); it is
assigned to the config rather than through `set_attn_implementation`, whose checks take a "flash" name for the
flash-attn package. Padding costs little where it is used: windows are <= 64 patches (a 1024x768 image's ~12%
padding) and a step's images are often alike in size; very unequal images in one step pad the full blocks to the
largest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# "flash" in the name: see the module docstring; registered by `use_packed_attention`
PACKED_ATTENTION = "cbq_flash_packed_sdpa"
_INDEX_CACHE_SIZE = 4  # a tower call passes two cut tensors (windows, whole images) to every block


class _Packing:
    """Where each packed row goes in the padded batch, and which padded keys are real, for one `cu_seqlens`."""

    def __init__(self, cu_seqlens: torch.Tensor, total: int, longest: int):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        self.num = lengths.numel()
        self.longest = longest
        device = cu_seqlens.device
        piece = torch.repeat_interleave(torch.arange(self.num, device=device), lengths, output_size=total)
        offset = torch.arange(total, device=device) - cu_seqlens[:-1].long()[piece]
        self.slot = piece * longest + offset  # [total]: the row's place in the [num * longest] padded rows
        # every piece as long as the longest fills the batch exactly: no mask, no host sync to find out
        self.mask = (
            None
            if self.num * longest == total
            else (torch.arange(longest, device=device) < lengths[:, None])[:, None, None, :]
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, total, dim] -> [num, heads, longest, dim], zero rows after each piece."""
        rows = x[0].transpose(0, 1)  # [total, heads, dim]
        padded = rows.new_zeros(self.num * self.longest, *rows.shape[1:])
        padded.index_copy_(0, self.slot, rows)
        return padded.view(self.num, self.longest, *rows.shape[1:]).transpose(1, 2)

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """[num, heads, longest, dim] -> [1, total, heads, dim], in the packed order."""
        rows = out.transpose(1, 2).reshape(self.num * self.longest, out.shape[1], out.shape[3])
        return rows[self.slot][None]


# The cut tensors a tower call made, held (so their ids stay theirs) with their packing: every block of the call
# reuses it instead of rebuilding the indices. Towers run in one thread (the step loop's); two at once would at
# worst build a packing twice.
_packings: dict[int, tuple[torch.Tensor, _Packing]] = {}


def _packing_for(cu_seqlens: torch.Tensor, total: int, longest: int | None) -> _Packing:
    cached = _packings.get(id(cu_seqlens))
    if cached is not None and cached[0] is cu_seqlens and cached[1].slot.numel() == total:
        return cached[1]
    # transformers passes the longest piece to flash-named implementations; a direct caller may not
    if longest is None:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    packing = _Packing(cu_seqlens, total, int(longest))
    if len(_packings) >= _INDEX_CACHE_SIZE:
        _packings.clear()
    _packings[id(cu_seqlens)] = (cu_seqlens, packing)
    return packing


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query`/`key`/`value` [1, heads, total, dim] hold the packed
    pieces `cu_seq_lens_q` cuts ([pieces + 1] offsets), each attending to itself alone, bidirectionally.
    Returns ([1, total, heads, dim], None), as transformers' sdpa and flash functions do."""
    if is_causal or attention_mask is not None:
        raise ValueError("packed vision attention is bidirectional within each piece, with no mask beside")
    if cu_seq_lens_q is None:  # one piece (a caller that passes no cuts)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2), None
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError("packed vision attention is self-attention: the keys' cuts are the queries'")
    packing = _packing_for(cu_seq_lens_q, query.shape[2], max_length_q)
    out = F.scaled_dot_product_attention(
        packing.pack(query),
        packing.pack(key),
        packing.pack(value),
        attn_mask=packing.mask,
        dropout_p=dropout,
        scale=scaling,
    )
    return packing.unpack(out), None


def register_packed_attention() -> None:
    """Make `packed_attention` transformers' attention implementation PACKED_ATTENTION (what a config names)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(vision_config: Any) -> None:
    """Run the tower whose config this is (every one of its attention modules reads it) on `packed_attention`."""
    register_packed_attention()
    vision_config._attn_implementation = PACKED_ATTENTION
