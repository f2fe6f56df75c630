"""Batch builder and IO slots. Owns the two IO slots (host buffers, pinned on CUDA, and their device
twins) and writes each step's flattened ragged batch into one of them, from its `StepDescription`.

The model runner alternates slots: while the device runs step N from slot A, the host writes step N+1
into slot B. Every array sits at a fixed offset of one int32 and one float32 buffer, so a step is
three host-to-device copies and CUDA graphs can read fixed device addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch

from .block_manager import NULL_BLOCK
from .step import StepDescription

# (name, length in units of: "tokens" = max_num_tokens, "seqs" = max_num_seqs, "seqs+1")
_INT_FIELDS = (
    ("input_ids", "tokens"),
    ("positions", "tokens"),
    ("slot_mapping", "tokens"),
    ("carry_src", "tokens"),  # -1, or the previous step's output row that fills this input token
    ("cu_seqlens_q", "seqs+1"),
    ("context_lens", "seqs"),
    ("logits_indices", "seqs"),
    ("top_k", "seqs"),
    ("seeds", "seqs"),
    ("sample_positions", "seqs"),  # position of the token being sampled: the random stream's counter
)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


@dataclass
class BatchMeta:
    """Host-side facts about a built step: shapes and flags the runner needs without reading the device."""

    slot: int
    num_tokens: int  # T, padded to the graph bucket for decode-only steps
    num_seqs: int  # B, padded likewise
    num_real_seqs: int
    num_sample_rows: int  # R: rows of logits / sampled ids (padded rows are ignored)
    max_query_len: int
    max_context_len: int
    is_decode_only: bool
    any_random: bool
    any_top_k_top_p: bool
    has_carry: bool
    # Leading sequences with one query row each (in a mixed step, the decodes the scheduler puts first):
    # attention runs them through the split-K decode kernel and only the rest through the varlen kernel.
    num_decode_seqs: int = 0
    any_min_p: bool = False  # a random row has min_p > 0
    # (q_len, context_len) of each sequence after the leading single-row ones (none in a decode-only step): what
    # sizes a step's work on the host without reading the device (latent attention's expanded prefill).
    prefill_lens: tuple[tuple[int, int], ...] = ()


class IOSlot:
    """One set of step buffers. `host_*` are numpy views of pinned CPU tensors; `dev` holds device views."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        pin = device.type == "cuda"
        sizes = {"tokens": max_num_tokens, "seqs": max_num_seqs, "seqs+1": max_num_seqs + 1}
        int_len = sum(sizes[kind] for _, kind in _INT_FIELDS)
        self.int_host = torch.zeros(int_len, dtype=torch.int32, pin_memory=pin)
        self.float_host = torch.zeros(len(_FLOAT_FIELDS) * max_num_seqs, dtype=torch.float32, pin_memory=pin)
        self.tables_host = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.sampled_host = torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=pin)
        self.int_dev = torch.zeros(int_len, dtype=torch.int32, device=device)
        self.float_dev = torch.zeros(len(_FLOAT_FIELDS) * max_num_seqs, dtype=torch.float32, device=device)
        self.tables_dev = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.sampled_dev = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        offset = 0
        int_np = self.int_host.numpy()
        for name, kind in _INT_FIELDS:
            n = sizes[kind]
            self.host[name] = int_np[offset : offset + n]
            self.dev[name] = self.int_dev[offset : offset + n]
            offset += n
        float_np = self.float_host.numpy()
        for i, name in enumerate(_FLOAT_FIELDS):
            self.host[name] = float_np[i * max_num_seqs : (i + 1) * max_num_seqs]
            self.dev[name] = self.float_dev[i * max_num_seqs : (i + 1) * max_num_seqs]
        self.host["block_tables"] = self.tables_host.numpy()
        self.dev["block_tables"] = self.tables_dev
        # What each row of the host block table holds: the block-table list it was copied from, and how many of
        # its entries. A list object only ever grows by appends while its sequence runs (the block manager
        # replaces it when it frees or shares blocks), so a sequence whose list is the same object as last time
        # needs only its new entries, moved with its row when sequences before it finished.
        self._row_tables: list[list[int]] = []
        self._row_lens = np.zeros(max_num_seqs, dtype=np.int64)

    def write_block_tables(self, tables: list[list[int]], num_rows: int) -> None:
        """Rows [0, len(tables)) get these block tables; rows up to `num_rows` (graph padding) the scratch block.

        Copying every running sequence's whole table each step cost about 1 ms per 1,000 sequences of ~70
        blocks on a 2-core development box (list-to-array conversion), where a decode step adds a block to ~1
        sequence in 16. Here the bookkeeping runs in C (map, dict, numpy): rows of sequences seen last time are
        moved as one array copy, and Python runs per row only for new sequences and grown tables."""
        host = self.host["block_tables"]
        k = len(tables)
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=k)
        # row each list held last time, by identity (the lists are kept alive, so no id is reused meanwhile)
        row_of = {table_id: row for row, table_id in enumerate(map(id, self._row_tables))}
        src = np.fromiter(map(row_of.get, map(id, tables), repeat(-1)), dtype=np.int64, count=k)
        kept = np.flatnonzero(src >= 0)
        held = np.zeros(k, dtype=np.int64)  # entries row b already holds
        held[kept] = self._row_lens[src[kept]]
        try:
            moved = kept[src[kept] != kept]
            if len(moved):
                width = int(held[moved].max())
                host[moved, :width] = host[src[moved], :width]  # the right side is a copy: overlap is safe
            for b in np.flatnonzero(lens > held).tolist():
                host[b, held[b] : lens[b]] = tables[b][held[b] :]
        except BaseException:
            self._row_tables = []  # a row may be half-written: forget them all
            raise
        self._row_tables = list(tables)
        self._row_lens[:k] = lens
        host[k:num_rows, 0] = NULL_BLOCK


