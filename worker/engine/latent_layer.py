"""Multi-head latent attention in the owned decoder (DeepSeek-V2/V3, Kimi K2, Moonlight: `Family.mla`): one
`LatentAttention` per layer, which the decoder's layer loop calls in place of its QKV, rotary and attention stage.

Per layer: one GEMM for the inputs of the query and of the latent (q_proj, or q_a_proj under a q LoRA, stacked with
kv_a_proj_with_mqa at load as q/k/v are: `latent_layer_spec`), the q LoRA's norm and q_b_proj where the config has
one, the latent's norm, transformers' own rotary on the decoupled rope dims (`LatentRope`: its position embeddings
computed once for every position at load, read per token, so the rotated bits are generate's), then the math the
hf path shares (latent_attention.attend_latent: the cache write, the absorbed query W_UK^T q_nope, the paged
attention over the latent cache, the decode kernel on CUDA, W_UV). The output projection is the decoder's
(`LayerWeights.o_weight`), as every family's. The GEMMs run through the decoder's `ops.linear`, so each weight is
multiplied by its own method: the FP8 releases' linears kept in FP8 on sm89+ CUDA too (their query and latent input
projections stacked where no block of scales straddles the two, else two GEMMs: `stacks_inputs`); kv_b_proj is
dequantized once for the absorbed products (latent_attention.kv_b_heads). The norms run through `ops.add_norm` (Triton
on CUDA, transformers' RMSNorm bit for bit on the CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .attention_backend import AttentionMetadata
from .families.spec import Family, LayerSpec, LinearSpec, MlaSpec, Parallel
from .fused_weights import LayerWeights, linear_quant, linear_weights, submodule
from .latent_attention import attend_latent, kv_b_heads, rotate
from .layer_ops import LayerOps


def latent_layer_spec(family: Family, config: Any, layers: Any, dtype: torch.dtype) -> LayerSpec:
    """The family's layer with its `qkv` GEMM the latent attention's input projection: the query's (q_proj, or
    q_a_proj under a q LoRA) rows, then kv_a_proj_with_mqa's (latent and rotary key), which read the same normed
    input, stacked into one GEMM where they can be (`stacks_inputs`); else the query's alone, kv_a_proj_with_mqa
    its own GEMM (`LatentAttention`). `o` stays the output projection. A linear kept quantized (the FP8 releases
    on sm89+ CUDA) is multiplied by its method, as every family's."""
    mla = family.mla
    assert mla is not None, f"{family.name} declares no latent attention"
    query = _query_input(mla, config)
    parts = (query, mla.kv_a_proj) if stacks_inputs(layers[0], mla, config) else (query,)
    return dataclasses.replace(family.layer, qkv=LinearSpec(parts, Parallel.COLUMN))


def _query_input(mla: MlaSpec, config: Any) -> str:
    """The query's input projection: q_a_proj under a q LoRA, else q_proj."""
    return mla.q_a_proj if config.q_lora_rank else mla.q_proj


def stacks_inputs(layer: Any, mla: MlaSpec, config: Any) -> bool:
    """Whether the query's input projection and kv_a_proj_with_mqa stack into one GEMM: always in the model dtype;
    block-wise FP8 ones where the query's rows end on a block (the releases': q_a_proj's 1,536 rows, or V2-Lite's and
    Moonlight's q_proj of 128 x 192 heads), so that no block of scales straddles the two."""
    query = submodule(layer, _query_input(mla, config))
    scheme = getattr(getattr(query, "layer", None), "scheme", None)
    block_shape = getattr(scheme, "block_shape", None)
    return block_shape is None or query.out_features % block_shape[0] == 0


class LatentRope:
    """transformers' rotary position embeddings for every position, computed once by the model's own rotary module
    (V2: complex freqs_cis [N, r/2]; V3: cos, sin [N, r]), read per token at `positions`. The module's forward is
    element-wise per position, so the rows are the bits generate's forward computes at those positions."""

    def __init__(self, rotary_emb: Any, num_positions: int, like: torch.Tensor):
        with torch.no_grad():
            table = rotary_emb(like, torch.arange(num_positions, device=like.device)[None])
        self.table: tuple[torch.Tensor, ...] = tuple(t[0] for t in table) if isinstance(table, tuple) else (table[0],)

    def __call__(self, positions: torch.Tensor) -> Any:
        rows = tuple(t[positions] for t in self.table)
        return rows if len(rows) > 1 else rows[0]


