"""KV block manager: owns every block's reference count, the free list and the prefix cache, and, on
each `Sequence`, `block_table`, `block_hashes` and `num_committed_blocks`.

A sequence's `block_table` list is only ever appended to; freeing or sharing blocks gives it a new list. The
batch builder relies on this to copy only a table's new entries into the step buffers (`batch.IOSlot`).

Block 0 is reserved as a scratch block: padding rows of a CUDA-graph bucket write their K/V there,
so kernels never need a "skip" branch on the decode path. It is never handed out.

Prefix caching. A full block is named by a hash chain: the hash of its parent block's hash and its own
token ids; the chain's root is `Sequence.kv_namespace` (empty today; an adapter id would go there, or
anything else that changes a block's K/V for the same tokens), and a block where an image's pads start mixes
in that image's content hash (`Sequence.images`), so that the same pads of another picture never match; marked apart for a sequence that rotates with
longrope's long factors (`Sequence.long_rope`): the same tokens' K/V differ between the two tables. Blocks are
shared by reference count, never copied: a sequence only ever writes positions past its shared prefix, so shared
blocks are read-only.

Every usable block is in exactly one state:
    in use    ref count > 0; in one or more block tables; hashed or not
    cached    ref count 0, hashed: its K/V is kept for a later hit; in `_evictable`, least recently used first
    free      ref count 0, not hashed: in `_free`
Allocation takes free blocks first and evicts the least recently used cached block only when none is left.

NOTE: a block is registered under its hash only by `commit`, which the engine calls once the step that
wrote the block's last token has been processed. One compute stream would order a reader after the
writer even if registration came at scheduling time, but not if the writing step fails (its blocks
would be shared half written) nor if registration ran ahead of the chunk that fills the block.
"""

from __future__ import annotations

import array
import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence as Seq

from .sequence import Sequence

