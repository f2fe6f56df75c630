"""Stop conditions and final text. Owns nothing: reads a `Sequence` after a token was appended.

Stop strings are found by decoding only a tail window of the output each step (cheap, incremental);
the window holds enough tokens for the longest stop string because most tokens decode to at least
one byte (it widens when some decode to nothing). The final text is cut just before the first
occurrence.

As transformers' `StopStringCriteria` matches stop strings against the tokens' own strings, special tokens
included, a stop string also stops when it spans part of a special token's text that the output leaves out
(`skip_special_tokens`): "end<|im" stops on "end" followed by `<|im_end|>`. The text is then cut where the
stop string began.
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
    # min_tokens: the device banned EOS and stop tokens until then; stop strings wait too (as in vLLM)
    if len(seq.output_ids) >= params.min_tokens:
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
    if _tail_text_has(stop, seq.output_ids, seq.sampling.skip_special_tokens, seq.sampling, tokenizer):
        return True
    # the special tokens' text too, as transformers matches stop strings (see the module docstring)
    return seq.sampling.skip_special_tokens and _tail_text_has(stop, seq.output_ids, False, seq.sampling, tokenizer)


def _tail_text_has(stop: tuple[str, ...], ids: list[int], skip_special: bool, params, tokenizer) -> bool:
    window = max(len(s.encode("utf-8")) for s in stop) + _WINDOW_SLACK_TOKENS
    tail = _decode(ids[-window:], skip_special, params, tokenizer)
    # NOTE: some ids decode to nothing (special tokens, the byte tokenizer's unused ids), so a window of
    # tokens can hold too little text: widen it until the tail is long enough or covers the whole output.
    min_chars = max(len(s) for s in stop) + _WINDOW_SLACK_TOKENS
    while len(tail) < min_chars and window < len(ids):
        window *= 2
        tail = _decode(ids[-window:], skip_special, params, tokenizer)
    return any(s in tail for s in stop)


def _decode(ids: list[int], skip_special: bool, params: SamplingParams, tokenizer) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special, spaces_between_special_tokens=params.spaces_between_special_tokens
    )


def special_stop_token_ids(stop: tuple[str, ...], tokenizer) -> dict[str, int]:
    """The stop strings that spell one special token (e.g. "<|eot_id|>"), with its id. Decoding drops special
    tokens, so such a string can never appear in the text: it must stop on the token instead."""
    found = {s: tokenizer.special_token_id(s) for s in stop}
    return {s: i for s, i in found.items() if i is not None}


def num_text_tokens(ids: list[int], params: SamplingParams, eos_token_ids: frozenset[int]) -> int:
    """How many output ids make the text: all but a final stop token (EOS or one of `stop_token_ids`), which
    `include_stop_str_in_output` keeps."""
    if params.include_stop_str_in_output or len(ids) <= params.min_tokens:
        return len(ids)
    if (ids[-1] in eos_token_ids and not params.ignore_eos) or ids[-1] in params.stop_token_ids:
        return len(ids) - 1
    return len(ids)


def final_text(seq: Sequence, eos_token_ids: frozenset[int], tokenizer) -> str:
    """Decoded output without a final stop token, cut before the first stop string (after it, with
    `include_stop_str_in_output`)."""
    params = seq.sampling
    text_ids = seq.output_ids[: num_text_tokens(seq.output_ids, params, eos_token_ids)]
    text = decode(text_ids, params, tokenizer)
    if params.stop:
        # NOTE: a stop string inside the first min_tokens tokens did not stop the output: search after them.
        skip = len(decode(seq.output_ids[: params.min_tokens], params, tokenizer)) if params.min_tokens else 0
        found = [(i, s) for i, s in ((text.find(s, skip), s) for s in params.stop) if i >= 0]
        if found:
            cut, stop = min(found)
            text = text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        elif params.skip_special_tokens:
            text = _cut_in_special_text(text_ids, params, tokenizer, text)
    return text


def _cut_in_special_text(ids: list[int], params: SamplingParams, tokenizer, text: str) -> str:
    """`text` cut where a stop string begins that only the text with special tokens spells (it spans part of
    a special token's text), or `text` as it is."""
    raw = _decode(ids, False, params, tokenizer)
    skip = len(_decode(ids[: params.min_tokens], False, params, tokenizer)) if params.min_tokens else 0
    found = [(i, s) for i, s in ((raw.find(s, skip), s) for s in params.stop) if i >= 0]
    if not found:
        return text
    cut, stop = min(found)
    # The stop string ends at the last tokens (it stopped the output there): walk back to the tokens wholly
    # before it, then add what a visible token cut by it shows before the cut.
    num_before = len(ids)
    while num_before > 0 and len(_decode(ids[:num_before], False, params, tokenizer)) > cut:
        num_before -= 1
    kept = decode(ids[:num_before], params, tokenizer)
    if num_before < len(ids) and decode(ids[num_before : num_before + 1], params, tokenizer):
        kept += raw[len(_decode(ids[:num_before], False, params, tokenizer)) : cut]
    return kept + stop if params.include_stop_str_in_output else kept


def decode(ids: list[int], params: SamplingParams, tokenizer) -> str:
    """The text of `ids` with the request's detokenization options."""
    return tokenizer.decode(
        ids,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )


def bad_words_token_ids(words: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids (no special tokens), and also those of the word after a space where the
    tokenizer folds the space into the word's first token (as vLLM bans both)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced):
            if ids and ids not in out and (ids is plain or len(ids) == len(plain)):
                out.append(ids)
    return tuple(out)
