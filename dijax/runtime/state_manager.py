"""State slots: one per running sequence, holding its window ring, compressor tail and Engram history."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from dijax.runtime.pool import check_pool
from dijax.runtime.sequence import Sequence


class StateManager:
    """Owns the slot pool. ``owner[s]`` is the request id holding slot ``s`` (None when free).

    A slot's contents are left over from its previous owner: a step whose chunk starts at position 0 must
    initialise the slot state instead of reading it.
    """

    def __init__(self, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int):
            raise TypeError(f"StateManager.num_slots must be an int, got {type(num_slots).__name__} {num_slots!r}")
        if num_slots < 1:
            raise ValueError(f"StateManager.num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.owner: list[str | None] = [None] * num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` a free slot and return it. Raises RuntimeError if it has one or none is free."""
        if seq.slot is not None:
            raise RuntimeError(f"StateManager.allocate: {seq.request_id!r} already holds slot {seq.slot}")
        if not self.free_slots:
            raise RuntimeError(f"StateManager.allocate: no free slot for {seq.request_id!r} "
                               f"(all {self.num_slots} in use; check can_allocate first)")
        slot = self.free_slots.popleft()
        self.owner[slot] = seq.request_id
        seq.slot = slot
        return slot

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s slot (if any) to the pool."""
        if seq.slot is None:
            return
        if self.owner[seq.slot] != seq.request_id:
            raise RuntimeError(f"StateManager.free: slot {seq.slot} of {seq.request_id!r} is owned by "
                               f"{self.owner[seq.slot]!r}")
        self.owner[seq.slot] = None
        self.free_slots.append(seq.slot)
        seq.slot = None

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert: owned + free == total, no slot has two owners, and the owner map equals the seqs' slots."""
        held = [(seq.request_id, seq.slot) for seq in seqs if seq.slot is not None]
        check_pool("slot", self.owner, self.free_slots, held)
