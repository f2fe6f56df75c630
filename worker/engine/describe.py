"""Plan -> description: the one place that reads live `Sequence` objects to make a `StepDescription`.

Owns nothing. The scheduler plans with sequences; the batch builder and the model runner read only the
description this module makes from a plan (step.py says what it holds and why).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .multimodal import step_images
from .prompt_logprobs import rows_of_chunk
from .scheduler import ScheduledChunk, StepPlan
from .sequence import Sequence
from .step import PenaltyRow, PromptRowGroup, PromptRows, SamplingExtras, StepDescription, TokenBan


def describe_step(
    plan: StepPlan,
    prev_rows: Mapping[Sequence, int],
    eos_token_ids: frozenset[int] = frozenset(),
    extras: bool = False,
    prompt_logprobs: bool = False,
    long_rope: bool = False,
    images: bool = False,
) -> tuple[StepDescription, dict[Sequence, int]]:
    """The description of `plan`, and each sampling sequence's output row in it (the next step's `prev_rows`).

    `prev_rows`: sequences whose newest token the step in flight still samples, with its output row there.
    `extras`: look for logprobs, penalties and masks (the engine says whether any unfinished sequence has one).
    `prompt_logprobs`: look for prompt rows (likewise; a decode-only step never has any).
    `long_rope`: the model runs longrope: say which sequences rotate with its long table.
    `images`: some unfinished sequence has images: their positions and image rows (multimodal.py)."""
    chunks = plan.chunks
    num_seqs = len(chunks)
    is_decode_only = plan.is_decode_only
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num_seqs)
    if is_decode_only:  # most steps: one token and one sample each
        q_lens = np.ones(num_seqs, dtype=np.int64)
        samples = np.ones(num_seqs, dtype=bool)
        sample_seqs = [c.seq for c in chunks]
    else:
        q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=num_seqs)
        samples = np.fromiter((c.samples for c in chunks), dtype=bool, count=num_seqs)
        sample_seqs = [c.seq for c in chunks if c.samples]
    # Token ids; a token still being sampled gets a placeholder and the row that samples it.
    # NOTE: this loop runs for every sequence of every step: a decode's one token is read without a slice.
    ids: list[int] = []
    carry_seqs: list[int] = []
    carry_rows: list[int] = []
    append = ids.append
    for b, c in enumerate(chunks):
        seq, start = c.seq, c.start
        prompt, output = seq.prompt_ids, seq.output_ids
        if c.num_tokens == 1:
            i = start - len(prompt)  # the token's index in the output, if it is an output token
            if i < 0:
                append(prompt[start])
            elif i < len(output):
                append(output[i])
            else:
                row = prev_rows.get(seq)
                assert i == len(output) and row is not None, (
                    f"{seq.request_id}: only a decode's single input token can be in flight, from the step in flight"
                )
                append(0)
                carry_seqs.append(b)
                carry_rows.append(row)
        else:
            end = start + c.num_tokens
            assert end <= len(prompt) + len(output), (
                f"{seq.request_id}: only a decode's single input token can be in flight"
            )
            ids.extend(seq.token_ids_slice(start, end))
    params = [seq.sampling for seq in sample_seqs]
    description = StepDescription(
        q_lens=q_lens,
        starts=starts,
        samples=samples,
        input_ids=ids,
        carry_seqs=carry_seqs,
        carry_rows=carry_rows,
        block_tables=[c.seq.block_table for c in chunks],
        is_decode_only=is_decode_only,
        temperature=[p.temperature for p in params],
        top_p=[p.top_p for p in params],
        top_k=[p.top_k for p in params],
        min_p=[p.min_p for p in params],
        seeds=[seq.seed for seq in sample_seqs],
        extras=sampling_extras(sample_seqs, eos_token_ids) if extras else None,
        prompt_rows=prompt_rows(chunks) if prompt_logprobs and not is_decode_only else None,
        long_rope=np.fromiter((c.seq.long_rope for c in chunks), dtype=bool, count=num_seqs) if long_rope else None,
        images=step_images((c.seq.images, c.start, c.num_tokens) for c in chunks) if images else None,
    )
    return description, {seq: row for row, seq in enumerate(sample_seqs)}


def prompt_rows(chunks: list[ScheduledChunk]) -> PromptRows | None:
    """The rows whose logits score prompt tokens of sequences that want prompt logprobs, or None if none."""
    token_indices: list[int] = []
    target_ids: list[int] = []
    groups: list[PromptRowGroup] = []
    offset = 0  # the chunk's first token among the step's
    for b, c in enumerate(chunks):
        seq = c.seq
        if seq.wants_prompt_logprobs:
            first, end = rows_of_chunk(c.start, c.num_tokens, len(seq.prompt_ids), len(seq.prompt_logprobs))
            if first < end:
                token_indices.extend(range(offset + first - c.start, offset + end - c.start))
                target_ids.extend(seq.prompt_ids[first + 1 : end + 1])
                num_top = seq.sampling.prompt_logprobs
                assert num_top is not None
                groups.append(PromptRowGroup(b, first + 1, end - first, num_top))
        offset += c.num_tokens
    return PromptRows(tuple(token_indices), tuple(target_ids), tuple(groups)) if groups else None


def sampling_extras(sample_seqs: list[Sequence], eos_token_ids: frozenset[int]) -> SamplingExtras | None:
    """What the sample rows ask beyond plain sampling, or None if nothing. Each sequence's scheduling already
    counted this step's sample in `num_inflight_samples`."""
    logprob_rows: list[int] = []
    num_top = 0
    mask_rows: list[int] = []
    penalty_rows: list[PenaltyRow] = []
    allowed: list[tuple[int, tuple[int, ...]]] = []
    bans: list[TokenBan] = []
    bias: list[tuple[int, int, float]] = []
    for row, seq in enumerate(sample_seqs):
        p = seq.sampling
        if not p.needs_extras:
            continue
        if p.logprobs is not None:
            logprob_rows.append(row)
            num_top = max(num_top, p.logprobs)
        if p.constraint is not None:
            mask_rows.append(row)
        if p.allowed_token_ids is not None:
            allowed.append((row, tuple(p.allowed_token_ids)))
        generated_before = seq.num_generated - 1  # the row samples generated token number `generated_before`
        if p.bad_words_token_ids:
            bans.extend(_bad_word_bans(row, seq, generated_before))
        if generated_before < p.min_tokens:  # stop tokens banned until min_tokens are out
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            bans.extend(TokenBan(row, token) for token in sorted(stop_ids))
        if p.logit_bias:
            bias.extend((row, int(token), float(value)) for token, value in p.logit_bias.items())
        if p.has_penalties:
            penalty_rows.append(_penalty_row(row, seq, generated_before))
    if not (logprob_rows or mask_rows or penalty_rows or allowed or bans or bias):
        return None
    return SamplingExtras(
        tuple(logprob_rows), num_top, tuple(mask_rows), tuple(penalty_rows), tuple(allowed), tuple(bans), tuple(bias)
    )


