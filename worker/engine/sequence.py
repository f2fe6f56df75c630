"""`Sequence`: the one piece of state shared by the engine's owners. Each owner changes only its fields:

- scheduler: `status`, `num_computed_tokens`, `num_inflight_samples`, `num_cached_tokens`, `long_rope`
- block manager: `block_table`, `block_hashes`, `num_committed_blocks`
- engine (when a step's tokens arrive): `output_ids`, `output_logprobs`, `prompt_logprobs`, `matcher`,
  `finish_reason`, timestamps, accounting counters
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .api import FinishReason, PromptLogprob, ResolvedSampling, TokenLogprob

if TYPE_CHECKING:
    from .multimodal import SequenceImages


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: ResolvedSampling  # every default filled in at admission
    seed: int  # the sample's random stream is a function of (seed, position) only
    sample_index: int = 0  # which of the request's n parallel samples this is
    # Mixed into the root of the block hash chain: anything besides the token ids that changes the K/V
    # (an adapter id, say). Empty today.
    kv_namespace: bytes = b""
    # A vision-language model's request with images: its images, their pads' places and the prompt's M-RoPE
    # positions (multimodal.py; shared by the request's samples). The block hashes mix in its images' content.
    images: SequenceImages | None = None
    arrival_time: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when sampling.logprobs is set
    # When `wants_prompt_logprobs`: the prompt's leading positions whose entry is known, [None] at admission
    # (the first token has none). Positions are recorded once each, in order (prompt_logprobs.py).
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    matcher: Any = None  # grammar matcher (grammar.py) when sampling.constraint is set
    status: SeqStatus = SeqStatus.WAITING
    # Tokens whose K/V are in the cache or will be written by steps already launched.
    num_computed_tokens: int = 0
    # Tokens sampled by launched steps whose values the host does not know yet (async: at most 1-2).
    num_inflight_samples: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hash chain of the leading full blocks of the known tokens (a memo: content-derived, survives preemption).
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of `block_table` whose K/V is known written (processed steps, cache hits, forks).
    num_committed_blocks: int = 0
    finish_reason: FinishReason | None = None
    # A longrope model's sequence longer than its original context: its K/V rotate with the long factors (the
    # scheduler sets it once, with no blocks held; it names the blocks' hash chain apart from the short ones').
    long_rope: bool = False
    # accounting
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    gpu_seconds: float = 0.0
    num_preemptions: int = 0  # also the epoch of its blocks: a longrope restart (scheduler.py) counts here too
    num_cached_tokens: int = 0  # prompt tokens reused (cache hit or fork) at first admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Computes the prompt's logprobs: sample 0 of a request that asks (the others share its prompt)."""
        return self.sampling.prompt_logprobs is not None and self.sample_index == 0

    @property
    def num_tokens(self) -> int:
        """Known tokens plus tokens sampled in flight: the sequence's length as the scheduler sees it."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight_samples

    @property
    def num_generated(self) -> int:
        """Generated tokens, known or in flight."""
        return len(self.output_ids) + self.num_inflight_samples

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Known token ids in [start, end) of prompt + output (callers never ask for in-flight ones)."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]
