"""A finished request's `EngineResult`, from its samples' state (texts, finish reasons, logprobs, usage).

Owns nothing: reads the samples the engine finished (sequence.py) and returns the value the engine puts out.
"""

from __future__ import annotations

from .api import EngineResult, FinishReason, SampleOutput, TokenizerProtocol, Usage
from .sequence import Sequence
from .stop import final_text, num_text_tokens


def request_result(
    samples: list[Sequence], error: str | None, eos_token_ids: frozenset[int], tokenizer: TokenizerProtocol
) -> EngineResult:
    """A finished request's result from its samples (all finished): the first sample's text, ids and logprobs,
    every sample's when n > 1, the usage summed over them, the prompt logprobs unless it failed."""
    first = samples[0]
    failed = [s for s in samples if s.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED)]
    reason = failed[0].finish_reason if failed else first.finish_reason
    assert reason is not None
    outputs = [
        SampleOutput(
            s.sample_index,
            "" if reason == FinishReason.ERROR else final_text(s, eos_token_ids, tokenizer),
            list(s.output_ids),
            s.finish_reason or reason,
            s.output_logprobs[: num_text_tokens(s.output_ids, s.sampling, eos_token_ids)]
            if s.sampling.logprobs is not None
            else None,
        )
        for s in samples
    ]
    finish_time = max(s.finish_time or 0.0 for s in samples)
    first_scheduled = min(
        (s.first_scheduled_time for s in samples if s.first_scheduled_time), default=None
    )
    first_token = min((s.first_token_time for s in samples if s.first_token_time), default=None)
    usage = Usage(
        prompt_tokens=len(first.prompt_ids),
        completion_tokens=sum(len(s.output_ids) for s in samples),
        cached_tokens=first.num_cached_tokens,
        gpu_seconds=sum(s.gpu_seconds for s in samples),
        queue_seconds=max(0.0, (first_scheduled or finish_time) - first.arrival_time),
        ttft_seconds=max(0.0, (first_token or finish_time) - first.arrival_time),
        latency_seconds=max(0.0, finish_time - first.arrival_time),
    )
    out = outputs[0]
    prompt_logprobs = None
    if first.wants_prompt_logprobs and not failed:
        prompt_logprobs = list(first.prompt_logprobs)
        assert len(prompt_logprobs) == len(first.prompt_ids), (
            f"{first.request_id}: {len(prompt_logprobs)} prompt logprobs for {len(first.prompt_ids)} tokens"
        )
    return EngineResult(
        first.request_id,
        out.text,
        out.token_ids,
        reason,
        usage,
        error,
        logprobs=out.logprobs,
        samples=outputs if len(samples) > 1 else [],
        prompt_logprobs=prompt_logprobs,
        prompt_ids=list(first.prompt_ids) if prompt_logprobs is not None else None,
    )
