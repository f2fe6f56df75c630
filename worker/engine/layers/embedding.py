"""The vocabulary-parallel layers: each rank holds the vocabulary rows `vocab_shard` gives it.

- VocabParallelEmbedding: a rank looks up the ids it holds, zeros the rest, and an all-reduce fills in the others.
- ParallelLMHead: logits of each rank's rows are gathered on rank 0 (which samples) and trimmed to the real
  vocabulary; the other ranks get None.

At world size 1 both are a plain embedding / F.linear with no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import SliceSource, TensorSlice, read_view
from ..parallel.group import ParallelState, all_reduce, gather_to_first
from ..parallel.memory import vocab_shard
from .linear import check_dim, copy_into

# --- vocabulary ----------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the ranks (`vocab_shard`)."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        state: ParallelState,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.state = state
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.shard = vocab_shard(vocab_size, state.rank, state.world_size)
        weight = torch.zeros(
            self.shard.num_rows, embedding_dim, dtype=dtype or torch.get_default_dtype(), device=device
        )
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.state.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard.start
        is_here = (local_ids >= 0) & (local_ids < self.shard.num_rows)
        hidden = F.embedding(local_ids.masked_fill(~is_here, 0), self.weight)
        hidden.masked_fill_(~is_here.unsqueeze(-1), 0)
        return all_reduce(self.state, hidden)

    def weight_loader(self, param: torch.Tensor, loaded: TensorSlice, what: str = "weight") -> None:
        """This rank's vocabulary rows; padding rows stay zero."""
        check_dim(loaded, 0, self.vocab_size, what)
        num_real = self.shard.stop - self.shard.start
        param.data[num_real:].zero_()
        if num_real > 0:
            rows = slice(self.shard.start, self.shard.stop)
            with read_view(loaded, rows) as read:  # straight from the file into the parameter
                copy_into(param.data[:num_real], read, what)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        self.weight_loader(self.weight, source.get_slice(f"{prefix}.weight"), f"{prefix}.weight")


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over a vocabulary split like VocabParallelEmbedding's: [T, vocab_size] on rank 0 (the
    rank that samples), None on the others. Plain F.linear: no linear_method (no quantized heads yet)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = gather_to_first(self.state, F.linear(hidden, self.weight), dim=-1)
        return None if logits is None else logits[..., : self.vocab_size]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the input embedding's shard (tie_word_embeddings): same split, same rows."""
        assert embedding.shard == self.shard and embedding.embedding_dim == self.embedding_dim, (
            "tied shapes differ"
        )
        self.weight = embedding.weight
