"""Model runner: owns the model, the paged KV cache, the CUDA streams and events, the CUDA graphs (and their
batch buckets), the alternation of the two IO slots and the carry-over map.

`launch(plan)` builds a scheduled step into the next IO slot, queues it on the device and returns at once
with a `StepHandle`; `wait(handle)` blocks until that step's sampled tokens are on the host. A step launched
while an earlier one is still in flight (async mode) takes the in-flight tokens from that step's output on
the device (carry-over). On CUDA a step is:
  H2D stream:     wait until the slot's previous compute finished; copy the slot's host buffers up
  compute stream: wait for H2D; carry-over gather; forward (graph replay for decode); sample
  D2H stream:     wait for compute; copy sampled ids down; record `d2h_done`
The default stream is never used in the loop. On CPU the streams and events are no-ops and the same
code runs synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .attention_backend import (
    ATTN_IMPLEMENTATION,
    AttentionBackend,
    AttentionMetadata,
    TritonAttentionBackend,
    register_paged_attention,
    sliding_windows_of,
)
from .batch import BatchBuilder, BatchMeta, IOSlot
from .config import EngineConfig
from .fused_ops import install_fused_rmsnorm, install_fused_rotary
from .kv_cache import allocate_kv_cache
from .sampler import sample
from .scheduler import StepPlan
from .sequence import Sequence

# Decode batch sizes that get a CUDA graph; a decode step pads up to the next one. Dense where batches
# are small (every padded row costs a full row of weights traffic), coarser where they are large.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def graph_buckets_for(config: EngineConfig) -> tuple[int, ...]:
    """The buckets a decode step can fill: at most `max_num_seqs` rows and `max_num_batched_tokens` tokens."""
    return tuple(b for b in GRAPH_BUCKETS if b <= min(config.max_num_seqs, config.max_num_batched_tokens))


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


class ModelRunner:
    """Executes steps: builds each plan into the next IO slot (the two slots alternate on every launch), carries
    over tokens still being sampled by the step in flight, and runs the forward and sampling on the device."""

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        device: torch.device,
        num_kv_blocks: int,
        max_model_len: int,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.is_cuda = device.type == "cuda"
        register_paged_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.is_cuda else "torch"
        self.attn_backend = TritonAttentionBackend() if backend == "triton" else AttentionBackend()
        self.sliding_windows = sliding_windows_of(model.config)
        if self.is_cuda and config.fused_kernels:
            install_fused_rmsnorm(model)
            install_fused_rotary(model)

        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = allocate_kv_cache(
            model.config, num_kv_blocks, config.block_size, model.dtype, device
        )
        max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.max_model_len = max_model_len
        buckets = graph_buckets_for(config) if self._use_graphs else ()
        self.builder = BatchBuilder(
            max(config.max_num_batched_tokens, max(buckets, default=0)),
            config.max_num_seqs,
            max_blocks_per_seq,
            config.block_size,
            device,
            buckets,
        )
        # The slot the next step is built into, and the output rows of the launched step whose tokens the
        # host has not seen yet (the carry-over map: the next step's placeholders are filled from them).
        self._next_slot = 0
        self._inflight_rows: dict[Sequence, int] = {}
        self._latest: StepHandle | None = None
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            self.slot_compute_done = [torch.cuda.Event() for _ in range(2)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.vocab_size = model.config.vocab_size

    @property
    def _use_graphs(self) -> bool:
        return self.is_cuda and self.config.use_cuda_graphs

    # -- one step ---------------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> StepHandle:
        """Build `plan` into the next IO slot and queue it on the device; returns without waiting."""
        t0 = time.perf_counter()
        meta = self.builder.build(plan, self._next_slot, self._inflight_rows)
        build_seconds = time.perf_counter() - t0
        handle = self._launch(meta)
        handle.build_seconds = build_seconds
        self._next_slot ^= 1
        self._inflight_rows = {c.seq: row for row, c in enumerate(plan.sampling_chunks())}
        self._latest = handle
        return handle

    def wait(self, handle: StepHandle) -> tuple[list[int], float]:
        """Block until the step's tokens are on the host. Returns (token ids, device seconds of the step)."""
        if handle.events is not None:
            handle.events.d2h_done.synchronize()
            seconds = handle.events.start.elapsed_time(handle.events.end) / 1000.0
        else:
            seconds = handle.cpu_seconds
        if handle is self._latest:
            self.discard_inflight()  # its tokens are known now: the next step carries nothing over
        return handle.sampled_host[: handle.meta.num_sample_rows].tolist(), seconds

    def discard_inflight(self) -> None:
        """Forget the launched step (its tokens are known, or it failed and will never be waited for)."""
        self._inflight_rows = {}
        self._latest = None

    def _launch(self, meta: BatchMeta) -> StepHandle:
        slot = self.builder.slots[meta.slot]
        # Slots alternate on every launch, so the previous step's sampled ids live in the other slot.
        prev_sampled = self.builder.slots[1 - meta.slot].sampled_dev
        if not self.is_cuda:
            t0 = time.perf_counter()
            self._copy_inputs(slot, meta)
            self._compute(slot, meta, prev_sampled)
            slot.sampled_host[: meta.num_sample_rows].copy_(slot.sampled_dev[: meta.num_sample_rows])
            return StepHandle(meta, slot.sampled_host, None, cpu_seconds=time.perf_counter() - t0)
        h2d_done, start, end, compute_done, d2h_done = (
            torch.cuda.Event(enable_timing=i in (1, 2)) for i in range(5)
        )
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self.slot_compute_done[meta.slot])
            self._copy_inputs(slot, meta)
            h2d_done.record()
        with torch.cuda.stream(self.compute_stream):
            self.compute_stream.wait_event(h2d_done)
            start.record()
            self._compute(slot, meta, prev_sampled)
            end.record()
            compute_done.record()
            self.slot_compute_done[meta.slot] = compute_done
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(compute_done)
            rows = meta.num_sample_rows
            slot.sampled_host[:rows].copy_(slot.sampled_dev[:rows], non_blocking=True)
            d2h_done.record()
        return StepHandle(meta, slot.sampled_host, _StepEvents(d2h_done, start, end))

    def _copy_inputs(self, slot: IOSlot, meta: BatchMeta) -> None:
        nb = self.is_cuda
        slot.int_dev.copy_(slot.int_host, non_blocking=nb)
        slot.float_dev.copy_(slot.float_host, non_blocking=nb)
        slot.tables_dev[: meta.num_seqs].copy_(slot.tables_host[: meta.num_seqs], non_blocking=nb)

    def _compute(self, slot: IOSlot, meta: BatchMeta, prev_sampled: torch.Tensor) -> None:
        d = slot.dev
        rows = meta.num_sample_rows
        key = (meta.slot, meta.num_seqs)
        if meta.is_decode_only and key in self.graphs:
            self.graphs[key].replay()
            logits = self.graph_logits[key]
        else:
            logits = self._forward_slot(slot, meta, prev_sampled, logits_indices=d["logits_indices"][:rows])
        tokens = sample(
            logits,
            d["temperature"][:rows],
            d["top_p"][:rows],
            d["top_k"][:rows],
            d["seeds"][:rows],
            d["sample_positions"][:rows],
            meta.any_random,
            meta.any_top_k_top_p,
        )
        slot.sampled_dev[:rows].copy_(tokens)

    def _forward_slot(
        self, slot: IOSlot, meta: BatchMeta, prev_sampled: torch.Tensor, logits_indices: torch.Tensor | int
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
        )
        return self._forward(input_ids, d["positions"][:num_tokens], attn, logits_indices)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | int,
    ) -> torch.Tensor:
        """The model: token ids [T] at positions [T], with this step's attention metadata. Returns the logits of
        the rows `logits_indices` picks ([R, vocab]; 0 keeps them all)."""
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=logits_indices,
            use_cache=False,
            cbq=attn,
        )
        return out.logits[0]

    # -- CUDA graphs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One graph per (IO slot, batch bucket), largest first, all in one memory pool."""
        if not self._use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for slot_index in (0, 1):
            slot = self.builder.slots[slot_index]
            prev_sampled = self.builder.slots[1 - slot_index].sampled_dev
            for bucket in sorted(self.builder.graph_buckets, reverse=True):
                meta = _decode_capture_meta(slot_index, bucket, self.max_model_len)
                _fill_padding_decode(slot, bucket)
                with torch.cuda.stream(self.compute_stream):
                    self._forward_slot(slot, meta, prev_sampled, logits_indices=0)  # warm-up outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.compute_stream):
                    logits = self._forward_slot(slot, meta, prev_sampled, logits_indices=0)
                self.graphs[(slot_index, bucket)] = graph
                self.graph_logits[(slot_index, bucket)] = logits
        torch.cuda.synchronize(self.device)


def _decode_capture_meta(slot_index: int, bucket: int, max_model_len: int) -> BatchMeta:
    # Graphs are captured for the worst case, so kernels size their grids for any context length.
    return BatchMeta(
        slot=slot_index,
        num_tokens=bucket,
        num_seqs=bucket,
        num_real_seqs=bucket,
        num_sample_rows=bucket,
        max_query_len=1,
        max_context_len=max_model_len,
        is_decode_only=True,
        any_random=False,
        any_top_k_top_p=False,
        has_carry=True,
    )


def _fill_padding_decode(slot: IOSlot, bucket: int) -> None:
    """Valid dummy inputs for capture: every row a padding row (context 0, scratch slot)."""
    d = slot.dev
    d["input_ids"][:bucket].zero_()
    d["positions"][:bucket].zero_()
    d["slot_mapping"][:bucket].zero_()
    d["carry_src"][:bucket].fill_(-1)
    d["cu_seqlens_q"][: bucket + 1].copy_(torch.arange(bucket + 1, dtype=torch.int32))
    d["context_lens"][:bucket].zero_()
    d["block_tables"][:bucket].zero_()
