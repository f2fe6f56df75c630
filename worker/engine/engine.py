"""The engine: a continuous-batching step loop over the scheduler, batch builder and model runner.

Knows nothing of Redis or pydantic: requests come in as `EngineRequest`, results go out as
`EngineResult`. Owns the request registry (`_seqs`), the inbox of adds/aborts from other threads,
the results queue, and the engine-wide accounting.

Sync and async are the same loop; async only moves "wait for step N" after "launch step N+1":

    sync:   schedule N, build N, launch N, wait N, process N, schedule N+1, ...
    async:  schedule N+1, build N+1, launch N+1, wait N, process N, schedule N+2, ...

In async mode step N+1 is planned before step N's tokens are known: a decode's input is a
placeholder that the device fills from step N's output (carry-over), and a sequence that step N
finishes was already scheduled in N+1; its extra token is discarded when N+1 is processed.

A step with constrained requests samples only after the previous step was processed, since its token
masks depend on those tokens (grammar.py): launch N+1's forward, process N, then sample N+1.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .api import EngineRequest, EngineResult, EngineStats, FinishReason, TokenizerProtocol, Usage
from .block_manager import BlockManager
from .config import EngineConfig
from .grammar import GrammarCompiler, GrammarError, TokenMasks
from .kv_cache import num_blocks_from_memory
from .model_runner import ModelRunner, SampleExtras, StepBuildError, StepHandle
from .models import load_model, resolve_device, resolve_dtype
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .sequence import Sequence
from .stop import check_stop, final_text

logger = logging.getLogger("cbq.engine")


# -- inbox messages (other threads -> the loop thread), dispatched with isinstance --------------------------
@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    matcher: Any = None  # its constraint's grammar matcher, compiled in the caller's thread


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes a loop blocked on an empty inbox so it sees the stop flag."""


_InboxMessage = _Add | _Abort | _Wake


@dataclass(frozen=True)
class _LoopDied:
    """Put on the results queue when the loop thread dies, so a `get_results` waiter wakes and raises."""


@dataclass
class _InflightStep:
    plan: StepPlan
    handle: StepHandle
    mask_seqs: list[Sequence] | None = None  # constrained rows' sequences, when sampling waits for masks


