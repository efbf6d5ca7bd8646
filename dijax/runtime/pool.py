"""The ownership invariant shared by the block pool and the slot pool, stated once."""

from __future__ import annotations

from collections.abc import Iterable


def check_pool(kind: str, owner: list[str | None], free: Iterable[int], held: Iterable[tuple[str, int]]) -> None:
    """Assert a pool's bookkeeping: owned + free == total, and the owner map equals what the sequences hold.

    kind   "block" or "slot", for the messages.
    owner  owner[i] is the request id owning item i, or None when it is free.
    free   the free queue.
    held   (request_id, item) for every item every live sequence holds.
    """
    total = len(owner)
    free = list(free)
    assert len(set(free)) == len(free), f"a {kind} is in the free queue twice: {sorted(free)}"
    for item in free:
        assert owner[item] is None, f"{kind} {item} is free but owned by {owner[item]!r}"
    owned = [i for i in range(total) if owner[i] is not None]
    assert len(owned) + len(free) == total, f"owned {kind}s ({len(owned)}) + free ({len(free)}) != total ({total})"
    holder: dict[int, str] = {}
    for request_id, item in held:
        assert 0 <= item < total, f"{request_id!r} holds {kind} {item}, outside the pool of {total}"
        assert item not in holder, f"{kind} {item} is held by both {holder[item]!r} and {request_id!r}"
        holder[item] = request_id
        assert owner[item] == request_id, f"{kind} {item} is held by {request_id!r} but owned by {owner[item]!r}"
    leaked = [i for i in owned if i not in holder]
    assert not leaked, f"{kind}s {leaked} are owned ({[owner[i] for i in leaked]}) but held by no live sequence"
