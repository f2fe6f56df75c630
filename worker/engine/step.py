"""The step description: everything the model runner needs to build and run one step, as plain values.

Owns nothing: `StepDescription` is a message, made by `scheduler.describe_step` from a `StepPlan` (which
holds live `Sequence` objects) and read by the batch builder and the model runner, which never see a
sequence, the scheduler or the block manager. It is what a tensor-parallel rank 0 would send to the other
ranks: ids, counts, positions, block ids and sampling values, pickle-able as it is.

Sequences are numbered by their place in the step (b = 0 .. num_seqs - 1); sample rows (one per sequence
whose chunk reaches its end) by their place among those (r = 0 .. num_sample_rows - 1). A sequence whose
single input token is still being sampled by the previous step (async mode) names that step's output row
(`carry_rows`): the device fills its placeholder from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .multimodal import StepImages


@dataclass(frozen=True)
class PenaltyRow:
    """A sample row with penalties, and the ids they count. The row's input token is the newest generated one
    and may still be in flight (async): the host sends the ones before it and the device adds the input token
    (when `input_is_generated`; else the input token is the prompt's last)."""

    row: int
    presence: float
    frequency: float
    repetition: float  # 1.0: none
    history: tuple[int, ...]  # generated ids before the input token
    input_is_generated: bool
    prompt_ids: tuple[int, ...] = ()  # for the repetition penalty only (it counts prompt tokens too)


@dataclass(frozen=True)
class TokenBan:
    """Token `token_id` gets -inf in sample row `row`, if `required_input` is -1 or is the row's input token
    (a bad word whose prefix ends with the token still in flight)."""

    row: int
    token_id: int
    required_input: int = -1


@dataclass(frozen=True)
class SamplingExtras:
    """A step's sampling work beyond plain sampling, for the sample rows that ask for it."""

    logprob_rows: tuple[int, ...] = ()
    num_top_logprobs: int = 0  # the most any of those rows asked for
    mask_rows: tuple[int, ...] = ()  # constrained rows: sampling waits for their bitmask
    penalty_rows: tuple[PenaltyRow, ...] = ()
    # allowed_token_ids: (row, allowed ids); every other token of the row gets -inf
    allowed: tuple[tuple[int, tuple[int, ...]], ...] = ()
    bans: tuple[TokenBan, ...] = ()  # bad words and min_tokens' stop tokens
    bias: tuple[tuple[int, int, float], ...] = ()  # logit_bias: (row, token id, value added)

    @property
    def has_logit_processing(self) -> bool:
        return bool(self.penalty_rows or self.allowed or self.bans or self.bias)


@dataclass(frozen=True)
class PromptRowGroup:
    """The consecutive rows of one sequence of the step."""

    seq_index: int  # b: the sequence's place in the step
    first_position: int  # prompt position of the token the first row scores (>= 1)
    num_rows: int
    num_top: int  # alternatives this sequence asked for


@dataclass(frozen=True)
class PromptRows:
    """A step's prompt rows, as plain values (part of the step description; prompt_logprobs.py says which)."""

    token_indices: tuple[int, ...]  # each row's index among the step's computed tokens
    target_ids: tuple[int, ...]  # the token each row scores: the prompt's next token
    groups: tuple[PromptRowGroup, ...]

    @property
    def num_rows(self) -> int:
        return len(self.token_indices)

    @property
    def num_top(self) -> int:
        return max(g.num_top for g in self.groups)


@dataclass(frozen=True)
class StepDescription:
    """One step, as plain values (see the module docstring for the numbering)."""

    q_lens: np.ndarray  # [B] int64: tokens computed per sequence
    starts: np.ndarray  # [B] int64: position of each sequence's first computed token
    samples: np.ndarray  # [B] bool: the chunk reaches the sequence's end, so the step samples its next token
    input_ids: list[int]  # [sum(q_lens)] known token ids; 0 where `carry_rows` fills the token in
    carry_seqs: list[int]  # sequences whose single input token is output row `carry_rows[i]` of the previous step
    carry_rows: list[int]
    # NOTE: the block manager's own lists, not copies (a copy costs ~1 ms per 1,000 sequences a step); read when
    # the step is built. The batch builder knows an unchanged list by identity; pickling snapshots them.
    block_tables: list[list[int]]
    is_decode_only: bool
    # per sample row
    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    min_p: list[float]
    seeds: list[int]
    extras: SamplingExtras | None = None
    prompt_rows: PromptRows | None = None  # rows whose logits score prompt tokens (prompt_logprobs.py)
    # [B] bool, for a longrope model: the sequence rotates with the long table (Sequence.long_rope); None: none does.
    long_rope: np.ndarray | None = None
    # A vision-language model's step holding a sequence with images: M-RoPE positions and image rows (multimodal.py).
    images: StepImages | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_sample_rows(self) -> int:
        return len(self.seeds)

    def only(self, b: int) -> StepDescription:
        """Sequence `b` alone, as a step of its own (no extras): to find which sequence a step cannot hold."""
        first = int(self.q_lens[:b].sum())
        carry = [i for i, s in enumerate(self.carry_seqs) if s == b]
        row = int(self.samples[:b].sum())
        rows = slice(row, row + 1) if self.samples[b] else slice(0, 0)
        return StepDescription(
            self.q_lens[b : b + 1],
            self.starts[b : b + 1],
            self.samples[b : b + 1],
            self.input_ids[first : first + int(self.q_lens[b])],
            [0] * len(carry),
            [self.carry_rows[i] for i in carry],
            self.block_tables[b : b + 1],
            bool(self.q_lens[b] == 1 and self.samples[b]),
            self.temperature[rows],
            self.top_p[rows],
            self.top_k[rows],
            self.min_p[rows],
            self.seeds[rows],
            long_rope=None if self.long_rope is None else self.long_rope[b : b + 1],
        )