class Engine:
    def __init__(self, model: Any, tokenizer: TokenizerProtocol, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.device: torch.device = next(model.parameters()).device
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        num_blocks = config.num_kv_blocks or num_blocks_from_memory(
            model.config, model.dtype, self.device, config
        )
        model_len = config.max_model_len or model.config.max_position_embeddings
        window = getattr(model.config, "sliding_window", None)
        if window and getattr(model.config, "use_sliding_window", True):
            model_len = min(model_len, window)  # beyond the window the model would attend differently
        # A lone sequence must always fit in the cache, or preemption could never make room for it.
        self.max_model_len: int = min(model_len, (num_blocks - 1) * config.block_size)
        self.runner = ModelRunner(model, config, self.device, num_blocks, self.max_model_len)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len
        )
        self._seqs: dict[str, Sequence] = {}
        self._inbox: queue.SimpleQueue[_InboxMessage] = queue.SimpleQueue()
        self._results: queue.Queue[EngineResult | _LoopDied] = queue.Queue()
        self._lock = threading.Lock()
        self._num_unfinished = 0
        self._stop = threading.Event()
        self._fatal_error: BaseException | None = None  # set if the loop thread dies
        self._thread: threading.Thread | None = None
        self._stats = EngineStats()
        # Per step (num_tokens, num_seqs, context tokens read, device seconds): for floors and profiles.
        self.step_log: collections.deque[tuple[int, int, int, float]] = collections.deque(maxlen=1 << 16)
        self._loop_start: float | None = None
        self.grammar = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_token_ids)
        self._token_masks = TokenMasks(
            model.config.vocab_size, config.max_num_seqs, self.device.type == "cuda"
        )
        self._num_with_extras = 0  # unfinished sequences with a constraint or logprobs (loop thread only)
        self.runner.capture_graphs()

    @classmethod
    def from_model(cls, model: str = "tiny-llama", **config_overrides: Any) -> Engine:
        """Load a preset (random weights) or a checkpoint by local path / hub name and build an engine."""
        config = EngineConfig(**config_overrides)
        device = resolve_device(config.device)
        hf_model, tokenizer = load_model(model, device, resolve_dtype(config.dtype, device), seed=config.seed)
        return cls(hf_model, tokenizer, config)

    # -- public API (thread-safe) -----------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. A bad one comes back at once as an ERROR result; it never raises."""
        with self._lock:
            self._num_unfinished += 1
        error = self._validate(req)
        matcher = None
        if not error and req.sampling.constraint is not None:
            try:  # compiled here, in the caller's thread, so the step loop never waits for it
                matcher = self.grammar.matcher_for(req.sampling.constraint)
            except GrammarError as exc:
                error = str(exc)
        if error:
            self._emit_error(req, error)
            return
        self._inbox.put(_Add(req, matcher))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def get_results(self, timeout: float | None = 0) -> list[EngineResult]:
        """Results finished since the last call; waits up to `timeout` seconds for the first one
        (0 or None: does not wait)."""
        items: list[EngineResult | _LoopDied] = []
        try:
            items.append(self._results.get(timeout=timeout) if timeout else self._results.get_nowait())
            while True:
                items.append(self._results.get_nowait())
        except queue.Empty:
            pass
        results = [r for r in items if isinstance(r, EngineResult)]
        if not results and self._fatal_error is not None:
            raise RuntimeError("the engine loop has died; see the log") from self._fatal_error
        return results

    def num_unfinished(self) -> int:
        with self._lock:
            return self._num_unfinished

    def has_capacity(self) -> bool:
        """More requests are useful while fewer than enough wait to refill every running slot."""
        return self.num_unfinished() < 2 * self.config.max_num_seqs

    def stats(self) -> EngineStats:
        s = self._stats
        wall = time.perf_counter() - self._loop_start if self._loop_start else 0.0
        return EngineStats(
            s.steps,
            s.prompt_tokens,
            s.output_tokens,
            s.busy_seconds,
            s.cpu_prep_seconds,
            wall,
            self.scheduler.num_preemptions,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            num_kv_blocks_used=self.blocks.num_usable_blocks - self.blocks.num_free_blocks,
            num_kv_blocks_total=self.blocks.num_usable_blocks,
            mask_seconds=s.mask_seconds,
        )

    def reset_stats(self) -> None:
        """Start accounting afresh (benchmarks call this after warm-up)."""
        self._stats = EngineStats()
        self.step_log.clear()
        self._loop_start = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._thread_main, name="cbq-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(_Wake())
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def generate(self, requests: list[EngineRequest]) -> list[EngineResult]:
        """Run `requests` to completion in the calling thread; results in input order."""
        if self._thread is not None:
            raise RuntimeError("generate() cannot run while the loop thread is started")
        self._stop.clear()  # usable again after a shutdown()
        for req in requests:
            self.add_request(req)
        self._run_loop(stop_when_idle=True)
        by_id = {r.request_id: r for r in self.get_results()}
        return [by_id[req.request_id] for req in requests]

    # -- the step loop ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _run_loop(self, stop_when_idle: bool) -> None:
        self._loop_start = self._loop_start or time.perf_counter()
        inflight: _InflightStep | None = None
        while not self._stop.is_set():
            idle = inflight is None and not self.scheduler.has_unfinished()
            if idle and stop_when_idle and self._inbox.empty():
                break
            self._drain_inbox(block=idle)
            try:
                # 1. Plan and launch the next step (in async mode, while the previous one still runs).
                launched = self._launch_next()
                # 2. Wait for the previous step's tokens and apply them.
                if inflight is not None:
                    self._process(inflight)
                # 2b. Constrained rows: their masks needed those tokens; now the step can sample.
                if launched is not None and launched.mask_seqs is not None:
                    self._launch_masked_sampling(launched)
                inflight = launched
                # 3. Sync mode: no overlap, wait for this step right away.
                if not self.config.is_async and inflight is not None:
                    self._process(inflight)
                    inflight = None
            except Exception as exc:  # a failed step fails the requests it touched, not the engine
                self._fail_scheduled(exc)
                inflight = None
        if inflight is not None:
            self._process(inflight)

    def _thread_main(self) -> None:
        try:
            self._run_loop(stop_when_idle=False)
        except BaseException as exc:
            self._fatal_error = exc
            logger.exception("engine loop died")
            self._results.put(_LoopDied())  # wake a get_results() waiter so it sees the error

    def _fail_scheduled(self, exc: Exception) -> None:
        """Finish with ERROR every sequence a failed step may have touched; waiting ones carry on."""
        logger.exception("engine step failed; failing the running requests")
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        self.runner.discard_inflight()
        for seq in self.scheduler.on_step_failed():
            self._finish(seq, FinishReason.ERROR, error=message)

    def _launch_next(self) -> _InflightStep | None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return None
        now = time.time()
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
        extras, mask_seqs = self._sample_extras(plan) if self._num_with_extras else (None, None)
        schedule_seconds = time.perf_counter() - t0
        try:
            # The runner carries over tokens the step in flight still samples.
            handle = self.runner.launch(plan, extras)
        except StepBuildError as exc:
            self._fail_unpreparable(plan, exc)
            return None
        self._stats.cpu_prep_seconds += schedule_seconds + handle.build_seconds
        return _InflightStep(plan, handle, mask_seqs)

    def _sample_extras(self, plan: StepPlan) -> tuple[SampleExtras | None, list[Sequence] | None]:
        """Which sample rows want logprobs or a token mask (only called while some request does)."""
        extras = SampleExtras()
        mask_seqs = []
        for row, chunk in enumerate(plan.sampling_chunks()):
            params = chunk.seq.sampling
            if params.logprobs is not None:
                extras.logprob_rows.append(row)
                extras.num_top_logprobs = max(extras.num_top_logprobs, params.logprobs)
            if params.constraint is not None:
                extras.mask_rows.append(row)
                mask_seqs.append(chunk.seq)
        if not extras.logprob_rows and not mask_seqs:
            return None, None
        return extras, (mask_seqs or None)

    def _launch_masked_sampling(self, step: _InflightStep) -> None:
        assert step.mask_seqs is not None
        t0 = time.perf_counter()
        # A sequence finished meanwhile has no matcher: its row allows everything and its token is dropped.
        matchers = [None if seq.is_finished else seq.matcher for seq in step.mask_seqs]
        bitmask = self._token_masks.fill(step.handle.meta.slot, matchers)
        self._stats.mask_seconds += time.perf_counter() - t0
        self.runner.launch_sampling(step.handle, bitmask)

    def _fail_unpreparable(self, plan: StepPlan, error: StepBuildError) -> None:
        """A step could not be built: fail only the requests that cannot be built even alone (a value their
        step buffers cannot hold, say); the others are scheduled again next turn. If none is to blame alone,
        the step fails as a whole."""
        bad = self.runner.unbuildable(plan)
        if not bad:
            raise error
        self.scheduler.unschedule(plan)
        for seq, exc in bad:
            logger.warning("request %s cannot be prepared: %r", seq.request_id, exc)
            self._finish(
                seq, FinishReason.ERROR, error=f"request cannot be prepared: {type(exc).__name__}: {exc}"
            )

    def _process(self, step: _InflightStep) -> None:
        tokens, device_seconds = self.runner.wait(step.handle)
        stats = self._stats
        stats.steps += 1
        stats.busy_seconds += device_seconds
        num_step_tokens = step.plan.num_tokens
        context_tokens = sum(c.start + c.num_tokens for c in step.plan.chunks)
        self.step_log.append((num_step_tokens, len(step.plan.chunks), context_tokens, device_seconds))
        now = time.time()
        for chunk in step.plan.chunks:
            chunk.seq.gpu_seconds += device_seconds * chunk.num_tokens / num_step_tokens
            is_decode = chunk.num_tokens == 1 and chunk.start >= len(chunk.seq.prompt_ids)
            if not is_decode:
                stats.prompt_tokens += chunk.num_tokens
        sampling_chunks = step.plan.sampling_chunks()
        if step.handle.logprobs is not None:
            self._append_logprobs(step.handle, sampling_chunks, tokens)
        for row, chunk in enumerate(sampling_chunks):
            seq = chunk.seq
            self.scheduler.on_token(seq)
            if seq.is_finished:
                continue  # finished (or aborted) at an earlier step; this token was speculative
            seq.output_ids.append(tokens[row])
            stats.output_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.matcher is not None and not seq.matcher.consume_token(tokens[row]):
                self._finish(seq, FinishReason.ERROR, error=f"constraint: {seq.matcher.get_error()}")
                continue
            reason = check_stop(seq, self.eos_token_ids, self.max_model_len, self.tokenizer)
            if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
                reason = FinishReason.STOP  # the grammar is complete and allows nothing more
            if reason is not None:
                self._finish(seq, reason)

    def _append_logprobs(
        self, handle: StepHandle, sampling_chunks: list[ScheduledChunk], tokens: list[int]
    ) -> None:
        assert handle.extras is not None and handle.logprobs is not None
        rows = handle.extras.logprob_rows
        seqs = [sampling_chunks[row].seq for row in rows]
        num_top = [s.sampling.logprobs or 0 for s in seqs]
        records = handle.logprobs.to_records([tokens[row] for row in rows], num_top)
        for seq, record in zip(seqs, records, strict=True):
            if not seq.is_finished:  # a finished sequence's extra token is dropped, and so is its logprob
                seq.output_logprobs.append(record)

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                if isinstance(message, _Add):
                    self._admit(message.request, message.matcher)
                elif isinstance(message, _Abort):
                    seq = self._seqs.get(message.request_id)
                    if seq is not None and not seq.is_finished:
                        self._finish(seq, FinishReason.CANCELLED)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass

    # -- request lifecycle ------------------------------------------------------------------------
    def _validate(self, req: EngineRequest) -> str | None:
        n = len(req.prompt_ids)
        if n == 0:
            return "empty prompt: at least one token is needed"
        if n >= self.max_model_len:
            return (
                f"prompt has {n} tokens; the context is {self.max_model_len} tokens and at least one "
                "must be left for generation"
            )
        vocab = self.model.config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            return f"prompt token ids must be in [0, {vocab})"
        return None

    def _admit(self, req: EngineRequest, matcher: Any = None) -> None:
        if req.request_id in self._seqs:
            self._emit_error(req, f"duplicate request id {req.request_id!r} while the first is still running")
            return
        seed = req.sampling.seed
        if seed is None:
            seed = zlib.crc32(req.request_id.encode()) ^ self.config.seed
        seq = Sequence(
            req.request_id,
            list(req.prompt_ids),
            req.sampling,
            seed & 0x7FFFFFFF,
            arrival_time=req.arrival_time or time.time(),
            matcher=matcher,
        )
        if matcher is not None or req.sampling.logprobs is not None:
            self._num_with_extras += 1
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.finish_time = time.time()
        del self._seqs[seq.request_id]
        if seq.matcher is not None or seq.sampling.logprobs is not None:
            self._num_with_extras -= 1
        seq.matcher = None
        text = "" if reason == FinishReason.ERROR else final_text(seq, self.eos_token_ids, self.tokenizer)
        first_sched = seq.first_scheduled_time or seq.finish_time
        usage = Usage(
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            gpu_seconds=seq.gpu_seconds,
            queue_seconds=max(0.0, first_sched - seq.arrival_time),
            ttft_seconds=max(0.0, (seq.first_token_time or seq.finish_time) - seq.arrival_time),
            latency_seconds=max(0.0, seq.finish_time - seq.arrival_time),
        )
        logprobs = list(seq.output_logprobs) if seq.sampling.logprobs is not None else None
        self._put_result(
            EngineResult(seq.request_id, text, list(seq.output_ids), reason, usage, error, logprobs)
        )

    def _emit_error(self, req: EngineRequest, error: str) -> None:
        usage = Usage(prompt_tokens=len(req.prompt_ids))
        self._put_result(EngineResult(req.request_id, "", [], FinishReason.ERROR, usage, error))

    def _put_result(self, result: EngineResult) -> None:
        with self._lock:
            self._num_unfinished -= 1
        self._results.put(result)
