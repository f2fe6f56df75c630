"""The packed forward of a decoder embedding model: a batch's inputs in one row of tokens through cbq's owned decoder.

Owns the owned decoder built over the embedding model (`OwnedDecoder`, worker/engine/decoder.py, its fused weights
views of the base model's) and the scratch KV cache one batch attends over. A batch of B inputs runs as one prefill:
their tokens laid end to end (no padding), each input's positions from 0 and its `cu_seqlens` span, causal
attention within each input only (the generation engine's varlen prefill: kernels/attention.py on CUDA,
worker/engine/attention.py's torch reference on the CPU), the final norm's hidden states pooled per input
(pooling.pool_packed). Nothing is kept after the batch: every layer writes its K/V into the same scratch cache and
attends over it before the next layer overwrites it (one stream orders them), so the cache holds one layer of one
batch. Each input's slots start on a block boundary, so its block table is a run of consecutive blocks.

Runs the families the owned decoder implements (`unsupported_reason`): Qwen3-Embedding, gte-Qwen2, e5-mistral and
other Llama-shaped releases. Encoders (BERT, ...) keep transformers' forward (engine.py).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.embedding.checkpoint import PoolingMode
from worker.embedding.pooling import packed_layout, pool_packed
from worker.engine.attention_backend import (
    AttentionBackend,
    AttentionMetadata,
    TritonAttentionBackend,
    sliding_windows_of,
)
from worker.engine.decoder import OwnedDecoder, unsupported_reason
from worker.engine.kernels.common import HAVE_TRITON
from worker.engine.kv_cache import head_dim_of

BLOCK_SIZE = 16  # tokens per scratch-cache block: an input wastes less than one block of slots


class _BaseModelAsDecoder:
    """What the owned decoder reads of a causal LM, over a base model (`AutoModel`: no LM head): the family's module
    paths (`model.layers`, `model.norm`, ...) resolve under `.model`, and there are no output embeddings."""

    def __init__(self, base_model: Any):
        self.model = base_model
        self.config = base_model.config

    def get_output_embeddings(self) -> None:
        return None


def packed_unsupported_reason(base_model: Any) -> str | None:
    """Why the packed forward cannot run `base_model` (None: it can)."""
    if not hasattr(base_model, "layers"):  # a causal LM, or an encoder's base model
        return f"{type(base_model).__name__} is not a decoder's base model"
    return unsupported_reason(_BaseModelAsDecoder(base_model))


class PackedDecoderForward:
    """`launch(batch_ids)`: one batch's pooled [B, dim] fp32 vectors, queued on the device (no sync)."""

    def __init__(self, base_model: Any, device: torch.device, max_seq_length: int, use_triton: bool | None = None):
        reason = packed_unsupported_reason(base_model)
        if reason is not None:
            raise ValueError(f"the packed decoder forward cannot run this model: {reason}")
        if use_triton is None:
            use_triton = device.type == "cuda" and HAVE_TRITON
        self.device = device
        config = base_model.config
        self.decoder = OwnedDecoder(_BaseModelAsDecoder(base_model), max_seq_length, use_triton)
        self.backend: AttentionBackend = TritonAttentionBackend() if use_triton else AttentionBackend()
        self.num_layers = len(self.decoder.layers)
        self.sliding_windows = sliding_windows_of(config)
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.dtype = self.decoder.embed_weight.dtype
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None  # grown to the largest batch seen

    def _scratch_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0].shape[0] < num_blocks:
            self._cache = None  # free the old one before the larger one is allocated
            shape = (num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
            self._cache = (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
        return self._cache

    @torch.inference_mode()
    def launch(self, batch_ids: list[list[int]], pooling: PoolingMode, normalize: bool) -> torch.Tensor:
        """The batch's vectors [B, dim] fp32, pooled by `pooling` and L2-normalized when `normalize`."""
        lengths_cpu, cu_cpu, input_of_token, positions_cpu = packed_layout(batch_ids)
        # each input's slots from a block boundary: its block table is start_block .. start_block + its blocks - 1
        blocks_per_input = (lengths_cpu + BLOCK_SIZE - 1) // BLOCK_SIZE
        start_block = torch.cumsum(blocks_per_input, 0) - blocks_per_input
        num_blocks = int(blocks_per_input.sum())
        slots_cpu = start_block[input_of_token] * BLOCK_SIZE + positions_cpu
        max_len = int(lengths_cpu.max())
        max_blocks = (max_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        # entries past an input's own blocks are never read (its context length bounds them); clamped into the cache
        tables_cpu = (start_block[:, None] + torch.arange(max_blocks)[None, :]).clamp(max=num_blocks - 1)
        input_ids_cpu = torch.tensor([t for ids in batch_ids for t in ids], dtype=torch.int32)
        host = {
            "input_ids": input_ids_cpu,
            "positions": positions_cpu.to(torch.int32),
            "slot_mapping": slots_cpu.to(torch.int32),
            "block_tables": tables_cpu.to(torch.int32),
            "cu_seqlens": cu_cpu.to(torch.int32),
            "cu_seqlens_long": cu_cpu,
            "lengths": lengths_cpu.to(torch.int32),
            "lengths_long": lengths_cpu,
        }
        if self.device.type == "cuda":  # pinned, so that the copies are asynchronous
            host = {name: t.pin_memory() for name, t in host.items()}
        dev = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
        k_cache, v_cache = self._scratch_cache(num_blocks)
        attn = AttentionMetadata(
            kv_caches=[(k_cache, v_cache)] * self.num_layers,  # one scratch cache: each layer overwrites the last's
            slot_mapping=dev["slot_mapping"],
            block_tables=dev["block_tables"],
            cu_seqlens_q=dev["cu_seqlens"],
            context_lens=dev["lengths"],
            max_query_len=max_len,
            max_context_len=max_len,
            is_decode_only=False,
            backend=self.backend,
            sliding_windows=self.sliding_windows,
        )
        # the rows pooling reads: the last token's of each input (lasttoken), the first's (cls), or all
        if pooling in ("lasttoken", "cls"):
            rows = dev["cu_seqlens_long"][1:] - 1 if pooling == "lasttoken" else dev["cu_seqlens_long"][:-1]
            hidden, _ = self.decoder.final_hidden(dev["input_ids"], dev["positions"], attn, rows)
            pooled = hidden.float()
        else:
            hidden, _ = self.decoder.final_hidden(dev["input_ids"], dev["positions"], attn)
            pooled = pool_packed(hidden, dev["cu_seqlens_long"], dev["lengths_long"], pooling)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled
