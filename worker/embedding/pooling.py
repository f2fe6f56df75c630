"""Pooling a batch's last hidden states into one vector per input, as sentence-transformers' Pooling module does.

Owns the pooling modes' arithmetic, over two layouts of a batch's hidden states: padded (`pool`: inputs padded on the
right, row i's real tokens 0..lengths[i]-1; transformers' forward) and packed (`pool_packed`: the inputs laid end to
end in one row of tokens, input i's at cu_seqlens[i]:cu_seqlens[i+1]; the packed decoder forward, packed.py).
Sums are taken in fp32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from worker.embedding.checkpoint import PoolingMode


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """[batch, tokens, dim] hidden states, their [batch, tokens] 0/1 mask and [batch] lengths -> [batch, dim]."""
    if mode == "cls":
        return hidden[:, 0].float()
    if mode == "lasttoken":
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, lengths - 1].float()
    weights = mask.unsqueeze(-1).to(torch.float32)
    if mode == "max":
        return hidden.float().masked_fill(weights == 0, float("-inf")).max(dim=1).values
    summed = (hidden.float() * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    if mode == "mean":
        return summed / counts
    assert mode == "mean_sqrt_len_tokens", f"unknown pooling mode {mode}"
    return summed / counts.sqrt()


def packed_layout(batch_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's inputs laid end to end in one row, on the host (int64): each input's length [B], their start offsets
    cu_seqlens [B + 1], the input each token belongs to [T], and each token's position within its input [T]."""
    lengths = torch.tensor([len(ids) for ids in batch_ids], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(batch_ids) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    input_of_token = torch.repeat_interleave(torch.arange(len(batch_ids)), lengths)
    positions = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[input_of_token]
    return lengths, cu_seqlens, input_of_token, positions


def pool_packed(hidden: torch.Tensor, cu_seqlens: torch.Tensor, lengths: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """[T, dim] hidden states of B inputs laid end to end, their [B + 1] start offsets (int64) and [B] lengths ->
    [B, dim] fp32. Reads nothing on the host (no sync)."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    if mode == "cls":
        return hidden[starts].float()
    if mode == "lasttoken":
        return hidden[ends - 1].float()
    num_inputs = lengths.shape[0]
    input_of_token = torch.repeat_interleave(
        torch.arange(num_inputs, device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    index = input_of_token[:, None].expand(-1, hidden.shape[1])
    out = torch.zeros(num_inputs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if mode == "max":
        return out.scatter_reduce_(0, index, hidden.float(), reduce="amax", include_self=False)
    summed = out.index_add_(0, input_of_token, hidden.float())
    counts = lengths.to(torch.float32)[:, None]
    if mode == "mean":
        return summed / counts
    assert mode == "mean_sqrt_len_tokens", f"unknown pooling mode {mode}"
    return summed / counts.sqrt()
