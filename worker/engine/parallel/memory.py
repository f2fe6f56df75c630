"""Weight bytes per rank of a decoder at tensor-parallel size N, to refuse a load that cannot fit, and
the KV-cache bytes a token takes on one rank.

Owns nothing. Counts what layers/ holds on one rank: its shard of every split tensor (q/k/v by
head, o, gate/up, down, experts and shared experts by intermediate size, the padded vocabulary of the embedding
and an untied lm_head; multi-head latent attention's q, kv_b and o by head) and a full copy of every replicated one
(norms, row-parallel biases, the MoE router, KV heads when there are fewer KV heads than ranks, and the latent's
projections).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..moe.spec import SUPPORTED_MODEL_TYPES as MOE_MODEL_TYPES
from ..moe.spec import moe_layer_ids, spec_from_config

GB = 1e9


@dataclass(frozen=True)
class LatentShape:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3): the heads' query (q_proj, or q_a_proj, its norm and
    q_b_proj where `q_lora_rank` is set), kv_b_proj and o_proj split by head; the latent's kv_a_proj_with_mqa and
    kv_a_layernorm (and q_a_proj with its norm) replicated, as models/shard_build.py loads them."""

    q_lora_rank: int  # 0: a full q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def sharded_per_head(self, hidden_size: int) -> int:
        """One head's parameters of the split linears: its query rows, its kv_b_proj rows, its o_proj columns."""
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        query = qk_head_dim * (self.q_lora_rank or hidden_size)
        kv_b = (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
        return query + kv_b + self.v_head_dim * hidden_size

    def replicated_linears(self, hidden_size: int) -> int:
        """q_a_proj and kv_a_proj_with_mqa (the latent and the shared rotary key)."""
        return hidden_size * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def norms(self) -> int:
        return self.kv_lora_rank + self.q_lora_rank


@dataclass(frozen=True)
class DecoderShape:
    """The sizes that decide a decoder's weight bytes (read from a transformers config)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 (the family file says; transformers' Qwen2 config has no flag)
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm weights
    num_experts: int = 0  # > 0: the sparse layers' MLP is that many experts plus a router
    expert_intermediate_size: int = 0
    num_dense_layers: int = 0  # of a mixture of experts: layers with a dense MLP (DeepSeek's, GLM-4.5's first k)
    shared_expert_intermediate_size: int = 0  # of the sparse layers' shared experts, split like a dense MLP
    latent: LatentShape | None = None  # multi-head latent attention in place of q/k/v heads

    @classmethod
    def from_config(cls, config, *, qkv_bias: bool = False, qk_norm: bool = False) -> DecoderShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # the experts as the MoE layer reads them (Mixtral and gpt-oss name them num_local_experts x intermediate_size)
        moe = spec_from_config(config) if getattr(config, "model_type", None) in MOE_MODEL_TYPES else None
        latent = None
        if getattr(config, "kv_lora_rank", None):
            latent = LatentShape(
                config.q_lora_rank or 0, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                config.v_head_dim,
            )  # fmt: skip
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(getattr(config, "attention_bias", False)),
            qk_norm=qk_norm,
            num_experts=0 if moe is None else moe.num_experts,
            expert_intermediate_size=0 if moe is None else moe.expert_intermediate_size,
            num_dense_layers=0 if moe is None else config.num_hidden_layers - len(moe_layer_ids(config)),
            shared_expert_intermediate_size=0 if moe is None else moe.shared_expert_intermediate_size,
            latent=latent,
        )


@dataclass(frozen=True)
class RankWeightBytes:
    """One rank's weight bytes: its shards of split tensors, and its copies of replicated ones."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def weight_bytes_per_rank(
    shape: DecoderShape, world_size: int, bytes_per_param: float, linear_bytes_per_param: float | None = None,
    expert_bytes_per_param: float | None = None,
) -> RankWeightBytes:  # fmt: skip
    """The bytes rank 0 holds (every rank holds as much: the splits are even up to vocab padding).
    `linear_bytes_per_param`: the dense decoder linears' (q/k/v, o, gate/up, down) where they differ (1 for FP8
    weights; their scales are left out, a few bytes a row or a block); `expert_bytes_per_param` the routed experts'
    (1 where they are kept FP8). Raises ValueError when the shape cannot be split over `world_size` ranks."""
    s, n = shape, world_size
    heads = head_shard(s.num_heads, s.num_kv_heads, 0, n)

    def part(size: int, what: str) -> int:
        rows = shard_for(size, 0, n, what)
        return rows.stop - rows.start

    kv_rows = 2 * heads.num_kv_heads * s.head_dim
    kv_split = s.num_kv_heads >= n
    q_rows = heads.num_q_heads * s.head_dim
    sharded = replicated = 0
    if s.latent is not None:  # the rank's heads of q, kv_b and o; the latent's projections whole
        linear_sharded = heads.num_q_heads * s.latent.sharded_per_head(s.hidden_size)
        linear_replicated = s.latent.replicated_linears(s.hidden_size)
        replicated += s.latent.norms
    else:
        linear_sharded = (q_rows + (kv_rows if kv_split else 0)) * s.hidden_size  # q (and k, v when split)
        linear_replicated = 0 if kv_split else kv_rows * s.hidden_size  # k, v copies when KV heads are replicated
        linear_sharded += s.hidden_size * part(s.num_heads * s.head_dim, "num_attention_heads x head_dim")  # o
    if s.qkv_bias:
        sharded += q_rows + (kv_rows if kv_split else 0)
        replicated += 0 if kv_split else kv_rows
    # per layer; `dense_mlp` once per dense layer (every layer without experts)
    num_sparse = s.num_layers - s.num_dense_layers if s.num_experts else 0
    expert_params = 0  # the routed experts' (the rank's columns of each), at `expert_bytes_per_param`
    num_dense = s.num_layers - num_sparse
    dense_mlp = 3 * s.hidden_size * part(s.intermediate_size, "intermediate_size") if num_dense else 0  # gate/up/down
    replicated += 2 * s.hidden_size + (2 * s.head_dim if s.qk_norm else 0)  # the two norms (+ q/k norms)
    sharded *= s.num_layers
    replicated *= s.num_layers
    if num_sparse:
        expert_columns = part(s.expert_intermediate_size, "the experts' intermediate size")
        shared_columns = part(s.shared_expert_intermediate_size, "the shared experts' intermediate size")
        expert_params = num_sparse * (s.num_experts * 3 * s.hidden_size * expert_columns)
        replicated += num_sparse * s.num_experts * s.hidden_size  # the router
        # shared experts: in the model dtype under FP8 as the experts (the sparse MLP stays dense)
        sharded += num_sparse * 3 * s.hidden_size * shared_columns
    linear_sharded_total = num_dense * dense_mlp + s.num_layers * linear_sharded
    vocab_rows = vocab_shard(s.vocab_size, 0, n).num_rows
    sharded += vocab_rows * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    replicated += s.hidden_size  # the final norm
    linear_bytes = bytes_per_param if linear_bytes_per_param is None else linear_bytes_per_param
    expert_bytes = bytes_per_param if expert_bytes_per_param is None else expert_bytes_per_param
    return RankWeightBytes(
        round(sharded * bytes_per_param + linear_sharded_total * linear_bytes + expert_params * expert_bytes),
        round(replicated * bytes_per_param + linear_replicated * s.num_layers * linear_bytes),
    )


