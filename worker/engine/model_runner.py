"""Model runner: owns the model, the paged KV cache, the CUDA streams and events, the CUDA graphs (and their
batch buckets), the alternation of the two IO slots and the carry-over map.

`launch(step)` builds a step's description (step.py: plain values, no live objects) into the next IO slot,
queues it on the device and returns at once with a `StepHandle`; `wait(handle)` blocks until that step's
sampled tokens are on the host. A step launched while an earlier one is still in flight (async mode) takes
the in-flight tokens its description names from that step's output on the device (carry-over). On CUDA a
step is:
  H2D stream:     wait until the slot's previous compute finished; copy the slot's host buffers up
  compute stream: wait for H2D; carry-over gather; forward (graph replay for decode); sample
  D2H stream:     wait for compute; copy sampled ids (and any logprobs) down; record `d2h_done`
The default stream is never used in the loop. On CPU the streams and events are no-ops and the same
code runs synchronously.

A step with constrained rows (`SamplingExtras.mask_rows`) stops after the forward: the engine calls
`launch_sampling(handle, bitmask)` once the masks are known (grammar.py explains the ordering).

Tensor parallelism is data, not a subclass: one rank's runner gets its shard's `TensorParallel` (the decoder's
collectives) and its `Replica` (parallel/messages.py: rank, group, control channel). Rank 0 sends each step to
the helpers before running it and alone samples; a helper runs what rank 0 sent (`execute_step`).

Three pieces live in modules of their own: the decode graphs' buckets and capture (cuda_graphs.py), the logits
processing before sampling (logits_processing.py) and the trace hooks' stage marks (step_trace.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import deterministic, logprobs, prompt_logprobs
from .attention_backend import (
    ATTN_IMPLEMENTATION,
    AttentionBackend,
    AttentionMetadata,
    TritonAttentionBackend,
    register_paged_attention,
    sliding_windows_of,
)
from .batch import BatchBuilder, BatchMeta, IOSlot
from .config import EngineConfig, context_len
from .cuda_graphs import DecodeGraphs, graph_buckets_for
from .decoder import build_decoder
from .families.spec import longrope_original_len
from .grammar import apply_token_bitmask
from .kv_cache import (
    allocate_kv_cache,
    kv_cache_dtype,
    kv_scales_of,
    num_blocks_from_memory,
    uses_latent_cache,
)
from .logits_processing import process_logits, to_device
from .moe.fp8_experts import reserve_workspaces
from .multimodal import ImageEncoder, StepImages, is_vision_model
from .parallel.messages import Replica
from .sampler import sample
from .step import PromptRows, SamplingExtras, StepDescription
from .step_trace import StageMarks

if TYPE_CHECKING:
    from .layers.tensor_parallel import TensorParallel


@dataclass
class _StepEvents:
    d2h_done: torch.cuda.Event  # the sampled ids are in the slot's pinned host buffer
    start: torch.cuda.Event  # compute began (timing)
    end: torch.cuda.Event  # compute ended (timing)


@dataclass
class StepHandle:
    """One launched step, until `ModelRunner.wait` returns its tokens."""

    # NOTE: queued work reads only the slots' persistent buffers and tensors the caching allocator made on
    # the compute stream, which it reuses only in that stream's order: nothing else needs holding alive.
    meta: BatchMeta
    sampled_host: torch.Tensor  # view of the slot's pinned output buffer
    events: _StepEvents | None  # CUDA; None on CPU, where the step ran synchronously
    build_seconds: float = 0.0  # host time spent writing the batch into its IO slot
    cpu_seconds: float = 0.0  # CPU path: the step's compute time, measured synchronously
    extras: SamplingExtras | None = None
    logits: torch.Tensor | None = None  # between the forward and its sampling (held for `launch_sampling`)
    is_sampled: bool = False  # the sampling and its D2H copy are queued
    is_greedy_in_graph: bool = False  # a decode graph replayed, writing the argmax ids into the slot
    logprobs: logprobs.StepLogprobs | None = None  # readable after `wait`
    prompt_rows: PromptRows | None = None
    prompt_device: prompt_logprobs.DeviceResults | None = None  # computed with the forward, until copied down
    prompt_logprobs: prompt_logprobs.HostResults | None = None  # readable after `wait`
    marks: StageMarks | None = None  # only while tracing


def attention_backend_for(model: Any, choice: str, is_cuda: bool) -> AttentionBackend:
    """The Triton kernels on CUDA ("auto"; soft-capping families too: the kernels' SOFTCAP), else the torch
    reference. `model` is unused: every family's attention runs in both."""
    if choice == "auto":
        choice = "triton" if is_cuda else "torch"
    return TritonAttentionBackend() if choice == "triton" else AttentionBackend()


class StepBuildError(RuntimeError):
    """A step could not be written into its IO slot; nothing of it reached the device."""


class ModelRunner:
    """Executes steps: builds each plan into the next IO slot (the two slots alternate on every launch), carries
    over tokens still being sampled by the step in flight, and runs the forward and sampling on the device."""

    # `bench engine --trace` (Engine.trace_steps): None, or an object whose `on_step(marks, wait_start, wait_end,
    # meta)` gets each waited step's StageMarks and the host seconds `wait` blocked. None: no mark is made.
    tracer: Any = None

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        device: torch.device,
        num_kv_blocks: int,
        max_model_len: int,
        tp: TensorParallel | None = None,  # `model` is one rank's shard (models/shard_model.py)
        replica: Replica | None = None,  # with `tp`: this rank's part in the replica (ranks.py)
    ):
        self.model = model
        self.config = config
        self.device = device
        self.replica = replica
        self.is_cuda = device.type == "cuda"
        register_paged_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.attn_backend = attention_backend_for(model, config.attention_backend, self.is_cuda)
        self.sliding_windows = sliding_windows_of(model.config)
        self.kv_scales = kv_scales_of(model, config, latent=uses_latent_cache(model.config, config))
        if config.deterministic:
            reason = deterministic.unsupported_reason(self.is_cuda, self.sliding_windows, self.attn_backend)
            if reason is not None:
                raise ValueError(f"deterministic mode: {reason}")
        # A vision-language model's vision tower and embeddings cache (None: text only). Its language model runs
        # on the owned decoder where the family's declaration allows (decoder.py `unimplemented`), else on
        # transformers' forward. Only steps with image rows take input embeddings and M-RoPE positions
        # (image_inputs.py); the others (decodes: graphs) run on ids and positions.
        self.images = ImageEncoder(model, device) if is_vision_model(model) else None
        if self.images is not None and (config.deterministic or tp is not None):
            raise ValueError("a vision-language model runs on one rank, not deterministic")
        # The most tokens a step holds: the step budget, or a larger graph bucket
        step_capacity = max(config.max_num_batched_tokens, max(graph_buckets_for(config), default=0))
        # The owned, fused decoder (None: transformers' forward with cbq's attention registered).
        self.decoder = build_decoder(
            model,
            config.decoder,
            device,
            max_model_len,
            self.is_cuda and config.fused_kernels,
            config.decode_gemm,
            step_capacity,
            config.deterministic,
            tp=tp,
        )
        # transformers' forward over FP8 experts (moe/fp8_experts.py: decoder "hf" on an FP8 mixture of experts, or
        # latent attention on transformers' layers) runs the grouped GEMMs in a shared workspace, which a graph must
        # not capture mid-growth: sized here, once, for the largest step, before the KV cache takes what is left.
        # Without Triton their emulation syncs with the host, and that model's decode steps run eagerly. (The owned
        # decoder sizes its MoE workspace itself.)
        self._forward_capturable = self.decoder is not None or reserve_workspaces(model, step_capacity, model.dtype)

        # `measured`: the cache's size came from free memory, not --num-kv-blocks (a replica's rank 0 holds the
        # agreed count in its config, so its replica says so).
        measured = replica.measured if replica is not None else not config.num_kv_blocks
        if measured:
            # The engine sized the cache before the decoder was built; what the build keeps (the MoE workspace, any
            # weight a family's decoder does not take as a view) must come out of it, or the cache does not fit.
            num_kv_blocks = min(
                num_kv_blocks, num_blocks_from_memory(model.config, kv_cache_dtype(config, model.dtype), device, config)
            )
            if replica is not None:
                num_kv_blocks = replica.agree_num_kv_blocks(num_kv_blocks)
            max_model_len = min(max_model_len, context_len(config, model.config, num_kv_blocks))
        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = allocate_kv_cache(
            model.config, num_kv_blocks, config.block_size, kv_cache_dtype(config, model.dtype), device,
            latent=uses_latent_cache(model.config, config),
        )  # fmt: skip
        if config.deterministic:  # its probe of the device's attention kernels needs the cache's shape and dtype
            self.attn_backend = deterministic.attention_backend(
                self.attn_backend, self.kv_caches[0][0], model.config.num_attention_heads, model.dtype
            )  # a shard's config holds its rank's heads
        max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.max_model_len = max_model_len
        # Decode steps pad to the graph buckets on CUDA even with graphs off, so that an eager step runs the
        # kernels, shapes and split counts its graph would: graph and eager then give the same tokens.
        buckets = graph_buckets_for(config) if self.is_cuda else ()
        self.builder = BatchBuilder(
            max(config.max_num_batched_tokens, max(buckets, default=0)),
            config.max_num_seqs,
            max_blocks_per_seq,
            config.block_size,
            device,
            buckets,
            max_model_len=max_model_len,
            long_rope_row_offset=longrope_original_len(model.config) or 0,
        )
        # The slot the next step is built into; the other one holds the launched step's sampled ids, which a
        # step's carry-over rows name.
        self._next_slot = 0
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            self.slot_compute_done = [torch.cuda.Event() for _ in range(2)]
        self.graphs = DecodeGraphs()
        self.vocab_size = model.config.vocab_size
        self._logprob_buffers: list[logprobs.LogprobBuffers | None] = [None, None]  # made on first use

    @property
    def _use_graphs(self) -> bool:
        # NOTE: the torch attention reads sequence lengths on the host, so it cannot be captured; nor, untested,
        # the all-reduce of a replica of more than one rank
        one_rank = self.replica is None or self.replica.state.world_size == 1
        return (
            self.is_cuda
            and self.config.use_cuda_graphs
            and self.attn_backend.name == "triton"
            and one_rank
            and self._forward_capturable
        )

    # -- one step ---------------------------------------------------------------------------------
    def launch(self, step: StepDescription) -> StepHandle:
        """Build `step` into the next IO slot and queue it on the device; returns without waiting. With
        constrained rows only the forward is queued: `launch_sampling` queues the rest."""
        t0 = time.perf_counter()
        try:
            meta = self.builder.build(step, self._next_slot)
        except Exception as exc:
            raise StepBuildError(f"{type(exc).__name__}: {exc}") from exc
        build_seconds = time.perf_counter() - t0
        if self.replica is None:
            handle = self._launch(meta, step.extras, step.prompt_rows, step.images)
        else:  # rank 0: only a step that builds reaches another rank
            self.replica.check()
            with self.replica.in_step():
                self.replica.send_step(step)
                handle = self._launch(meta, step.extras, step.prompt_rows, step.images)
        handle.build_seconds = build_seconds
        self._next_slot ^= 1
        return handle

    # NOTE: a helper never waits for its steps. Reusing an IO slot's host buffers is still safe: rank 0 sends
    # step N+2 (the next one in this slot) only after it waited for step N's samples, which needed every rank's
    # collectives of step N, which this rank's stream ran after the slot's host-to-device copy.
    def execute_step(self, step: StepDescription) -> None:
        """A replica's helper: run the step rank 0 sent, the same build, forward and (received) samples."""
        handle = self.launch(step)
        if not handle.is_sampled:  # rank 0 samples constrained rows later; its samples still come
            self.launch_sampling(handle)

    def unbuildable(self, step: StepDescription) -> list[tuple[int, Exception]]:
        """After a StepBuildError: the sequences (by index in `step`) that cannot be built even alone, with why.
        Each is built into the next slot, which no launched step uses; nothing is launched."""
        bad = []
        for b in range(step.num_seqs):
            try:
                self.builder.build(step.only(b), self._next_slot)
            except Exception as exc:
                bad.append((b, exc))
        return bad

    def wait(self, handle: StepHandle) -> tuple[list[int], float]:
        """Block until the step's tokens are on the host. Returns (token ids, device seconds of the step)."""
        assert handle.is_sampled, "a step with constrained rows needs launch_sampling before wait"
        wait_start = time.perf_counter() if self.tracer is not None else 0.0
        if handle.events is not None:
            handle.events.d2h_done.synchronize()
            seconds = handle.events.start.elapsed_time(handle.events.end) / 1000.0
        else:
            seconds = handle.cpu_seconds
        if self.tracer is not None:
            self.tracer.on_step(handle.marks, wait_start, time.perf_counter(), handle.meta)
        return handle.sampled_host[: handle.meta.num_sample_rows].tolist(), seconds

    def _launch(
        self,
        meta: BatchMeta,
        extras: SamplingExtras | None,
        prompt_rows: PromptRows | None,
        images: StepImages | None = None,
    ) -> StepHandle:
        slot = self.builder.slots[meta.slot]
        # Slots alternate on every launch, so the previous step's sampled ids live in the other slot.
        prev_sampled = self.builder.slots[1 - meta.slot].sampled_dev
        defer_sampling = extras is not None and bool(extras.mask_rows)
        marks = StageMarks() if self.tracer is not None else None
        if not self.is_cuda:
            t0 = time.perf_counter()
            self._copy_inputs(slot, meta)
            if marks is not None:
                marks.h2d_start, marks.h2d_end = t0, time.perf_counter()
                marks.compute_start = marks.h2d_end
            logits, is_greedy_in_graph = self._forward_logits(slot, meta, prev_sampled, prompt_rows, images)
            logits, prompt_device = self._split_prompt_rows(logits, meta, prompt_rows)
            handle = StepHandle(meta, slot.sampled_host, None, cpu_seconds=time.perf_counter() - t0)
        else:
            h2d_done = torch.cuda.Event()
            events = _StepEvents(
                torch.cuda.Event(), *(torch.cuda.Event(enable_timing=True) for _ in range(2))
            )
            if marks is not None:
                marks = StageMarks.for_cuda(events.start, events.end)
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(self.slot_compute_done[meta.slot])
                if marks is not None:
                    marks.h2d_start.record()
                self._copy_inputs(slot, meta)
                if marks is not None:  # before h2d_done: complete whenever what waits on h2d_done runs
                    marks.h2d_end.record()
                h2d_done.record()
            with torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(h2d_done)
                events.start.record()
                logits, is_greedy_in_graph = self._forward_logits(slot, meta, prev_sampled, prompt_rows, images)
                logits, prompt_device = self._split_prompt_rows(logits, meta, prompt_rows)
                if defer_sampling:  # guards the slot's inputs even if the sampling is never launched
                    self.slot_compute_done[meta.slot] = torch.cuda.Event()
                    self.slot_compute_done[meta.slot].record()
            handle = StepHandle(meta, slot.sampled_host, events)
        handle.extras, handle.logits, handle.is_greedy_in_graph = extras, logits, is_greedy_in_graph
        handle.marks = marks
        handle.prompt_rows, handle.prompt_device = prompt_rows, prompt_device
        if not defer_sampling:
            self.launch_sampling(handle)
        return handle

    def launch_sampling(self, handle: StepHandle, bitmask: torch.Tensor | None = None) -> None:
        """Queue the sampling of a launched step and its D2H copy. `bitmask`: host rows [len(mask_rows),
        ceil(V / 32)] int32 for `extras.mask_rows`, pinned on CUDA and unchanged until the step is waited for."""
        if self.replica is None:
            self._launch_sampling(handle, bitmask)
            return
        with self.replica.in_step():  # the samples' broadcast failed: a helper is gone
            self._launch_sampling(handle, bitmask)

    def _launch_sampling(self, handle: StepHandle, bitmask: torch.Tensor | None) -> None:
        meta = handle.meta
        slot = self.builder.slots[meta.slot]
        rows = meta.num_sample_rows
        marks = handle.marks
        if handle.events is None:
            t0 = time.perf_counter()
            lp_results = self._sample(slot, handle, bitmask)
            if marks is not None:
                marks.compute_end = marks.d2h_start = time.perf_counter()
            slot.sampled_host[:rows].copy_(slot.sampled_dev[:rows])
            if lp_results is not None:
                handle.logprobs = logprobs.copy_to_host(self._logprob_buffer(meta.slot), lp_results, False)
            self._copy_prompt_logprobs(handle, non_blocking=False)
            if marks is not None:
                marks.d2h_end = time.perf_counter()
            handle.cpu_seconds += time.perf_counter() - t0
        else:
            compute_done = torch.cuda.Event()
            with torch.cuda.stream(self.compute_stream):
                lp_results = self._sample(slot, handle, bitmask)
                handle.events.end.record()
                compute_done.record()
                self.slot_compute_done[meta.slot] = compute_done
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(compute_done)
                if marks is not None:
                    marks.d2h_start.record()
                slot.sampled_host[:rows].copy_(slot.sampled_dev[:rows], non_blocking=True)
                if lp_results is not None:
                    handle.logprobs = logprobs.copy_to_host(self._logprob_buffer(meta.slot), lp_results, True)
                self._copy_prompt_logprobs(handle, non_blocking=True)
                if marks is not None:  # before d2h_done, which `wait` synchronizes on
                    marks.d2h_end.record()
                handle.events.d2h_done.record()
        handle.logits, handle.is_sampled = None, True

    def _copy_inputs(self, slot: IOSlot, meta: BatchMeta) -> None:
        nb = self.is_cuda
        slot.int_dev.copy_(slot.int_host, non_blocking=nb)
        slot.float_dev.copy_(slot.float_host, non_blocking=nb)
        slot.tables_dev[: meta.num_seqs].copy_(slot.tables_host[: meta.num_seqs], non_blocking=nb)

    def _forward_logits(
        self,
        slot: IOSlot,
        meta: BatchMeta,
        prev_sampled: torch.Tensor,
        prompt_rows: PromptRows | None = None,
        images: StepImages | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """The step's logits (its sample rows', then any prompt rows'), and whether a decode graph already wrote
        their greedy ids into the slot."""
        key = (meta.slot, meta.num_seqs)
        if images is not None and not images.spans:
            images = None  # no image rows: M-RoPE's three rows are alike, the step's positions (batch.py) say them
        if meta.is_decode_only and key in self.graphs and images is None:
            assert prompt_rows is None, "a decode-only step has no prompt rows"
            return self.graphs.replay(key), True  # also writes the logits' argmax into slot.sampled_dev
        indices = slot.dev["logits_indices"][: meta.num_sample_rows]
        if prompt_rows is not None:  # the LM head runs on these extra rows only
            indices = torch.cat([indices, to_device(list(prompt_rows.token_indices), self.device, indices.dtype)])
        return self._forward_slot(slot, meta, prev_sampled, logits_indices=indices, images=images), False

    def _split_prompt_rows(
        self, logits: torch.Tensor, meta: BatchMeta, prompt_rows: PromptRows | None
    ) -> tuple[torch.Tensor, prompt_logprobs.DeviceResults | None]:
        """The sample rows' logits, and the prompt rows' logprobs computed from the rest (in the compute stream).
        A replica's helper computes none: its logits are its vocabulary part, which the prompt tokens' ids index
        past (a device-side assert on CUDA), and rank 0 alone reports the logprobs."""
        if prompt_rows is None:
            return logits, None
        if self.replica is not None and not self.replica.samples:
            return logits[: meta.num_sample_rows], None
        return prompt_logprobs.split_logits(logits, meta.num_sample_rows, prompt_rows)

    def _copy_prompt_logprobs(self, handle: StepHandle, non_blocking: bool) -> None:
        if handle.prompt_device is not None and handle.prompt_rows is not None:
            handle.prompt_logprobs = prompt_logprobs.copy_to_host(handle.prompt_rows, handle.prompt_device, non_blocking)
            handle.prompt_device = None  # the host results hold it until the copy is done

    def _sample(
        self, slot: IOSlot, handle: StepHandle, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Sample into `slot.sampled_dev` (a replica's helper: receive rank 0's samples there, in async mode);
        returns the logprob results on the device, if any rows asked."""
        if self.replica is None:
            return self._sample_here(slot, handle, bitmask)
        results = self._sample_here(slot, handle, bitmask) if self.replica.samples else None
        self.replica.share_samples(slot.sampled_dev[: handle.meta.num_sample_rows])
        return results

    def _sample_here(
        self, slot: IOSlot, handle: StepHandle, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        d = slot.dev
        meta, extras, logits = handle.meta, handle.extras, handle.logits
        assert logits is not None, "sampling a step twice"
        rows = meta.num_sample_rows
        wants_logprobs = extras is not None and bool(extras.logprob_rows)
        processes = extras is not None and extras.has_logit_processing
        plain = not meta.any_random and bitmask is None and not wants_logprobs and not processes
        if handle.is_greedy_in_graph and plain:
            return None  # the decode graph's argmax already is this step's sample
        lp_rows = None
        if extras is not None and extras.logprob_rows:  # raw logits: before anything rewrites them
            lp_rows = logprobs.prepare(logits, to_device(list(extras.logprob_rows), self.device), extras.num_top_logprobs)
        if extras is not None and processes:
            process_logits(slot, extras, logits)
        if bitmask is not None:
            assert extras is not None and len(extras.mask_rows) == bitmask.shape[0], (
                "one bitmask row per mask row"
            )
            mask_dev = bitmask.to(self.device, non_blocking=True)
            apply_token_bitmask(logits, to_device(list(extras.mask_rows), self.device), mask_dev)
        tokens = sample(
            logits,
            d["temperature"][:rows],
            d["top_p"][:rows],
            d["top_k"][:rows],
            d["seeds"][:rows],
            d["sample_positions"][:rows],
            meta.any_random,
            meta.any_top_k_top_p,
            d["min_p"][:rows] if meta.any_min_p else None,
        )
        slot.sampled_dev[:rows].copy_(tokens)
        return None if lp_rows is None else logprobs.finish(lp_rows, tokens)

    def _logprob_buffer(self, slot_index: int) -> logprobs.LogprobBuffers:
        buffers = self._logprob_buffers[slot_index]
        if buffers is None:
            buffers = self._logprob_buffers[slot_index] = logprobs.LogprobBuffers(
                self.config.max_num_seqs, self.is_cuda
            )
        return buffers

    def _forward_slot(
        self,
        slot: IOSlot,
        meta: BatchMeta,
        prev_sampled: torch.Tensor,
        logits_indices: torch.Tensor | int,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """The forward of the step in `slot` (what a decode graph captures): carry-over gather, then `_forward`."""
        d = slot.dev
        num_tokens, num_seqs = meta.num_tokens, meta.num_seqs
        input_ids = d["input_ids"][:num_tokens]
        if meta.has_carry or meta.is_decode_only:
            # Carry-over: fill placeholders with the previous step's sampled ids, on the device.
            src = d["carry_src"][:num_tokens]
            input_ids.copy_(torch.where(src >= 0, prev_sampled[src.clamp(min=0)], input_ids))
        attn = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=d["slot_mapping"][:num_tokens],
            block_tables=d["block_tables"][:num_seqs],
            cu_seqlens_q=d["cu_seqlens_q"][: num_seqs + 1],
            context_lens=d["context_lens"][:num_seqs],
            max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len,
            is_decode_only=meta.is_decode_only,
            backend=self.attn_backend,
            sliding_windows=self.sliding_windows,
            kv_scales=self.kv_scales,
            num_decode_seqs=meta.num_decode_seqs,
            prefill_lens=meta.prefill_lens,
        )
        return self._forward(input_ids, d["positions"][:num_tokens], attn, logits_indices, images)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | int,
        images: StepImages | None = None,
    ) -> torch.Tensor:
        """The model: token ids [T] at positions [T], with this step's attention metadata. Returns the logits of
        the rows `logits_indices` picks ([R, vocab]; 0 keeps them all). `images`: a vision-language model's step
        with images, whose embeddings and M-RoPE positions (multimodal.py) replace the ids and `positions`."""
        inputs = None
        if images is not None:
            assert self.images is not None, "a step with images on a text-only model"
            inputs = self.images.step_inputs(input_ids, images, input_ids.shape[0])  # embeddings, positions, DeepStack
            attn = self.images.attention(attn, images, input_ids.shape[0])  # a both-ways image's rows: key_limits
        if self.decoder is not None:
            rows = logits_indices if torch.is_tensor(logits_indices) else None
            return self.decoder(input_ids, positions, attn, rows, images=inputs)
        if inputs is not None:
            out = self.model(**inputs.hf_kwargs(), logits_to_keep=logits_indices, use_cache=False, cbq=attn)
            return out.logits[0]
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=logits_indices,
            use_cache=False,
            cbq=attn,
        )
        return out.logits[0]

    def close(self) -> None:
        """Release what the runner holds besides memory: a replica's rank 0 stops its helpers."""
        if self.replica is not None:
            self.replica.close()

    # -- CUDA graphs ------------------------------------------------------------------------------
    def capture_graphs(self) -> None:
        """Capture the decode graphs (cuda_graphs.py), when this runner uses them."""
        if self._use_graphs:
            self.graphs.capture(self.builder, self._forward_slot, self.compute_stream, self.max_model_len, self.device)
