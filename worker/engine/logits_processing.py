"""A step's logits processing before sampling, in vLLM's order: allowed tokens, bans (bad words, min_tokens),
logit_bias, penalties; and the small host-to-device copies of the per-row values it reads.

Owns no state: the rows come from the step's `SamplingExtras` (step.py), the kernels from sampler.py, and each
row's input token from the step's IO slot on the device, so a token still being carried over counts too.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import IOSlot
from .sampler import apply_bans, apply_logit_bias, apply_penalties, keep_only
from .step import PenaltyRow, SamplingExtras


def process_logits(slot: IOSlot, extras: SamplingExtras, logits: torch.Tensor) -> None:
    """vLLM's order, in place: allowed tokens, bans (bad words, min_tokens), logit_bias, penalties."""
    device = logits.device
    if extras.allowed:
        allowed_rows = to_device([row for row, _ in extras.allowed], device)
        pairs = to_device([(row, i) for row, ids in extras.allowed for i in ids], device)
        keep_only(logits, allowed_rows, pairs[:, 0], pairs[:, 1])
    if extras.bans:
        bans = to_device([(b.row, b.token_id, b.required_input) for b in extras.bans], device)
        apply_bans(logits, bans[:, 0], bans[:, 1], bans[:, 2], input_ids_of_rows(slot, bans[:, 0]))
    if extras.bias:
        rows_ids = to_device([(row, token) for row, token, _ in extras.bias], device)
        values = to_device([value for _, _, value in extras.bias], device, torch.float32)
        apply_logit_bias(logits, rows_ids[:, 0], rows_ids[:, 1], values)
    if extras.penalty_rows:
        _apply_penalties(slot, extras.penalty_rows, logits)


def input_ids_of_rows(slot: IOSlot, rows: torch.Tensor) -> torch.Tensor:
    """Each sample row's input token (the step's gathered ids at its logits index: carried-over ones too)."""
    d = slot.dev
    return d["input_ids"][d["logits_indices"][rows].long()].long()


def _apply_penalties(slot: IOSlot, penalties: tuple[PenaltyRow, ...], logits: torch.Tensor) -> None:
    """Penalise `logits` in place. Each row's history is completed on the device with its input token, so a
    token still in flight counts too."""
    device = logits.device
    rows = to_device([p.row for p in penalties], device)
    history = _padded([p.history for p in penalties], device)
    generated = to_device([int(p.input_is_generated) for p in penalties], device).bool()
    history = torch.cat([history, torch.where(generated, input_ids_of_rows(slot, rows), -1)[:, None]], dim=1)
    weights = to_device([[p.presence, p.frequency, p.repetition] for p in penalties], device, torch.float32)
    prompts = None
    if any(p.repetition != 1.0 for p in penalties):
        prompts = _padded([p.prompt_ids for p in penalties], device)
    apply_penalties(logits, rows, history, weights[:, 0], weights[:, 1], weights[:, 2], prompts)


def _padded(rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """Id lists as one [len(rows), longest] device tensor, -1 where a row is shorter."""
    # NOTE: host time grows with the rows' lengths (1,000 rows of 500 tokens: ~7 ms a step, hidden behind
    # the GPU in async mode); numpy fills the padded rows ~5x faster than lists.
    padded = np.full((len(rows), max(1, max(map(len, rows)))), -1, dtype=np.int64)
    for i, ids in enumerate(rows):
        padded[i, : len(ids)] = ids
    host = torch.from_numpy(padded)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without blocking the host."""
    # NOTE: pinned through the caching host allocator, which keeps the block until the copy is done.
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
