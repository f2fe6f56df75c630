"""The decode steps' CUDA graphs: their batch buckets, the capture (one graph per IO slot and bucket, padded
dummy inputs, the greedy argmax inside the graph) and the graphs with the logits tensors they write.

The runner (model_runner.py) decides whether graphs are used and replays them; what one graph runs is its
`forward_slot`, the same code an eager step runs, so graph and eager steps give the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch import BatchBuilder, BatchMeta, IOSlot
from .config import EngineConfig

# Decode batch sizes that get a CUDA graph; a decode step pads up to the next one. Dense where batches
# are small (every padded row costs a full row of weights traffic), coarser where they are large.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)

# (slot, meta, the other slot's sampled ids, logits_indices) -> logits: the runner's forward of one slot
ForwardSlot = Callable[[IOSlot, BatchMeta, torch.Tensor, int], torch.Tensor]


def graph_buckets_for(config: EngineConfig) -> tuple[int, ...]:
    """The buckets a decode step can fill: at most `max_num_seqs` rows and `max_num_batched_tokens` tokens."""
    return tuple(b for b in GRAPH_BUCKETS if b <= min(config.max_num_seqs, config.max_num_batched_tokens))


class DecodeGraphs:
    """The captured graphs by (IO slot, bucket), each with the logits tensor its replay writes. Empty until
    `capture` runs (and always on CPU, or with graphs off)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.graphs

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Run the graph of (slot, bucket); it also writes the logits' argmax into the slot's `sampled_dev`."""
        self.graphs[key].replay()
        return self.logits[key]

    @torch.inference_mode()
    def capture(
        self,
        builder: BatchBuilder,
        forward_slot: ForwardSlot,
        compute_stream: torch.cuda.Stream,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        """One graph per (IO slot, batch bucket), largest first, all in one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for slot_index in (0, 1):
            slot = builder.slots[slot_index]
            prev_sampled = builder.slots[1 - slot_index].sampled_dev
            for bucket in sorted(builder.graph_buckets, reverse=True):
                meta = decode_capture_meta(slot_index, bucket, max_model_len)
                fill_padding_decode(slot, bucket)
                with torch.cuda.stream(compute_stream):
                    forward_slot(slot, meta, prev_sampled, 0)  # warm-up outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=compute_stream):
                    logits = forward_slot(slot, meta, prev_sampled, 0)
                    slot.sampled_dev[:bucket].copy_(logits.argmax(dim=-1))  # greedy inside the graph
                self.graphs[(slot_index, bucket)] = graph
                self.logits[(slot_index, bucket)] = logits
        torch.cuda.synchronize(device)


def decode_capture_meta(slot_index: int, bucket: int, max_model_len: int) -> BatchMeta:
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


def fill_padding_decode(slot: IOSlot, bucket: int) -> None:
    """Valid dummy inputs for capture: every row a padding row (context 0, scratch slot)."""
    d = slot.dev
    d["input_ids"][:bucket].zero_()
    d["positions"][:bucket].zero_()
    d["slot_mapping"][:bucket].zero_()
    d["carry_src"][:bucket].fill_(-1)
    d["cu_seqlens_q"][: bucket + 1].copy_(torch.arange(bucket + 1, dtype=torch.int32))
    d["context_lens"][:bucket].zero_()
    d["block_tables"][:bucket].zero_()
