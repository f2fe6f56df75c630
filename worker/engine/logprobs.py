"""Logprobs: the sampled token's log-probability and the top-k alternatives (k <= 20), per output token.

Owns the pinned host buffers the values come back in (one set per IO slot, made at the first step that
asks for them), and the device computation.

The distribution is the model's raw one: log_softmax of the logits as the model produced them, before
the constraint mask, temperature, top-k and top-p. OpenAI and vLLM's default report this too. So a
token's logprob does not depend on how it was sampled, and a constrained token may have a low logprob.

Only the rows of requests that ask are computed, on the device, in the step's compute stream. The values
come back with the step's sampled ids on the D2H stream, behind the same event: there is no extra sync.
A step with no such rows does none of this work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .api import MAX_LOGPROBS, TokenLogprob


@dataclass
class LogprobRows:
    """Device results for one step, kept alive by the step handle until its D2H copy has finished."""

    rows: torch.Tensor  # [k] int64 sample rows, on the device
    raw: torch.Tensor  # [k, V] float32 logits of those rows, before any masking
    log_z: torch.Tensor  # [k] log-partition of each row
    num_top: int


def prepare(logits: torch.Tensor, rows: torch.Tensor, num_top: int) -> LogprobRows:
    """Take the raw rows before the constraint mask rewrites the logits in place."""
    raw = logits.index_select(0, rows).float()
    return LogprobRows(rows, raw, torch.logsumexp(raw, dim=-1), num_top)


class LogprobBuffers:
    """Pinned host buffers for one IO slot's logprobs."""

    def __init__(self, max_num_seqs: int, pin: bool):
        # Flat, so that a step's [k, K] block is one contiguous view (non-blocking D2H copies need that).
        self.chosen = torch.zeros(max_num_seqs, dtype=torch.float32, pin_memory=pin)
        self.top_values = torch.zeros(max_num_seqs * MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin)
        self.top_ids = torch.zeros(max_num_seqs * MAX_LOGPROBS, dtype=torch.int32, pin_memory=pin)


@dataclass
class StepLogprobs:
    """A step's logprobs on the host, readable once the step was waited for."""

    buffers: LogprobBuffers
    num_rows: int
    num_top: int
    device_tensors: tuple  # kept alive until the D2H copy is done (allocated on the compute stream)

    def to_records(self, tokens: list[int], num_top_per_row: list[int]) -> list[TokenLogprob]:
        """One record per computed row, in order; row i keeps its own `num_top_per_row[i]` alternatives."""
        n = self.num_rows * self.num_top
        chosen = self.buffers.chosen[: self.num_rows].tolist()
        values = self.buffers.top_values[:n].view(self.num_rows, self.num_top).tolist()
        ids = self.buffers.top_ids[:n].view(self.num_rows, self.num_top).tolist()
        return [
            TokenLogprob(tokens[i], chosen[i], tuple(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, k in enumerate(num_top_per_row)
        ]


def finish(lp: LogprobRows, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, after sampling: (chosen logprob [k], top values [k, K], top ids [k, K] int32)."""
    tokens = sampled.index_select(0, lp.rows).long()
    chosen = lp.raw.gather(1, tokens[:, None])[:, 0] - lp.log_z
    if lp.num_top:
        values, ids = lp.raw.topk(lp.num_top, dim=-1)
        return chosen, values - lp.log_z[:, None], ids.to(torch.int32)
    empty = chosen.new_zeros(chosen.shape[0], 0)
    return chosen, empty, empty.to(torch.int32)


def copy_to_host(
    buffers: LogprobBuffers, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor], non_blocking: bool
) -> StepLogprobs:
    chosen, values, ids = results
    k, num_top = values.shape
    buffers.chosen[:k].copy_(chosen, non_blocking=non_blocking)
    buffers.top_values[: k * num_top].view(k, num_top).copy_(values, non_blocking=non_blocking)
    buffers.top_ids[: k * num_top].view(k, num_top).copy_(ids, non_blocking=non_blocking)
    return StepLogprobs(buffers, k, num_top, results)
