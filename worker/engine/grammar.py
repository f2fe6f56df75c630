"""Constrained decoding through llguidance (chosen over xgrammar by measurement: benchmarks/grammar.md).

Owns the llguidance tokenizer, an LRU of compiled constraints, and the host-side token masks. It keeps
no per-request state: each constrained `Sequence` holds its own matcher (`Sequence.matcher`, set and
advanced by the engine).

**Ordering: how the mask avoids stalling the GPU and keeps sync and async outputs identical.** The mask
for a request's token at step N+1 depends on its token from step N. In async mode that token is known on
the host only after step N+1 has been launched. A step with constrained rows is therefore launched in
two parts:

    launch N+1:  H2D inputs, carry-over gather, forward -> logits   (the GPU starts at once)
    process N:   wait for N's tokens; each matcher consumes its token
    masks N+1:   fill one bitmask row per constrained row (llguidance's thread pool, GIL released)
    sample N+1:  H2D bitmask; logits of those rows := -inf where disallowed; sample; D2H

So the host computes N+1's masks while the GPU runs N+1's forward, and the sampling waits on the compute
stream for them. Sync mode runs the same four calls, with no step in flight. Both modes sample N+1 from
the same logits with a mask that has seen every earlier token, so outputs are identical. This is also
why constrained requests keep the carry-over: their next input token still comes from the device.

A step without constrained rows launches forward and sampling together, as before: it has no bitmask
tensor, no extra copy and no extra sync. A step with some constrained rows defers only its own
sampling.

JSON is compact: llguidance's `whitespace_flexible` is off, so no whitespace may appear between JSON
tokens (inside strings it may). A weak or random model cannot loop on spaces until its token limit. A
schema's `x-guidance` options may turn it back on. The grammar text of each constraint kind comes from
`schemas.constraint`, which the producer also uses to check a line's constraint at submit time.

A constraint that llguidance cannot compile raises `GrammarError` from `matcher_for`. The engine turns
that into that request's error result, in the caller's thread, before the request reaches the loop.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import torch

from schemas.constraint import grammar_text

from .api import Constraint
from .tokenizer import ByteTokenizer, HFTokenizer

_CACHE_SIZE = 256  # compiled constraints kept; a request gets a copy (deep_copy takes ~1 µs)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or choice list)."""


class GrammarCompiler:
    """Compiles `Constraint`s into fresh llguidance matchers. Thread-safe: `add_request` calls it from
    the caller's thread. The llguidance tokenizer (about 1 s for a 128k vocabulary) is built at the first
    constrained request, so unconstrained workloads never import llguidance."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: masks cover every logit, padding ids included
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None  # llguidance.LLTokenizer, built at the first constraint
        # Compiled llguidance.LLMatchers, least recently used first.
        self._cache: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher_for(self, constraint: Constraint) -> Any:
        """A fresh matcher at the start of `constraint`'s grammar; raises GrammarError."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
            with self._lock:
                self._cache[constraint] = compiled
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, constraint: Constraint) -> Any:
        try:
            import llguidance
        except ImportError as exc:  # a core dependency; without it constrained requests fail, others run
            raise GrammarError(f"constraints need the llguidance package: {exc}") from exc

        grammar = _grammar_text(llguidance, constraint)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{constraint.kind.value} constraint does not compile: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                tok = _build_llg_tokenizer(self._tokenizer, self.vocab_size, self._eos_token_ids)
                if tok.vocab_size != self.vocab_size:
                    raise GrammarError(
                        f"the tokenizer has {tok.vocab_size} tokens but the model {self.vocab_size} logits"
                    )
                self._ll_tokenizer = tok
            return self._ll_tokenizer


def _grammar_text(llguidance: Any, constraint: Constraint) -> str:
    try:
        return grammar_text(llguidance, constraint.kind.value, constraint.spec)
    except ValueError as exc:  # json.JSONDecodeError included
        raise GrammarError(f"{constraint.kind.value} constraint is not valid: {exc}") from exc


def _build_llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    import llguidance

    if isinstance(tokenizer, HFTokenizer):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer.backend, n_vocab=vocab_size, eos_token=eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)),
            n_vocab=vocab_size,
            eos_token=eos_token_ids,
        )
    raise GrammarError(f"constraints are not supported with a {type(tokenizer).__name__}")


class _ByteVocab:
    """The byte tokenizer's vocabulary in the shape `llguidance.TokenizerWrapper` reads. Ids past the
    special ones (the model's padding) are empty tokens, which llguidance never allows."""

    def __init__(self, tok: ByteTokenizer, vocab_size: int):
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class TokenMasks:
    """Host bitmasks for one step's constrained rows: one pinned buffer per IO slot, made at the first
    constrained step. A slot's buffer is rewritten only after that slot's previous step was waited for,
    so its H2D copy has finished."""

    def __init__(self, vocab_size: int, max_num_seqs: int, pin: bool):
        self.num_words = (vocab_size + 31) // 32
        self.max_num_seqs = max_num_seqs
        self._pin = pin
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._executor: Any = None  # llguidance.LLExecutor: a thread pool that fills rows in parallel

    def fill(self, slot: int, matchers: list[Any]) -> torch.Tensor:
        """Bitmask rows [len(matchers), num_words] for the matchers' next tokens (bit set = allowed).
        A None matcher (its request already finished) allows everything: its token is discarded."""
        import llguidance

        buffer = self._buffers[slot]
        if buffer is None:
            buffer = torch.zeros(self.max_num_seqs, self.num_words, dtype=torch.int32, pin_memory=self._pin)
            self._buffers[slot] = buffer
            self._executor = self._executor or llguidance.LLExecutor()
        rows = buffer[: len(matchers)]
        live = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if len(live) < len(matchers):
            rows.fill_(-1)
        if live:
            self._executor.unsafe_compute_mask_ptr(live, rows.data_ptr(), self.num_words * 4, len(matchers))
        return rows


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0. Runs on logits' device and
    stream with no host sync. Bit t of the little-endian int32 words is bit t % 8 of byte t // 8."""
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(8, dtype=torch.uint8, device=logits.device)
    vocab = logits.shape[-1]
    bits = (bitmask.view(torch.uint8)[:, :, None] >> shifts) & 1
    disallowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab] == 0
    masked = logits.index_select(0, rows).masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, rows, masked)


def is_allowed(bitmask_row: np.ndarray | torch.Tensor, token_id: int) -> bool:
    """Whether a host bitmask row allows `token_id` (tests and assertions)."""
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)
