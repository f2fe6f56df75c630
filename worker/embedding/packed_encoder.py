"""The packed forward of an encoder embedding model (BERT and XLM-RoBERTa shapes: bge, e5, all-MiniLM, bge-m3,
multilingual-e5): a batch's inputs laid end to end in one row of tokens through transformers' own modules.

Owns nothing but the model's attention setting during its calls: `PackedEncoderForward` runs the model with its
config set to `vision_attention.packed_attention` (each input attends to itself alone, bidirectionally, cut by the
`cu_seq_lens_q` passed down to every attention call), and back to the model's own after (transformers' padded
forward over the same model, `decoder="hf"`, keeps sdpa), and gives each input its own positions (0.. for BERT; after the padding id
for XLM-RoBERTa's embeddings, as their `create_position_ids_from_input_ids` numbers real tokens). So the linears, norms
and the feed-forward, nearly all of an encoder's work, run on real tokens only, where the padded forward runs them
on up to 1 - 1/BUCKET_RATIO padding; attention pads each batch's inputs to its longest inside the call.

ModernBERT (its own unpadding and local attention) and relative position embeddings keep the padded forward.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.embedding.checkpoint import PoolingMode
from worker.embedding.pooling import packed_layout, pool_packed
from worker.engine.models.vision_attention import PACKED_ATTENTION, register_packed_attention

# model types whose embeddings take position_ids and whose attention modules call transformers' attention interface
PACKED_ENCODER_TYPES = ("bert", "xlm-roberta")
# XLM-RoBERTa's embeddings number real tokens after the padding id (transformers' create_position_ids_from_input_ids)
_POSITIONS_AFTER_PADDING = ("xlm-roberta",)


def packed_encoder_unsupported_reason(model: Any) -> str | None:
    """Why the packed encoder forward cannot run `model` (an `AutoModel` base model; None: it can)."""
    config = model.config
    if config.model_type not in PACKED_ENCODER_TYPES:
        return f"{config.model_type} is not an encoder cbq packs ({', '.join(PACKED_ENCODER_TYPES)})"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return f"{config.model_type} configured as a decoder"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        return f"position_embedding_type {position_type!r} (relative positions span the whole row)"
    return None


class PackedEncoderForward:
    """`launch(batch_ids, pooling, normalize)`: one batch's pooled [B, dim] fp32 vectors, queued on the device."""

    def __init__(self, model: Any, device: torch.device):
        reason = packed_encoder_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the packed encoder forward cannot run this model: {reason}")
        self.model = model
        self.device = device
        padding_idx: int | None = getattr(getattr(model, "embeddings", None), "padding_idx", None)
        after_padding = model.config.model_type in _POSITIONS_AFTER_PADDING
        self.first_position = padding_idx + 1 if after_padding and padding_idx is not None else 0
        register_packed_attention()

    @torch.inference_mode()
    def launch(self, batch_ids: list[list[int]], pooling: PoolingMode, normalize: bool) -> torch.Tensor:
        lengths_cpu, cu_cpu, _, positions_cpu = packed_layout(batch_ids)
        host = {
            "input_ids": torch.tensor([t for ids in batch_ids for t in ids], dtype=torch.int64),
            "positions": positions_cpu + self.first_position,
            "cu_seqlens": cu_cpu.to(torch.int32),
            "cu_seqlens_long": cu_cpu,
            "lengths": lengths_cpu,
        }
        if self.device.type == "cuda":  # pinned, so that the copies are asynchronous
            host = {name: t.pin_memory() for name, t in host.items()}
        dev = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
        input_ids = dev["input_ids"][None]
        config = self.model.config  # every attention module of the model reads it at call time
        own, config._attn_implementation = config._attn_implementation, PACKED_ATTENTION
        try:
            hidden = self.model(
                input_ids=input_ids,
                position_ids=dev["positions"][None],
                token_type_ids=torch.zeros_like(input_ids),
                cu_seq_lens_q=dev["cu_seqlens"],
                max_length_q=int(lengths_cpu.max()),
            ).last_hidden_state[0]
        finally:
            config._attn_implementation = own
        pooled = pool_packed(hidden, dev["cu_seqlens_long"], dev["lengths"], pooling)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled
