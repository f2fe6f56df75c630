"""KV block manager: owns the free list and every `Sequence.block_table`.

Block 0 is reserved as a scratch block: padding rows of a CUDA-graph bucket write their K/V there,
so kernels never need a "skip" branch on the decode path. It is never handed out.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens. Caller checked `can_allocate`."""
        needed = self.blocks_needed(seq, num_tokens)
        assert needed <= len(self._free), f"{seq.request_id}: needs {needed} blocks, {len(self._free)} free"
        for _ in range(needed):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        # NOTE: safe to reuse at once even if a launched step still writes these blocks: every step runs
        # on one compute stream, so that write lands before any later step's write or read of the block.
        self._free.extend(seq.block_table)
        seq.block_table = []

    def check_integrity(self, seqs: list[Sequence]) -> None:
        """Every usable block is either free or owned by exactly one sequence. For tests and debugging."""
        owner: dict[int, str] = {}
        for seq in seqs:
            for block in seq.block_table:
                assert block != NULL_BLOCK, f"{seq.request_id} owns the scratch block"
                assert block not in owner, f"block {block} owned by {owner[block]} and {seq.request_id}"
                owner[block] = seq.request_id
        free = list(self._free)
        assert len(set(free)) == len(free), "duplicate block in the free list"
        assert NULL_BLOCK not in free, "scratch block in the free list"
        both = set(free) & owner.keys()
        assert not both, f"blocks both free and owned: {sorted(both)[:8]}"
        assert len(free) + len(owner) == self.num_usable_blocks, (
            f"{self.num_usable_blocks - len(free) - len(owner)} blocks leaked"
        )
