"""Stop conditions and final text. Owns nothing: reads a `Sequence` after a token was appended.

Stop strings are found by decoding only a tail window of the output each step (cheap, incremental);
the window holds enough tokens for the longest stop string because most tokens decode to at least
one byte (it widens when some decode to nothing). The final text is cut just before the first
occurrence.
"""

from __future__ import annotations

from .api import FinishReason, SamplingParams
from .sequence import Sequence

_WINDOW_SLACK_TOKENS = 4


def check_stop(
    seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int, tokenizer
) -> FinishReason | None:
    """Why `seq` must stop after its newest token, or None."""
    params = seq.sampling
    token = seq.output_ids[-1]
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return FinishReason.STOP
    if params.stop and _tail_has_stop_string(seq, tokenizer):
        return FinishReason.STOP
    # NOTE: known tokens only: `seq.num_tokens` also counts samples in flight (async) and would stop one early.
    num_known = len(seq.prompt_ids) + len(seq.output_ids)
    if len(seq.output_ids) >= params.max_new_tokens or num_known >= max_model_len:
        return FinishReason.LENGTH
    return None


def _tail_has_stop_string(seq: Sequence, tokenizer) -> bool:
    stop = seq.sampling.stop
    window = max(len(s.encode("utf-8")) for s in stop) + _WINDOW_SLACK_TOKENS
    tail = tokenizer.decode(seq.output_ids[-window:])
    # NOTE: some ids decode to nothing (special tokens, the byte tokenizer's unused ids), so a window of
    # tokens can hold too little text: widen it until the tail is long enough or covers the whole output.
    min_chars = max(len(s) for s in stop) + _WINDOW_SLACK_TOKENS
    while len(tail) < min_chars and window < len(seq.output_ids):
        window *= 2
        tail = tokenizer.decode(seq.output_ids[-window:])
    return any(s in tail for s in stop)


def special_stop_token_ids(stop: tuple[str, ...], tokenizer) -> dict[str, int]:
    """The stop strings that spell one special token (e.g. "<|eot_id|>"), with its id. Decoding drops special
    tokens, so such a string can never appear in the text: it must stop on the token instead."""
    found = {s: tokenizer.special_token_id(s) for s in stop}
    return {s: i for s, i in found.items() if i is not None}


def num_text_tokens(ids: list[int], params: SamplingParams, eos_token_ids: frozenset[int]) -> int:
    """How many output ids make the text: all but a final stop token (EOS or one of `stop_token_ids`)."""
    if ids and ((ids[-1] in eos_token_ids and not params.ignore_eos) or ids[-1] in params.stop_token_ids):
        return len(ids) - 1
    return len(ids)


def final_text(seq: Sequence, eos_token_ids: frozenset[int], tokenizer) -> str:
    """Decoded output without a final stop token, cut before the first stop string."""
    params = seq.sampling
    text = tokenizer.decode(seq.output_ids[: num_text_tokens(seq.output_ids, params, eos_token_ids)])
    if params.stop:
        cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
    return text
