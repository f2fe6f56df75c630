"""What the owned decoder asks of the part of the model it holds (`Shard`): its embedding lookup, the completion of a
row-parallel projection's output and of the LM head's logits. `TensorParallel` on a tensor-parallel rank (its
collectives: the partial sums all-reduced, the vocabulary's logits gathered on rank 0), `WholeModel` at one rank
(none). The decoder calls these and names no collective.

A shard that runs transformers' own forward instead of the owned decoder (multi-head latent attention: DeepSeek-V2/V3)
takes the same collectives as modules in its layers' places (models/shard_model.py puts them there): `ReducedOutput`
around each module whose output is a rank's partial sum (o_proj, a dense MLP's down_proj, a sparse MLP's experts plus
shared experts), `GatheredLogits` as the LM head, and `TensorParallel.embedding` as the input embedding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import ParallelState, all_reduce, gather_to_first, sum_in_rank_order
from .embedding import VocabParallelEmbedding


class Shard(Protocol):
    """The model part one decoder runs (the whole model at one rank)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def row_parallel_out(self, x: torch.Tensor) -> torch.Tensor: ...

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class WholeModel:
    """One rank holds everything: the embedding is a plain lookup, a projection's output and the logits are whole."""

    embed_weight: torch.Tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def row_parallel_out(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@dataclass(frozen=True)
class TensorParallel:
    """The owned decoder's collectives on a sharded model (decoder.py calls these; None there at TP=1)."""

    state: ParallelState
    embedding: VocabParallelEmbedding  # the rank's vocabulary rows; the decoder's embed_weight is its weight
    vocab_size: int
    # --deterministic: partial sums added in rank order (group.sum_in_rank_order), so that a row's bits do not
    # follow the step's size through the all-reduce's algorithm. The embedding's all-reduce needs nothing: each
    # token's row is one rank's, the others add zeros.
    fixed_order: bool = False

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return sum_in_rank_order(self.state, x) if self.fixed_order else all_reduce(self.state, x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of `input_ids` [T] -> [T, hidden], every rank's rows filled in by an all-reduce."""
        return self.embedding(input_ids)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's partial output summed over the ranks (the attention's o, the MLP's down)."""
        return self._sum(x)

    def mean_square(self, xf: torch.Tensor) -> torch.Tensor:
        """[T, W] fp32, this rank's slice of a projection -> [T, 1]: the mean of squares over the whole projection
        (OLMo 2's q/k norms), one all-reduce of [T]. Every rank holds a slice of the same width W; where KV heads
        are replicated (fewer than ranks) each head is held by N / KVH ranks, so the sum over ranks counts it that
        many times and N * W is that many whole projections: the quotient is the mean either way."""
        sums = self._sum(xf.pow(2).sum(-1, keepdim=True))
        return sums / (xf.shape[-1] * self.state.world_size)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns [R, V/N] -> the full logits [R, V] on rank 0, which samples; the other
        ranks get their own part back (never sampled from)."""
        full = gather_to_first(self.state, logits, dim=-1)
        return logits if full is None else full[..., : self.vocab_size]

    def row_parallel_out(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output (the attention's o, the MLP's down or its experts split by intermediate
        size): this rank's partial sum -> the sum over the ranks (the bias on rank 0 only)."""
        return self.reduce(x)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns -> the full logits on rank 0, contiguous (the other ranks: their part)."""
        return self.gather_logits(logits).contiguous()


class ReducedOutput(nn.Module):
    """`inner`, whose output is this rank's partial sum of a row-parallel result (its columns of o_proj or down_proj,
    its slice of every expert's intermediate size plus the shared experts'), summed over the ranks: the module form of
    `TensorParallel.row_parallel_out`, for a shard that runs transformers' forward."""

    def __init__(self, inner: nn.Module, tp: TensorParallel):
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.tp.row_parallel_out(self.inner(*args, **kwargs))


class GatheredLogits(nn.Module):
    """The LM head of a shard that runs transformers' forward: this rank's vocabulary rows [V/N, hidden] times the
    hidden states, gathered into the full logits on rank 0 (`TensorParallel.full_logits`); a helper gets its own
    part back (never sampled from), so transformers' output always carries a tensor."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.full_logits(F.linear(hidden, self.weight))
