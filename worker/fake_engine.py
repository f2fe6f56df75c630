"""FakeEngine: the Engine interface with instant, deterministic outputs and no torch.

Used by the queue tests, `cbq worker --fake-engine`, and `cbq bench queue`, so the queue can be exercised and
measured without a model. Owns its own request table; it knows nothing about Redis.

Output rule (an "echo"): generated token k is prompt token k (cycling), so the text is the start of the
prompt, `max_new_tokens` bytes long unless a stop string or stop token id ends it first. Sampling parameters
other than the length and stop conditions are ignored. The tokenizer is the engine's byte tokenizer without
BOS: UTF-8 bytes are ids 0-255. It takes images: the worker reads and decodes them as for a vision model, and the
byte template renders each as "<image>".
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from worker.engine.api import (
    EngineRequest,
    EngineResult,
    EngineStats,
    ErrorCode,
    FinishReason,
    Usage,
    context_length_error,
)
from worker.engine.tokenizer import ByteTokenizer

FAKE_GPU_SECONDS_PER_TOKEN = 1e-5  # a made-up device cost, so accounting code sees non-zero numbers


@dataclass
class _Pending:
    request: EngineRequest
    added_at: float
    ready_at: float  # math.inf while it waits for a running slot


class FakeEngine:
    """Drop-in for `worker.engine.engine.Engine`. Thread-safe like the real one.

    Args:
        max_num_running: `has_capacity()` is True while fewer requests than this are unfinished.
        num_slots: requests that run at once, in arrival order, each for `latency_seconds` from its start; the
            rest wait inside the engine, as in the real one (which admits twice what it runs). None: every
            request runs at once.
        max_model_len: prompts this long or longer finish with an ERROR result, like the real engine.
        latency_seconds: how long a request stays in flight before its result is ready (0: instant);
            a large value keeps requests in flight, so tests can abort or cancel them.
        raise_on_prompt_substring: `add_request` raises for prompts containing it (tests the worker's
            handling of an engine that breaks its contract).
    """

    def __init__(
        self,
        max_num_running: int = 256,
        max_model_len: int = 4096,
        latency_seconds: float = 0.0,
        raise_on_prompt_substring: str | None = None,
        num_slots: int | None = None,
    ):
        self.tokenizer = ByteTokenizer(add_bos=False)
        self.sampling_defaults: dict[str, Any] = {}  # no checkpoint, no generation_config
        self.accepts_images = True  # images are read and decoded as for a real model; the echo shows "<image>"
        self.max_model_len = max_model_len
        self.max_num_running = max_num_running
        self.latency_seconds = latency_seconds
        self.raise_on_prompt_substring = raise_on_prompt_substring
        self.num_slots = num_slots
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._done: list[EngineResult] = []
        self._stats = EngineStats()
        self._started_at: float | None = None
        self.num_added = 0  # for tests: how many requests reached the engine

    @classmethod
    def from_model(cls, model: str = "fake", **config_overrides: Any) -> FakeEngine:
        allowed = {"max_num_running", "max_model_len", "latency_seconds", "raise_on_prompt_substring", "num_slots"}
        return cls(**{k: v for k, v in config_overrides.items() if k in allowed})

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._started_at = time.perf_counter()

    def shutdown(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # --- requests ----------------------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        if self.raise_on_prompt_substring is not None:
            prompt_text = self.tokenizer.decode(req.prompt_ids)
            if self.raise_on_prompt_substring in prompt_text:
                raise RuntimeError(f"FakeEngine told to fail on {self.raise_on_prompt_substring!r}")
        now = time.time()
        with self._lock:
            self.num_added += 1
            if context_length_error(req, self.max_model_len) or not req.prompt_ids:
                self._done.append(self._error(req, now))
            else:
                ready_at = now + self.latency_seconds if self.num_slots is None else math.inf
                self._pending[req.request_id] = _Pending(req, now, ready_at)
                self._start_waiting(now)
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                self._done.append(self._finish(pending, time.time(), cancelled=True))
                self._start_waiting(time.time())
                self._lock.notify_all()

    def get_results(self, timeout: float | None = 0) -> list[EngineResult]:
        deadline = None if timeout is None else time.time() + timeout
        with self._lock:
            while True:
                now = time.time()
                self._collect_ready(now)
                if self._done or (deadline is not None and now >= deadline):
                    done, self._done = self._done, []
                    return done
                next_ready = min((p.ready_at for p in self._pending.values()), default=None)
                wake_ats = [t for t in (deadline, next_ready) if t is not None and math.isfinite(t)]
                self._lock.wait(max(0.0, min(wake_ats) - now) if wake_ats else None)

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._done)

    def num_unstarted(self) -> int:
        with self._lock:
            return sum(1 for p in self._pending.values() if p.ready_at == math.inf)

    def has_capacity(self) -> bool:
        return self.num_unfinished() < self.max_num_running

    def stats(self) -> EngineStats:
        with self._lock:
            wall = time.perf_counter() - self._started_at if self._started_at is not None else 0.0
            s = self._stats
            return EngineStats(
                steps=s.steps,
                prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens,
                busy_seconds=s.busy_seconds,
                wall_seconds=wall,
                num_running=sum(1 for p in self._pending.values() if p.ready_at != math.inf),
                num_waiting=sum(1 for p in self._pending.values() if p.ready_at == math.inf),
            )

    def generate(self, requests: list[EngineRequest]) -> list[EngineResult]:
        """Run to completion without latency; results in input order."""
        now = time.time()
        results = []
        with self._lock:
            for req in requests:
                if context_length_error(req, self.max_model_len) or not req.prompt_ids:
                    results.append(self._error(req, now))
                else:
                    results.append(self._finish(_Pending(req, now, now), now, cancelled=False))
        return results

    # --- internals (called with the lock held) -----------------------------------------------------------------

    def _collect_ready(self, now: float) -> None:
        ready = [rid for rid, p in self._pending.items() if p.ready_at <= now]
        for rid in ready:
            self._done.append(self._finish(self._pending.pop(rid), now, cancelled=False))
        if ready:
            self._start_waiting(now)

    def _start_waiting(self, now: float) -> None:
        """Give the free running slots to the requests that wait, in arrival order (`num_slots` only)."""
        if self.num_slots is None:
            return
        num_free = self.num_slots - sum(1 for p in self._pending.values() if p.ready_at != math.inf)
        for pending in self._pending.values():
            if num_free <= 0:
                break
            if pending.ready_at == math.inf:
                pending.ready_at = now + self.latency_seconds
                num_free -= 1

    def _finish(self, pending: _Pending, now: float, cancelled: bool) -> EngineResult:
        req = pending.request
        output_ids, reason = ([], FinishReason.CANCELLED) if cancelled else self._echo(req)
        text = self.tokenizer.decode(output_ids)
        if reason == FinishReason.STOP:
            text = _cut_at_stop(text, req.sampling.stop)
        arrival = req.arrival_time if req.arrival_time is not None else pending.added_at
        gpu_seconds = FAKE_GPU_SECONDS_PER_TOKEN * (len(req.prompt_ids) + len(output_ids))
        self._stats.steps += 1
        self._stats.prompt_tokens += len(req.prompt_ids)
        self._stats.output_tokens += len(output_ids)
        self._stats.busy_seconds += gpu_seconds
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(output_ids),
            gpu_seconds=gpu_seconds,
            queue_seconds=max(0.0, pending.added_at - arrival),
            ttft_seconds=max(0.0, pending.added_at - arrival),
            latency_seconds=max(0.0, now - arrival),
        )
        return EngineResult(
            request_id=req.request_id,
            text=text,
            token_ids=output_ids,
            finish_reason=reason,
            usage=usage,
        )

    def _echo(self, req: EngineRequest) -> tuple[list[int], FinishReason]:
        sampling = req.sampling
        room = self.max_model_len - len(req.prompt_ids)
        output_ids: list[int] = []
        limit = room if sampling.max_new_tokens is None else min(sampling.max_new_tokens, room)  # None: the rest
        for k in range(limit):
            token = req.prompt_ids[k % len(req.prompt_ids)]
            if token in sampling.stop_token_ids:
                return output_ids, FinishReason.STOP
            output_ids.append(token)
            if sampling.stop and any(s in self.tokenizer.decode(output_ids) for s in sampling.stop):
                return output_ids, FinishReason.STOP
        return output_ids, FinishReason.LENGTH

    def _error(self, req: EngineRequest, now: float) -> EngineResult:
        n = len(req.prompt_ids)
        message = "empty prompt" if n == 0 else context_length_error(req, self.max_model_len)
        return EngineResult(
            request_id=req.request_id,
            text="",
            token_ids=[],
            finish_reason=FinishReason.ERROR,
            usage=Usage(prompt_tokens=n),
            error=message,
            error_code=ErrorCode.INVALID_PROMPT if n == 0 else ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
