"""Paged KV blocks: each block holds ``block_size`` consecutive positions of exactly one sequence."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from dijax.runtime.pool import check_pool
from dijax.runtime.sequence import Sequence


class BlockManager:
    """Owns the block pool. A sequence covering ``n`` tokens holds ``ceil(n / block_size)`` blocks in its table.

    ``owner[b]`` is the request id holding block ``b`` (None when free). Blocks are handed out from the front of
    the free queue and returned to its back, so allocation order is deterministic.
    """

    def __init__(self, num_blocks: int, block_size: int = 128):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"BlockManager.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"BlockManager.{name} must be >= 1, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.owner: list[str | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: the longest sequence that can ever run."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that cover ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must still get for its table to cover ``num_tokens`` positions (0 if it already does)."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the free pool can grow ``seq`` to cover ``num_tokens`` positions."""
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def room(self, seq: Sequence, start: int) -> int:
        """Tokens ``seq`` could write from position ``start`` on without preempting anyone."""
        return len(seq.block_table) * self.block_size - start + self.num_free * self.block_size

    def allocate(self, seq: Sequence, up_to_len: int) -> None:
        """Grow ``seq.block_table`` to cover positions ``[0, up_to_len)``. Raises RuntimeError if blocks run out."""
        needed = self.blocks_needed(seq, up_to_len)
        if needed > self.num_free:
            raise RuntimeError(f"BlockManager.allocate: {seq.request_id!r} needs {needed} blocks to cover "
                               f"{up_to_len} tokens, only {self.num_free} free (check can_allocate first)")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            assert self.owner[block] is None, f"free block {block} is owned by {self.owner[block]!r}"
            self.owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq`` to the pool and empty its table."""
        for block in seq.block_table:
            if self.owner[block] != seq.request_id:
                raise RuntimeError(f"BlockManager.free: block {block} in {seq.request_id!r}'s table is owned by "
                                   f"{self.owner[block]!r}")
            self.owner[block] = None
            self.free_blocks.append(block)
        seq.block_table = []

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert: owned + free == total, no block has two owners, and the owner map equals the seqs' tables.

        ``seqs`` must be every sequence that may own blocks (the scheduler's live sequences).
        """
        held = [(seq.request_id, block) for seq in seqs for block in seq.block_table]
        check_pool("block", self.owner, self.free_blocks, held)