class LatentAttention:
    """One layer's latent attention (module docstring): normed hidden rows [T, hidden] -> the heads' values
    [T, H * v_head_dim], which the decoder's output projection then takes."""

    def __init__(self, layer: Any, mla: MlaSpec, weights: LayerWeights, rope: LatentRope, dtype: torch.dtype):
        self.module = module = submodule(layer, mla.kv_b_proj.rpartition(".")[0])  # transformers' attention module
        self.heads, self.nope, self.rope_dim = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
        self.kv_lora, self.v_dim = module.kv_lora_rank, module.v_head_dim
        self.q_width = module.q_lora_rank or self.heads * (self.nope + self.rope_dim)
        self.in_weight, self.in_bias = weights.qkv_weight, weights.qkv_bias
        # kv_a_proj_with_mqa as a GEMM of its own where it does not stack with the query's input (`stacks_inputs`)
        self.kv_a_weight: Any = None
        self.kv_a_bias: torch.Tensor | None = None
        if not stacks_inputs(layer, mla, module.config):
            kv_a = LinearSpec((mla.kv_a_proj,), Parallel.COLUMN)
            self.kv_a_weight, self.kv_a_bias = linear_weights(layer, linear_quant(layer, kv_a))
        self.q_a_norm: tuple[torch.Tensor, float] | None = None
        self.q_b_weight: Any = None
        self.q_b_bias: torch.Tensor | None = None
        if module.q_lora_rank:
            q_a_norm = submodule(layer, mla.q_a_norm)
            self.q_a_norm = (q_a_norm.weight, q_a_norm.variance_epsilon)
            q_b = LinearSpec((mla.q_b_proj,), Parallel.COLUMN)
            self.q_b_weight, self.q_b_bias = linear_weights(layer, linear_quant(layer, q_b))
        # transformers builds these two norms with RMSNorm's default eps, not the config's rms_norm_eps
        kv_a_norm = submodule(layer, mla.kv_a_norm)
        self.kv_a_norm = (kv_a_norm.weight, kv_a_norm.variance_epsilon)
        self.kv_b = kv_b_heads(module, dtype)
        self.scale = float(module.scaling)
        self.rope = rope

    def __call__(
        self, normed: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, layer_idx: int, ops: LayerOps
    ) -> torch.Tensor:
        num_tokens = normed.shape[0]
        projected = ops.linear(normed, self.in_weight, self.in_bias)
        if self.kv_a_weight is None:
            q, latent, k_rope = torch.split(projected, [self.q_width, self.kv_lora, self.rope_dim], dim=-1)
        else:
            q = projected
            latent_rows = ops.linear(normed, self.kv_a_weight, self.kv_a_bias)
            latent, k_rope = torch.split(latent_rows, [self.kv_lora, self.rope_dim], dim=-1)
        if self.q_a_norm is not None:  # the q LoRA: norm, then up-projection to every head's query
            q = ops.linear(_norm(ops, q, *self.q_a_norm), self.q_b_weight, self.q_b_bias)
        q_nope, q_rope = torch.split(q.view(num_tokens, self.heads, -1), [self.nope, self.rope_dim], dim=-1)
        latent = _norm(ops, latent, *self.kv_a_norm)
        q_rope, k_rope = rotate(self.module, q_rope[None], k_rope[None, :, None], self.rope(positions))
        out = attend_latent(
            q_nope, q_rope[0], latent, k_rope[0, :, 0], attn, layer_idx, self.kv_b, self.v_dim, self.scale
        )  # fmt: skip
        return out.reshape(num_tokens, self.heads * self.v_dim)


def _norm(ops: LayerOps, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows that are columns of a wider GEMM output (the kernels read contiguous rows)."""
    normed, _ = ops.add_norm(x.contiguous(), None, weight, eps)
    return normed
