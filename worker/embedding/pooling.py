"""Pooling a batch's last hidden states into one vector per input, as sentence-transformers' Pooling module does.

Owns the pooling modes' arithmetic. Inputs are padded on the right: row i's real tokens are 0..lengths[i]-1.
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
