"""The engine: a continuous-batching step loop over the scheduler, batch builder and model runner.

Knows nothing of Redis or pydantic: requests come in as `EngineRequest`, results go out as
`EngineResult`. Owns the request registry (`_requests`: each request's n samples), the inbox of
adds/aborts from other threads, the results queue, and the engine-wide accounting. What a request is
checked and turned into on its way in (its refusal, resolved sampling, samples) is intake.py's.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .admission import OrderedPool, default_workers
from .api import EngineRequest, EngineResult, EngineStats, ErrorCode, FinishReason, TokenizerProtocol, Usage
from .block_manager import BlockManager
from .config import EngineConfig, context_len
from .describe import describe_step
from .families.spec import longrope_original_len
from .grammar import GrammarCompiler, GrammarError, TokenMasks
from .intake import new_samples, num_samples, refusal, resolve_sampling
from .kv_cache import check_kv_cache_dtype, kv_cache_dtype, num_blocks_from_memory
from .model_runner import ModelRunner, StepBuildError, StepHandle
from .models import generation_defaults, load_model, resolve_device, resolve_dtype
from .multimodal import ImagePrompts, SequenceImages, is_vision_model
from .parallel.group import RankFailure
from .prompt_logprobs import record as record_prompt_logprobs
from .results import request_result
from .scheduler import ScheduledChunk, Scheduler, StepPlan
from .sequence import Sequence
from .step import StepDescription
from .stop import check_stop

logger = logging.getLogger("cbq.engine")


# -- inbox messages (other threads -> the loop thread), dispatched with isinstance --------------------------
@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    # its constraint's grammar matcher and its images (its prompt expanded), made before the loop sees it: in the
    # caller's thread, or a vision-language engine's admission pool
    matcher: Any = None
    images: SequenceImages | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes a loop blocked on an empty inbox so it sees the stop flag."""


@dataclass(frozen=True)
class _Fail:
    """Another thread saw an error the loop must not survive (a tensor-parallel rank died): the loop raises it."""

    error: BaseException


_InboxMessage = _Add | _Abort | _Wake | _Fail


@dataclass(frozen=True)
class _LoopDied:
    """Put on the results queue when the loop thread dies, so a `get_results` waiter wakes and raises."""