class BatchBuilder:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        graph_buckets: tuple[int, ...] = (),
        max_model_len: int = 0,
        long_rope_row_offset: int = 0,
    ):
        """`graph_buckets`: decode-only steps pad up to one of these row counts (on CUDA, with or without
        graphs). `max_model_len`: the context bound such a padded step tells its kernels, as its graph was
        captured with (0: the step's own longest context). `long_rope_row_offset`: a longrope model's original
        context, where its long rows start in the decoder's rotary tables (decoder.py `longrope_tables`)."""
        self.block_size = block_size
        self.long_rope_row_offset = long_rope_row_offset
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.slots = [IOSlot(max_num_tokens, max_num_seqs, max_blocks_per_seq, device) for _ in range(2)]
        self.graph_buckets = tuple(sorted(graph_buckets))

    def bucket_for(self, num_seqs: int) -> int | None:
        for bucket in self.graph_buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def build(self, step: StepDescription, slot_index: int) -> BatchMeta:
        """Write `step` into slot `slot_index`."""
        slot = self.slots[slot_index]
        h = slot.host
        num_real = step.num_seqs
        bucket = self.bucket_for(num_real) if step.is_decode_only else None
        num_seqs = bucket or num_real

        q_lens, starts, samples = step.q_lens, step.starts, step.samples
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1 : num_real + 1])
        cu[num_real + 1 :] = cu[num_real] + np.arange(1, num_seqs - num_real + 1)  # padding: one row each
        num_real_tokens = int(cu[num_real])
        num_tokens = int(cu[num_seqs])
        assert len(step.input_ids) == num_real_tokens, "one input id per computed token"

        # 1. Token ids; a token still being sampled has a placeholder and a carry-over source row.
        carry = h["carry_src"][:num_tokens]
        carry.fill(-1)
        carry[cu[step.carry_seqs]] = step.carry_rows
        h["input_ids"][:num_real_tokens] = step.input_ids
        h["input_ids"][num_real_tokens:num_tokens] = 0

        # 2. Positions, block tables, slot mapping: vectorised over tokens.
        seq_of_token = np.repeat(np.arange(num_real), q_lens)
        positions = (np.arange(num_real_tokens) - np.repeat(cu[:num_real], q_lens)) + np.repeat(
            starts, q_lens
        )
        # The forward reads `positions` only as rotary table rows: a longrope sequence in its long regime reads the
        # long rows (the slot mapping below keeps the true positions).
        h["positions"][:num_real_tokens] = positions
        if step.long_rope is not None:  # a longrope model
            is_long = np.repeat(step.long_rope, q_lens)
            assert positions[~is_long].max(initial=-1) < self.long_rope_row_offset, (
                "a token rotating with the short table lies past longrope's original context"
            )
            h["positions"][:num_real_tokens] += is_long * self.long_rope_row_offset
        if step.images is not None:  # a vision model (multimodal.py): M-RoPE's rows, alike outside image tokens
            h["positions"][:num_real_tokens] = step.images.positions[0]
        h["positions"][num_real_tokens:num_tokens] = 0
        slot.write_block_tables(step.block_tables, num_seqs)
        tables = h["block_tables"]
        bs = self.block_size
        h["slot_mapping"][:num_real_tokens] = tables[seq_of_token, positions // bs] * bs + positions % bs
        h["slot_mapping"][num_real_tokens:num_tokens] = NULL_BLOCK * bs  # padding writes the scratch block
        h["cu_seqlens_q"][: num_seqs + 1] = cu
        context_lens = starts + q_lens
        h["context_lens"][:num_real] = context_lens
        h["context_lens"][num_real:num_seqs] = 0

        # 3. Sampling rows: one per sampling sequence, in order; padded decode rows sample garbage, ignored.
        num_samples = step.num_sample_rows
        num_rows = num_seqs if bucket else num_samples
        h["logits_indices"][:num_samples] = cu[1 : num_real + 1][samples] - 1
        h["logits_indices"][num_samples:num_rows] = cu[num_real + 1 : num_seqs + 1] - 1
        temps = h["temperature"][:num_rows]
        temps[:num_samples] = step.temperature
        temps[num_samples:] = 0.0
        top_p, top_k, min_p = h["top_p"][:num_samples], h["top_k"][:num_samples], h["min_p"][:num_samples]
        top_p[:] = step.top_p
        top_k[:] = step.top_k
        min_p[:] = step.min_p
        h["seeds"][:num_samples] = step.seeds
        h["sample_positions"][:num_samples] = context_lens[samples]  # the sampled token's position
        random = temps[:num_samples] > 0
        num_decode = _num_leading_single_rows(q_lens)
        return BatchMeta(
            slot=slot_index,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_real_seqs=num_real,
            num_sample_rows=num_rows,
            max_query_len=int(q_lens.max()) if num_real else 0,
            # A padded decode step says what its graph was captured with: the decode kernel's split count
            # depends on this bound and the row count, and a step must round alike replayed or eager.
            max_context_len=self.max_model_len if bucket and self.max_model_len else (
                int(context_lens.max()) if num_real else 0
            ),
            is_decode_only=step.is_decode_only,
            any_random=bool(random.any()),
            any_top_k_top_p=bool((random & ((top_k > 0) | (top_p < 1.0))).any()),
            has_carry=bool(step.carry_seqs),
            num_decode_seqs=num_decode,
            any_min_p=bool((random & (min_p > 0)).any()),
            prefill_lens=() if step.is_decode_only else tuple(
                zip(q_lens[num_decode:].tolist(), context_lens[num_decode:].tolist(), strict=True)
            ),
        )  # fmt: skip


def _num_leading_single_rows(q_lens: np.ndarray) -> int:
    multi = np.flatnonzero(q_lens != 1)
    return int(multi[0]) if len(multi) else len(q_lens)
