"""Prompt logprobs (vLLM's `prompt_logprobs`; OpenAI completions' `echo` with `logprobs`): each prompt token's
log-probability given the tokens before it, its rank and the top-k alternatives, computed in the prefill.

Owns the computation of a step's prompt rows (step.py's `PromptRows`, made by describe.py) on the device,
their host copy, the records a sequence keeps (`record`), and the bound on rows per step (`MAX_ROWS_PER_STEP`).

Which rows. The logits at position q give the distribution of token q + 1. A chunk computing positions
[start, end) of a sequence that wants prompt logprobs therefore gives rows q in [start, min(end, P - 1)), P the
prompt's length (position P - 1 is the sample row, as for any request). Those rows are appended to the step's
sample rows in `logits_indices`: only they go through the final norm and the LM head on top of the usual rows,
so other requests pay nothing, and a step without them runs as before. Chunked prefill needs nothing more:
each chunk gives the rows of its own positions.

Exactly once per position. A sequence records position p only when p is the next one it lacks
(`Sequence.prompt_logprobs`); a recompute after preemption computes some rows again and they are dropped. Rows
come from computed positions only, so a sequence that wants prompt logprobs never starts from cached blocks
past its recorded positions (`Scheduler._reusable_prefix`): a cached prefix is computed again for it (its
`cached_tokens` is 0), and the blocks it writes are shared with other requests as usual.

The distribution is the model's raw one (log_softmax of the logits, float32), as for output logprobs
(logprobs.py). Values come back on the D2H stream behind the step's own event: no extra sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .api import PromptLogprob
from .step import PromptRowGroup, PromptRows

# Prompt rows one step computes at most (the scheduler shortens chunks to fit): their logits are [rows, vocab]
# beside the sample rows', within the activation memory reserved for a step (kv_cache.ACTIVATION_RESERVE_BYTES).
MAX_ROWS_PER_STEP = 1024
# Rows put through log_softmax at once: bounds the float32 copy of the logits.
_SLICE_ROWS = 256


def rows_of_chunk(start: int, num_tokens: int, num_prompt: int, num_recorded: int) -> tuple[int, int]:
    """The positions [first, end) of a chunk computing [start, start + num_tokens) whose rows are needed:
    those scoring a prompt token (at most position P - 2) not recorded yet (`num_recorded` leading positions
    have their entry)."""
    return max(start, num_recorded - 1), min(start + num_tokens, num_prompt - 1)


@dataclass
class DeviceResults:
    """One step's prompt logprobs on the device (allocated on the compute stream, held until copied)."""

    chosen: torch.Tensor  # [M] float32: the scored token's logprob
    rank: torch.Tensor  # [M] int32: 1 + the number of tokens more likely than it
    top_values: torch.Tensor  # [M, K] float32
    top_ids: torch.Tensor  # [M, K] int32


def split_logits(logits: torch.Tensor, num_sample_rows: int, rows: PromptRows) -> tuple[torch.Tensor, DeviceResults]:
    """The step's logits were computed for its sample rows, then its prompt rows: the sample rows' logits (a
    view), and the prompt rows' results, computed on the device now."""
    assert logits.shape[0] == num_sample_rows + rows.num_rows, "one logits row per sample row and prompt row"
    targets = torch.tensor(rows.target_ids, dtype=torch.int64, pin_memory=logits.is_cuda)
    return logits[:num_sample_rows], compute(logits[num_sample_rows:], targets.to(logits.device, non_blocking=True),
                                             rows.num_top)  # fmt: skip


def compute(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> DeviceResults:
    """log_softmax of each row (float32, `_SLICE_ROWS` at a time): the target's logprob and rank, the top k."""
    num_rows = logits.shape[0]
    device = logits.device
    out = DeviceResults(
        torch.empty(num_rows, dtype=torch.float32, device=device),
        torch.empty(num_rows, dtype=torch.int32, device=device),
        torch.empty(num_rows, num_top, dtype=torch.float32, device=device),
        torch.empty(num_rows, num_top, dtype=torch.int32, device=device),
    )
    for s in range(0, num_rows, _SLICE_ROWS):
        e = min(s + _SLICE_ROWS, num_rows)
        logprobs = torch.log_softmax(logits[s:e].float(), dim=-1)
        chosen = logprobs.gather(1, targets[s:e, None])
        out.chosen[s:e] = chosen[:, 0]
        out.rank[s:e] = (logprobs > chosen).sum(dim=-1) + 1
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)
            out.top_values[s:e] = values
            out.top_ids[s:e] = ids
    return out


@dataclass
class HostResults:
    """A step's prompt logprobs on the host, readable once the step was waited for."""

    rows: PromptRows
    chosen: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    device: DeviceResults  # kept alive until the D2H copy is done

    def records(self) -> Iterator[tuple[PromptRowGroup, list[PromptLogprob]]]:
        """Per group of rows, its records in position order (each keeps its own number of alternatives)."""
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        targets = self.rows.target_ids
        i = 0
        for group in self.rows.groups:
            k = group.num_top
            yield group, [
                PromptLogprob(targets[r], chosen[r], rank[r], tuple(zip(ids[r][:k], values[r][:k], strict=True)))
                for r in range(i, i + group.num_rows)
            ]
            i += group.num_rows


def copy_to_host(rows: PromptRows, results: DeviceResults, non_blocking: bool) -> HostResults:
    """Queue the copy down (on the current stream); pinned buffers on CUDA, so it does not block."""

    def down(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=non_blocking)
        host.copy_(t, non_blocking=non_blocking)
        return host

    return HostResults(
        rows, down(results.chosen), down(results.rank), down(results.top_values), down(results.top_ids), results
    )


def record(known: list[PromptLogprob | None], first_position: int, entries: list[PromptLogprob]) -> None:
    """Append to a sequence's `known` entries (position i at index i) those of `entries` (positions
    `first_position`, ...) it lacks; positions it has already (a recompute) are dropped."""
    skip = len(known) - first_position
    assert skip >= 0, f"prompt logprobs: position {first_position} arrived before position {len(known)}"
    known.extend(entries[skip:])