@dataclass
class _InflightStep:
    plan: StepPlan
    handle: StepHandle
    rows: dict[Sequence, int]  # each sampling sequence's output row: what the next step may carry over
    mask_seqs: list[Sequence] | None = None  # constrained rows' sequences, when sampling waits for masks


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerProtocol,
        config: EngineConfig | None = None,
        make_runner: Callable[..., ModelRunner] = ModelRunner,  # a tensor-parallel rank 0's (ranks.py)
    ):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.device: torch.device = next(model.parameters()).device
        # The loader gave the tokenizer every eos source (its own, config.json's, generation_config.json's).
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        # Defaults for what a request leaves unset (SamplingParams fields that are None).
        self.sampling_defaults = generation_defaults(model) if config.generation_config_defaults else {}
        # A vision-language model's image processing (multimodal.py); a text-only engine refuses images (and
        # worker/media/ before it fetches any).
        self.image_prompts = ImagePrompts(model) if is_vision_model(model) else None
        self.accepts_images = self.image_prompts is not None
        # Their image processing runs off the adding thread, on a few threads, and reaches the inbox in the
        # order the requests were added (admission.py); a text-only engine's adds go to the inbox directly.
        self._admission: OrderedPool[_Add | _Abort | None] | None = None
        if self.image_prompts is not None:
            self._admission = OrderedPool(self._deliver, default_workers())
        self._num_with_images = 0  # unfinished sequences with images (loop thread only)
        check_kv_cache_dtype(config, self.device)
        num_blocks = config.num_kv_blocks or num_blocks_from_memory(
            model.config, kv_cache_dtype(config, model.dtype), self.device, config
        )
        self.max_model_len: int = context_len(config, model.config, num_blocks)
        self.runner = make_runner(model, config, self.device, num_blocks, self.max_model_len)
        # the runner sizes the cache again once its decoder is built (what the build kept is taken out)
        num_blocks, self.max_model_len = self.runner.num_kv_blocks, self.runner.max_model_len
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
            long_rope_after=longrope_original_len(model.config),
        )  # fmt: skip
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its samples, in index order
        self._inbox: queue.SimpleQueue[_InboxMessage] = queue.SimpleQueue()
        self._results: queue.Queue[EngineResult | _LoopDied] = queue.Queue()
        self._lock = threading.Lock()
        self._num_unfinished = 0
        self._num_unfinished_samples = 0
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
        self._num_with_prompt_logprobs = 0  # unfinished sequences that want prompt logprobs (likewise)
        self._tracer: Any = None  # `trace_steps`
        self.runner.capture_graphs()

    @classmethod
    def from_model(cls, model: str = "tiny-llama", **config_overrides: Any) -> Engine:
        """Load a preset (random weights) or a checkpoint by local path / hub name and build an engine in this
        process (engine_builder.build_engine also builds tensor-parallel replicas)."""
        config = EngineConfig(**config_overrides)
        if config.tensor_parallel_size > 1:  # the replica's ranks are built above the engine (engine_builder.py)
            raise ValueError("Engine.from_model runs one process: build a tensor-parallel engine with build_engine")
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        # Gemma 3 4B-27B load whole with their images (either decoder runs them) except under --deterministic,
        # whose batch-invariant path takes no images: their text alone then (as an FP8 run's, models/loader.py)
        images = not config.deterministic
        hf_model, tokenizer = load_model(model, device, dtype, config.seed, config.quantization, images=images)
        return cls(hf_model, tokenizer, config)

    # -- public API (thread-safe) -----------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. A bad one comes back as an ERROR result (at once, or from the admission pool where
        its images are processed); it never raises."""
        with self._lock:
            self._num_unfinished += 1
            self._num_unfinished_samples += num_samples(req)
        if self._admission is not None:
            self._admission.submit(lambda: self._intake_or_error(req))
            return
        message = self._intake(req)
        if message is not None:
            self._inbox.put(message)

    def _intake_or_error(self, req: EngineRequest) -> _Add | None:
        """`_intake` on the admission pool, where nothing may raise: an unexpected error fails the request."""
        try:
            return self._intake(req)
        except Exception as exc:
            logger.exception("request %s could not be admitted", req.request_id)
            self._emit_error(req, f"admission failed: {type(exc).__name__}: {exc}")
            return None

    def _deliver(self, message: _Add | _Abort | None) -> None:
        if message is not None:
            self._inbox.put(message)

    def _intake(self, req: EngineRequest) -> _Add | None:
        """The request ready for the loop (its images processed, its grammar compiled), or None when it was
        refused (its ERROR result emitted)."""
        keep = req.sampling.truncate_prompt_tokens
        if keep is not None and len(req.prompt_ids) > keep:
            req = replace(req, prompt_ids=req.prompt_ids[-keep:])  # vLLM's truncation: the last k tokens
        images = None
        if self.image_prompts is not None:  # pads expanded before the prompt's length is checked
            try:
                prompt_ids, images = self.image_prompts.prepare(req.prompt_ids, req.images)
            except Exception as exc:  # the processor's own refusals (an aspect ratio over 200) too: never raises
                why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                self._emit_error(req, f"images: {why}", ErrorCode.INVALID_PROMPT)
                return None
            req = replace(req, prompt_ids=prompt_ids)
            too_long = images.budget_refusal(self.config.max_num_batched_tokens) if images is not None else None
            if too_long:
                self._emit_error(req, f"images: {too_long}", ErrorCode.INVALID_PROMPT)
                return None
        refused = refusal(req, self.max_model_len, self.model.config.vocab_size, self.accepts_images)
        matcher = None
        if not refused and req.sampling.constraint is not None:
            try:  # compiled here, off the loop's thread, so the step loop never waits for it
                matcher = self.grammar.matcher_for(req.sampling.constraint)
            except GrammarError as exc:
                refused = str(exc), None
        if refused:
            self._emit_error(req, *refused)
            return None
        return _Add(req, matcher, images)

    def abort(self, request_id: str) -> None:
        if self._admission is not None:  # behind the requests added before it: it never overtakes its own
            self._admission.put(_Abort(request_id))
        else:
            self._inbox.put(_Abort(request_id))

    def fail(self, error: BaseException) -> None:
        """End the loop with `error`, from any thread (an idle loop too): `generate` or `get_results` raises it."""
        self._inbox.put(_Fail(error))

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

    def num_unstarted(self) -> int:
        """Samples added and not yet running (queued for the loop or waiting in the scheduler)."""
        with self._lock:
            return max(0, self._num_unfinished_samples - len(self.scheduler.running))

    def has_capacity(self) -> bool:
        """More requests are useful while fewer than enough wait to refill every running slot."""
        with self._lock:
            return self._num_unfinished_samples < 2 * self.config.max_num_seqs

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
            prefix_cache_queries=self.blocks.num_cache_queries,
            prefix_cache_hits=self.blocks.num_cache_hits,
        )

    def reset_stats(self) -> None:
        """Start accounting afresh (benchmarks call this after warm-up)."""
        self._stats = EngineStats()
        self.blocks.reset_cache_counters()
        self.step_log.clear()
        self._loop_start = None

    def trace_steps(self, tracer: Any) -> None:
        """`bench engine --trace`: from now on the loop gives `tracer.on_prep(start, end)` each step's host
        preparation (scheduling and batch building, perf_counter seconds) and the runner its stage marks
        (ModelRunner.tracer). None stops; off by default, when no mark is made."""
        self._tracer = self.runner.tracer = tracer

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

    def close(self) -> None:
        """Stop the loop and release the runner (a tensor-parallel engine's helper processes) and the
        admission threads."""
        self.shutdown()
        self.runner.close()
        if self._admission is not None:
            self._admission.close()

    def generate(self, requests: list[EngineRequest]) -> list[EngineResult]:
        """Run `requests` to completion in the calling thread; results in input order."""
        if self._thread is not None:
            raise RuntimeError("generate() cannot run while the loop thread is started")
        self._stop.clear()  # usable again after a shutdown()
        for req in requests:
            self.add_request(req)
        if self._admission is not None:  # every request in the inbox before the first step, as with no pool
            self._admission.wait()
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
                launched = self._launch_next(inflight)
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
            except RankFailure:  # a tensor-parallel replica lost a rank: nothing can run on it any more
                raise
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
        for seq in self.scheduler.on_step_failed():
            self._finish(seq, FinishReason.ERROR, error=message)

    def _launch_next(self, inflight: _InflightStep | None) -> _InflightStep | None:
        """Schedule, describe and launch a step. `inflight`: the launched step whose tokens are not applied yet
        (async mode): the new step's decodes take their input tokens from its output rows."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return None
        now = time.time()
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
        prev_rows = inflight.rows if inflight is not None else {}
        step, rows = describe_step(
            plan,
            prev_rows,
            self.eos_token_ids,
            extras=self._num_with_extras > 0,
            prompt_logprobs=self._num_with_prompt_logprobs > 0,
            long_rope=self.scheduler.long_rope_after is not None,
            images=self._num_with_images > 0,
        )
        mask_seqs = None
        if step.extras is not None and step.extras.mask_rows:
            sample_seqs = list(rows)  # in row order
            mask_seqs = [sample_seqs[row] for row in step.extras.mask_rows]
        schedule_seconds = time.perf_counter() - t0
        try:
            handle = self.runner.launch(step)
        except StepBuildError as exc:
            self._fail_unpreparable(plan, step, exc)
            return None
        self._stats.cpu_prep_seconds += schedule_seconds + handle.build_seconds
        if self._tracer is not None:
            self._tracer.on_prep(t0, t0 + schedule_seconds + handle.build_seconds)
        return _InflightStep(plan, handle, rows, mask_seqs)

    def _launch_masked_sampling(self, step: _InflightStep) -> None:
        assert step.mask_seqs is not None
        t0 = time.perf_counter()
        # A sequence finished meanwhile has no matcher: its row allows everything and its token is dropped.
        matchers = [None if seq.is_finished else seq.matcher for seq in step.mask_seqs]
        bitmask = self._token_masks.fill(step.handle.meta.slot, matchers)
        self._stats.mask_seconds += time.perf_counter() - t0
        self.runner.launch_sampling(step.handle, bitmask)

    def _fail_unpreparable(self, plan: StepPlan, step: StepDescription, error: StepBuildError) -> None:
        """A step could not be built: fail only the requests that cannot be built even alone (a value their
        step buffers cannot hold, say); the others are scheduled again next turn. If none is to blame alone,
        the step fails as a whole."""
        bad = [(plan.chunks[b].seq, exc) for b, exc in self.runner.unbuildable(step)]
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
        self.scheduler.on_step_processed(step.plan)  # its K/V is written: blocks become shareable
        stats = self._stats
        stats.steps += 1
        stats.busy_seconds += device_seconds
        num_step_tokens = step.plan.num_tokens
        seconds_per_token = device_seconds / num_step_tokens
        context_tokens = 0
        for chunk in step.plan.chunks:  # one pass: this loop runs for every sequence of every step
            seq, num_tokens = chunk.seq, chunk.num_tokens
            seq.gpu_seconds += seconds_per_token * num_tokens
            context_tokens += chunk.start + num_tokens
            if num_tokens != 1 or chunk.start < len(seq.prompt_ids):  # not a decode
                stats.prompt_tokens += num_tokens
        self.step_log.append((num_step_tokens, len(step.plan.chunks), context_tokens, device_seconds))
        now = time.time()
        if step.handle.prompt_logprobs is not None:  # before the tokens, which may finish a sequence
            for group, entries in step.handle.prompt_logprobs.records():
                seq = step.plan.chunks[group.seq_index].seq
                if not seq.is_finished:
                    record_prompt_logprobs(seq.prompt_logprobs, group.first_position, entries)
        sampling_chunks = step.plan.sampling_chunks()
        if step.handle.logprobs is not None:
            self._append_logprobs(step.handle, sampling_chunks, tokens)
        for row, chunk in enumerate(sampling_chunks):
            seq = chunk.seq
            self.scheduler.on_token(seq)
            if seq.is_finished:
                continue  # finished (or aborted) at an earlier step; this token was speculative
            if seq.first_token_time is None:  # its first token (checked here: the hot path is the others)
                if seq.sampling.max_new_tokens == 0:  # scoring: the prompt is computed, its sample is not kept
                    self._finish(seq, FinishReason.LENGTH)
                    continue
                seq.first_token_time = now
            seq.output_ids.append(tokens[row])
            stats.output_tokens += 1
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
                    self._admit(message.request, message.matcher, message.images)
                elif isinstance(message, _Fail):
                    raise message.error
                elif isinstance(message, _Abort):
                    samples = self._requests.get(message.request_id)
                    if samples is not None:
                        self._finish(samples[0], FinishReason.CANCELLED)  # cancels every sample
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass

    # -- request lifecycle ------------------------------------------------------------------------
    def _admit(self, req: EngineRequest, matcher: Any = None, images: SequenceImages | None = None) -> None:
        if req.request_id in self._requests:
            self._emit_error(req, f"duplicate request id {req.request_id!r} while the first is still running")
            return
        constraint = req.sampling.constraint
        # Each sample walks the grammar on its own: the extra samples get fresh matchers (cached compile).
        matchers = [matcher] + [
            self.grammar.matcher_for(constraint) if constraint is not None and matcher is not None else None
            for _ in range(req.n - 1)
        ]
        sampling = resolve_sampling(req, self.sampling_defaults, self.max_model_len, self.tokenizer)
        samples = new_samples(req, sampling, matchers, self.config.seed, images)
        if images is not None:
            self._num_with_images += len(samples)
        if sampling.needs_extras:
            self._num_with_extras += len(samples)
        if samples[0].wants_prompt_logprobs:
            samples[0].prompt_logprobs = [None]  # the first token has none: nothing precedes it
            self._num_with_prompt_logprobs += 1
        self._requests[req.request_id] = samples
        self.scheduler.add_group(samples)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Finish one sample; ERROR and CANCELLED finish all of its request's samples. The request's
        result goes out when its last sample is done."""
        if seq.is_finished:
            return  # e.g. a sample of a request that failed as a whole
        samples = self._requests[seq.request_id]
        group_wide = reason in (FinishReason.ERROR, FinishReason.CANCELLED)
        now = time.time()
        for sample in samples if group_wide else [seq]:
            if not sample.is_finished:
                self.scheduler.finish(sample)
                sample.finish_reason, sample.finish_time = reason, now
                if sample.sampling.needs_extras:
                    self._num_with_extras -= 1
                if sample.wants_prompt_logprobs:
                    self._num_with_prompt_logprobs -= 1
                if sample.images is not None:
                    self._num_with_images -= 1
                sample.matcher = None
        if all(sample.is_finished for sample in samples):  # always so after a group-wide finish
            del self._requests[seq.request_id]
            self._put_result(request_result(samples, error, self.eos_token_ids, self.tokenizer), len(samples))

    def _emit_error(self, req: EngineRequest, error: str, code: ErrorCode | None = None) -> None:
        usage = Usage(prompt_tokens=len(req.prompt_ids))
        self._put_result(
            EngineResult(req.request_id, "", [], FinishReason.ERROR, usage, error, error_code=code),
            num_samples(req),
        )

    def _put_result(self, result: EngineResult, num_samples: int) -> None:
        with self._lock:
            self._num_unfinished -= 1
            self._num_unfinished_samples -= num_samples
        self._results.put(result)