def _known_history(seq: Sequence, generated_before: int) -> list[int]:
    """The generated ids before the row's input token (which is the newest generated one, maybe in flight)."""
    history = seq.output_ids[: max(generated_before - 1, 0)]
    assert len(history) == max(generated_before - 1, 0), (
        f"{seq.request_id}: {generated_before} generated tokens but only {len(seq.output_ids)} known"
    )
    return history


def _penalty_row(row: int, seq: Sequence, generated_before: int) -> PenaltyRow:
    p = seq.sampling
    return PenaltyRow(
        row,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        tuple(_known_history(seq, generated_before)),
        generated_before >= 1,
        tuple(seq.prompt_ids) if p.repetition_penalty != 1.0 else (),
    )


def _bad_word_bans(row: int, seq: Sequence, generated_before: int) -> list[TokenBan]:
    """A bad word's last token is banned where the output so far ends with the rest of it. The newest output
    token may be in flight, so a word of two or more tokens is banned on the condition that the input token is
    its second-to-last (checked on the device); the tokens before that are checked here."""
    bans = []
    history = _known_history(seq, generated_before) if generated_before >= 1 else []
    for word in seq.sampling.bad_words_token_ids:
        if len(word) == 1:
            bans.append(TokenBan(row, word[0]))
            continue
        head = list(word[:-2])  # must end the known history; word[-2] must be the input token
        if generated_before >= len(word) - 1 and history[len(history) - len(head) :] == head:
            bans.append(TokenBan(row, word[-1], word[-2]))
    return bans