def kv_bytes_per_token_per_rank(shape: DecoderShape, world_size: int, bytes_per_value: float) -> int:
    """KV-cache bytes one token takes on one rank: k and v of the rank's KV heads in every layer
    (a replicated KV head is cached on every rank that holds it); multi-head latent attention's whole latent on every
    rank (kv_lora_rank + qk_rope_head_dim values a layer, whatever the world size)."""
    if shape.latent is not None:
        return round(shape.num_layers * (shape.latent.kv_lora_rank + shape.latent.qk_rope_head_dim) * bytes_per_value)
    heads = head_shard(shape.num_heads, shape.num_kv_heads, 0, world_size)
    return round(2 * shape.num_layers * heads.num_kv_heads * shape.head_dim * bytes_per_value)


def check_fits(
    shape: DecoderShape,
    world_size: int,
    bytes_per_param: float,
    free_bytes_per_rank: list[int],
    model_name: str,
    linear_bytes_per_param: float | None = None,
    expert_bytes_per_param: float | None = None,
) -> RankWeightBytes:
    """The per-rank weight bytes, or ValueError naming the numbers when some rank lacks the room."""
    need = weight_bytes_per_rank(shape, world_size, bytes_per_param, linear_bytes_per_param, expert_bytes_per_param)
    short = [(rank, free) for rank, free in enumerate(free_bytes_per_rank) if free < need.total]
    if short:
        rank, free = short[0]
        gpus = "1 GPU" if world_size == 1 else f"{world_size} GPUs"
        raise ValueError(
            f"{model_name} does not fit {gpus}: {need.total / GB:.1f} GB of weights per rank "
            f"({need.sharded / GB:.1f} GB sharded + {need.replicated / GB:.1f} GB replicated), "
            f"but rank {rank} has {free / GB:.1f} GB free; split it over more GPUs"
        )
    return need


# --- the split, for any rank ------------------------------------------------------------------------


def shard_for(size: int, rank: int, world_size: int, what: str = "size") -> slice:
    """Rank `rank`'s contiguous part of `size` items split evenly over `world_size` ranks."""
    if size % world_size:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {world_size}")
    n = size // world_size
    return slice(rank * n, (rank + 1) * n)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: its q heads and the KV heads they read."""

    q_heads: slice
    kv_heads: slice

    @property
    def num_q_heads(self) -> int:
        return self.q_heads.stop - self.q_heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """q heads split evenly; KV heads split too, or, when there are fewer KV heads than ranks,
    replicated: each rank then holds the one KV head its q heads use (grouped-query attention)."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    q_heads = shard_for(num_heads, rank, world_size, "num_attention_heads")
    if num_kv_heads >= world_size:
        kv_heads = shard_for(num_kv_heads, rank, world_size, "num_key_value_heads")
    else:
        if world_size % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {world_size} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        kv_head = rank * num_kv_heads // world_size
        kv_heads = slice(kv_head, kv_head + 1)
    group_size = num_heads // num_kv_heads
    assert (
        q_heads.start // group_size == kv_heads.start
        and (q_heads.stop - 1) // group_size == kv_heads.stop - 1
    ), f"rank {rank}'s q heads {q_heads} do not read exactly KV heads {kv_heads}"
    return HeadShard(q_heads, kv_heads)


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows one rank holds: [start, stop) of the real vocabulary, stored in
    `num_rows` rows (the padded vocabulary over the world size; rows past `stop` are zeros)."""

    start: int
    stop: int
    num_rows: int


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> VocabShard:
    num_rows = -(-vocab_size // world_size)
    start = rank * num_rows
    return VocabShard(start, max(start, min(start + num_rows, vocab_size)), num_rows)
