"""Sampler: greedy, temperature, min-p, top-k, top-p, penalties, token masks and biases, with a per-request
seed. Owns no state. The model runner applies these in vLLM's order (`logits_processing.process_logits`,
then `sample`).

Random draws come from a counter-based hash of (seed, position, vocab id), turned into Gumbel noise:
argmax(logits / T + Gumbel) samples exactly from softmax(logits / T). So a request's tokens depend
only on its seed and its positions, never on what else shares the batch or on sync vs async, and
nothing here syncs with the host (graph- and stream-friendly).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _fmix32(x):
    """murmur3's 32-bit finaliser on ints, or int64 tensors, holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32  # products wrap in int64; the low 32 bits stay exact
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] floats in (0, 1), a pure function of (seed, position, vocab id)."""
    row = _fmix32((seeds.long() * 0x9E3779B1 + positions.long()) & _M32)
    col = (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F) & _M32
    bits = _fmix32(row[:, None] ^ col[None, :])
    # NOTE: 23 bits, so k + 0.5 is exact in float32 and the largest value is 1 - 2**-24. With 24 bits the top
    # value rounded to exactly 1.0, whose Gumbel noise is +inf: that token won even where top-k/top-p masked it.
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed` (n > 1): sample 0 keeps the
    request's seed, the others get well-mixed 31-bit seeds of (seed, index)."""
    if sample_index == 0:
        return seed
    return _fmix32((seed * 0x9E3779B1 + sample_index * 0x85EBCA77) & _M32) & 0x7FFFFFFF


def keep_only(logits: torch.Tensor, rows: torch.Tensor, pair_rows: torch.Tensor, pair_ids: torch.Tensor) -> None:
    """allowed_token_ids, in place: in each of `rows`, every token but its (pair_rows, pair_ids) gets -inf."""
    blocked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    blocked[rows] = True
    blocked[pair_rows, pair_ids] = False
    logits.masked_fill_(blocked, float("-inf"))


def apply_bans(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, required: torch.Tensor, inputs: torch.Tensor
) -> None:
    """Bad words and min_tokens, in place: `logits[rows[i], token_ids[i]]` becomes -inf where `required[i]` is -1
    or equals `inputs[i]` (that row's input token). Adds, so repeated pairs and a ban not in force (adding 0)
    need no host-side filtering (a boolean index would sync with the host)."""
    active = (required < 0) | (required == inputs)
    add = torch.where(active, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((rows, token_ids), add, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
    """logit_bias, in place: `values[i]` added to `logits[rows[i], token_ids[i]]`."""
    logits.index_put_((rows, token_ids), values.to(logits.dtype), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    history: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor | None = None,
    prompts: torch.Tensor | None = None,
) -> None:
    """vLLM's penalties, in place on `logits[rows]`, in vLLM's order. First the repetition penalty (when
    `prompts` is given): a token seen in the row's prompt `prompts` [P, L'] or its `history` [P, L] (generated
    ids; -1 = padding) has a positive logit divided by r, a negative one multiplied by r. Then OpenAI's: with c
    the number of times a token appears in `history`, its logit loses frequency * c + presence * (c > 0).
    Computed in fp32, then rounded to the logits' dtype."""
    vocab_size = logits.shape[-1]
    counts = torch.zeros((rows.shape[0], vocab_size), dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, history.clamp(min=0), (history >= 0).float())
    seen = counts > 0
    values = logits[rows].float()
    if prompts is not None:
        assert repetition is not None, "the repetition penalty's factors"
        # One extra column takes the padding, so a -1 never marks token 0.
        in_prompt = torch.zeros((rows.shape[0], vocab_size + 1), dtype=torch.bool, device=logits.device)
        in_prompt.scatter_(1, torch.where(prompts >= 0, prompts, vocab_size), True)
        r = repetition[:, None]
        penalised = torch.where(values > 0, values / r, values * r)
        values = torch.where(seen | in_prompt[:, :vocab_size], penalised, values)
    # In place, so a step of many penalised rows holds one more [P, V] fp32 buffer: (c * f + p) where c > 0.
    penalty = counts.mul_(frequency[:, None]).add_(presence[:, None]).mul_(seen)
    logits[rows] = (values - penalty).to(logits.dtype)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p on temperature-scaled logits: a token less likely than min_p times the row's most likely one gets
    -inf (min_p 0 keeps everything; the most likely token always stays)."""
    probs = torch.softmax(scaled, dim=-1)
    return scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k (0 = off) and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    keep = (top_k[:, None] <= 0) | (ranks[None, :] < top_k[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the first token always stays.
    keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    any_random: bool,
    any_top_k_top_p: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V]; per-row params [R] (`min_p` None: no row has one). `any_*` are host-side flags so
    all-greedy steps stay cheap. After the temperature: min_p, then top-k and top-p (vLLM's order).

    Returns int32 token ids [R]. Rows with temperature 0 are greedy.
    """
    greedy = logits.argmax(dim=-1).to(torch.int32)
    if not any_random:
        return greedy
    scaled = logits.float() / temperature.clamp(min=1e-6)[:, None]
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if any_top_k_top_p:
        # NOTE: rows that ask for neither keep their logits as they are: top_p 1.0 would otherwise still drop a
        # tail token whose rounded cumulative probability reaches 1, and only in steps where another row filters.
        filters = (top_k > 0) | (top_p < 1.0)
        scaled = torch.where(filters[:, None], apply_top_k_top_p(scaled, top_k, top_p), scaled)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, logits.shape[-1])))
    sampled = (scaled + gumbel).argmax(dim=-1).to(torch.int32)
    return torch.where(temperature > 0, sampled, greedy)
