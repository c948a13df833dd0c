"""Values derived from immutable objects, found again by the objects' identity.

A link plans every pull between the same two layout objects, and binds the same
region pairs; hashing those (frozen, nested) objects would cost about as much as
deriving the value again. So an entry is found by the ids of the objects it was
derived from, and holds the objects themselves: while it stands, no other object
can take their ids. Past `limit` entries the memo starts over (no limit: one
bounded by another memo, and cleared with it).
"""

from __future__ import annotations

from typing import Generic, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._entries: dict[tuple[int, ...], tuple[tuple[object, ...], V]] = {}

    def get(self, *objects: object) -> V | None:
        entry = self._entries.get(tuple(map(id, objects)))
        if entry is None or any(a is not b for a, b in zip(entry[0], objects, strict=True)):
            return None
        return entry[1]

    @property
    def full(self) -> bool:
        """The next put starts the memo over."""
        return self._limit is not None and len(self._entries) >= self._limit

    def put(self, value: V, *objects: object) -> V:
        if self.full:
            self._entries.clear()
        self._entries[tuple(map(id, objects))] = (objects, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
