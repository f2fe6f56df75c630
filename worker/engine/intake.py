"""A request's way into the engine, before the step loop runs it: why it is refused (if it is), its sampling with
every default filled in, and its n samples as `Sequence`s (their seeds and the KV namespace of their cache salt).

Owns no state: the engine (engine.py) calls these from `add_request` (in the caller's thread, or a vision-language
engine's admission pool) and from the loop's admission, and keeps the counts and the request registry itself.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import replace
from typing import Any

from .api import (
    MAX_SAMPLES_PER_REQUEST,
    EngineRequest,
    ErrorCode,
    ResolvedSampling,
    TokenizerProtocol,
    context_length_error,
)
from .multimodal import SequenceImages
from .sampler import sample_seed
from .sequence import Sequence
from .stop import bad_words_token_ids, special_stop_token_ids


def refusal(
    req: EngineRequest, max_model_len: int, vocab_size: int, accepts_images: bool
) -> tuple[str, ErrorCode | None] | None:
    """Why the engine refuses `req` at once (the error and its code), or None when it can run."""
    n = len(req.prompt_ids)
    if n == 0:
        return "empty prompt: at least one token is needed", ErrorCode.INVALID_PROMPT
    if req.images and not accepts_images:
        return "this model takes text only: the request has images", ErrorCode.INVALID_PROMPT
    too_long = context_length_error(req, max_model_len)
    if too_long:
        return too_long, ErrorCode.CONTEXT_LENGTH_EXCEEDED
    if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})", ErrorCode.INVALID_PROMPT
    sampling = req.sampling
    for name, ids in (("allowed_token_ids", sampling.allowed_token_ids), ("logit_bias", sampling.logit_bias)):
        if ids and max(ids) >= vocab_size:
            return f"{name}: token ids must be in [0, {vocab_size})", ErrorCode.INVALID_PROMPT
    if not isinstance(req.n, int) or not 1 <= req.n <= MAX_SAMPLES_PER_REQUEST:
        return f"n must be an integer in [1, {MAX_SAMPLES_PER_REQUEST}], got {req.n!r}", ErrorCode.INVALID_PROMPT
    return None


def resolve_sampling(
    req: EngineRequest, defaults: dict[str, Any], max_model_len: int, tokenizer: TokenizerProtocol
) -> ResolvedSampling:
    """The request's sampling with every default filled in, and stop strings that are special tokens
    (which decode to nothing, so no text could match them) turned into stop token ids; bad words as ids."""
    params = req.sampling.with_defaults(defaults, max_model_len - len(req.prompt_ids))
    if params.bad_words:
        params = replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))
    special = special_stop_token_ids(params.stop, tokenizer)
    if not special:
        return params
    return replace(
        params,
        stop=tuple(s for s in params.stop if s not in special),
        stop_token_ids=params.stop_token_ids + tuple(special.values()),
    )


def new_samples(
    req: EngineRequest,
    sampling: ResolvedSampling,
    matchers: list[Any],
    engine_seed: int,
    images: SequenceImages | None,
) -> list[Sequence]:
    """The request's n samples, each with its own seed (from the request's, or its id's and the engine's) and
    grammar matcher, all in the KV namespace of its cache salt."""
    seed = req.sampling.seed
    if seed is None:
        seed = zlib.crc32(req.request_id.encode()) ^ engine_seed
    arrival_time = req.arrival_time or time.time()
    return [
        Sequence(
            req.request_id,
            list(req.prompt_ids),
            sampling,
            sample_seed(seed & 0x7FFFFFFF, i),
            sample_index=i,
            kv_namespace=kv_namespace(req.cache_salt),
            arrival_time=arrival_time,
            matcher=matchers[i],
            images=images,
        )
        for i in range(req.n)
    ]


def num_samples(req: EngineRequest) -> int:
    """What `req` counts against capacity; an invalid `n` (rejected at once) counts as 1."""
    valid = isinstance(req.n, int) and 1 <= req.n <= MAX_SAMPLES_PER_REQUEST
    return req.n if valid else 1


def kv_namespace(cache_salt: str | None) -> bytes:
    """The root of a request's block hash chain (`Sequence.kv_namespace`): its cache salt's, so requests of
    different salts never share a cached block (the salt is hashed, so no salt spells another's chain)."""
    if cache_salt is None:
        return b""
    return b"salt:" + hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