NULL_BLOCK = 0
LONG_ROPE_ROOT = b"\x00longrope-long"  # appended to the namespace of a sequence rotating with the long factors


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """A block's name: 128 bits of BLAKE2b over its parent's name and its token ids. A cryptographic
    hash, so two different prefixes never share K/V by a collision (Python's `hash` is 64 bits)."""
    return hashlib.blake2b(parent + array.array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        # Prefix cache accounting, in tokens, over admissions (`share_prefix`).
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash, in use or not."""
        return len(self._block_of)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def reset_cache_counters(self) -> None:
        self.num_cache_queries = self.num_cache_hits = self.num_evictions = 0

    # -- allocation -------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> bool:
        """Whether `seq` can cover `num_tokens` tokens, after sharing `prefix` (from `match_prefix`) if given.
        Cached blocks in `prefix` stop being evictable once shared, so they do not count as room."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table) - len(prefix)
        if needed <= 0:
            return True  # most decode steps
        room = len(self._free) + len(self._evictable)
        if prefix:
            room -= sum(1 for b in prefix if self.ref_counts[b] == 0)
        return needed <= room

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` tokens. Caller checked `can_allocate`."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return
        assert needed <= self.num_free_blocks, (
            f"{seq.request_id}: needs {needed} blocks, {self.num_free_blocks} free"
        )
        for _ in range(needed):
            block = self._free.popleft() if self._free else self._evict()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        name = self._hash_of[block]
        assert name is not None, f"cached block {block} has no hash"
        del self._block_of[name]
        self._hash_of[block] = None
        self.num_evictions += 1
        return block

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its blocks with a hash stay cached; the others become free."""
        # NOTE: safe to reuse at once even if a launched step still writes these blocks: every step runs
        # on one compute stream, so that write lands before any later step's write or read of the block.
        # Released tail first, so the tail is evicted before the prefix its children depend on.
        for block in reversed(seq.block_table):
            assert self.ref_counts[block] > 0, f"{seq.request_id}: block {block} freed twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        seq.block_table = []
        seq.num_committed_blocks = 0

    # -- sharing ----------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks. At least one token is left to compute, so
        the step that computes it samples the next token. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        assert not seq.block_table and not seq.num_inflight_samples, (
            f"{seq.request_id}: not a fresh admission"
        )
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(seq, max_blocks):
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def share_prefix(self, seq: Sequence, prefix: Seq[int]) -> None:
        """Start `seq`'s (empty) block table with `prefix` from `match_prefix`: one admission's lookup."""
        assert not seq.block_table, f"{seq.request_id}: sharing into a non-empty block table"
        self._share(seq, prefix)
        if self.enable_prefix_caching:
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += len(prefix) * self.block_size

    def fork(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """Share `src`'s first `num_blocks` blocks, already written, with `dst` (parallel samples)."""
        assert num_blocks <= src.num_committed_blocks, f"{src.request_id}: forking unwritten blocks"
        assert not dst.block_table, f"{dst.request_id}: forking into a non-empty block table"
        self._share(dst, src.block_table[:num_blocks])

    def _share(self, seq: Sequence, blocks: Seq[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = list(blocks)
        seq.num_committed_blocks = len(blocks)

    def commit(self, seq: Sequence, num_tokens_written: int) -> None:
        """The K/V of `seq`'s first `num_tokens_written` tokens is on the device (their step was processed):
        register its full blocks. A block whose hash is already registered (another sequence computed the
        same prefix in parallel) stays private and becomes free when released."""
        num_full = min(num_tokens_written // self.block_size, len(seq.block_table))
        if num_full <= seq.num_committed_blocks:
            return
        if self.enable_prefix_caching:
            hashes = self._hashes(seq, num_full)
            for i in range(seq.num_committed_blocks, num_full):
                h, block = hashes[i], seq.block_table[i]
                if h not in self._block_of:
                    self._block_of[h] = block
                    self._hash_of[block] = h
        seq.num_committed_blocks = num_full

    def forget_hashes(self, seq: Sequence) -> None:
        """`seq`'s K/V namespace changed (longrope's long table): its memo names blocks of the old one."""
        assert not seq.block_table, f"{seq.request_id}: renamed while holding blocks"
        seq.block_hashes = []

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of `seq`'s first `num_blocks` full blocks (extends the memo on `seq`)."""
        hashes, bs = seq.block_hashes, self.block_size
        num_known = seq.num_prompt_tokens + len(seq.output_ids)
        assert num_blocks * bs <= num_known, f"{seq.request_id}: naming a block of unknown tokens"
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.kv_namespace + (LONG_ROPE_ROOT if seq.long_rope else b"")
            if seq.images is not None:  # the images whose pads start here: the same pads, another picture
                parent += seq.images.block_salt(i, bs)
            hashes.append(block_hash(parent, seq.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    # -- checks -----------------------------------------------------------------------------------
    def check_integrity(self, seqs: list[Sequence]) -> None:
        """Reference counts match the block tables of `seqs` (every sequence holding blocks), every usable
        block is in exactly one state, and the hash maps agree. For tests and debugging."""
        holders: Counter[int] = Counter()
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} lists a block twice"
            assert NULL_BLOCK not in seq.block_table, f"{seq.request_id} owns the scratch block"
            assert seq.num_committed_blocks <= len(seq.block_table), (
                f"{seq.request_id}: committed past its table"
            )
            holders.update(seq.block_table)
        free, cached = list(self._free), list(self._evictable)
        assert len(set(free)) == len(free), "duplicate block in the free list"
        assert NULL_BLOCK not in free and NULL_BLOCK not in cached, "scratch block in the free list"
        both = (set(free) | set(cached)) & holders.keys()
        assert not both, f"blocks both free and owned: {sorted(both)[:8]}"
        assert not set(free) & set(cached), "blocks both free and cached"
        num_leaked = self.num_usable_blocks - len(free) - len(cached) - len(holders)
        assert num_leaked == 0, f"{num_leaked} blocks leaked"
        for block in range(1, self.num_blocks):
            assert self.ref_counts[block] == holders[block], (
                f"block {block}: ref count {self.ref_counts[block]}, held by {holders[block]} block tables"
            )
        assert all(self._hash_of[b] is None for b in free), "a free block keeps a hash"
        assert all(self._hash_of[b] is not None for b in cached), "a cached block has no hash"
        for h, block in self._block_of.items():
            assert self._hash_of[block] == h, f"block {block}: hash map and block disagree"
        num_hashed = sum(h is not None for h in self._hash_of)
        assert num_hashed == len(self._block_of), "a hashed block is missing from the hash map"
