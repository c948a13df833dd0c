"""IdentityMemo: found by the objects' identity, never by equality, and bounded."""

from __future__ import annotations

from kvxfer.core.identity import IdentityMemo


def test_an_entry_is_found_only_for_the_very_objects_it_was_put_for() -> None:
    memo: IdentityMemo[str] = IdentityMemo(8)
    a, b = (1, 2), (3, 4)
    assert memo.put("ab", a, b) == "ab"
    assert memo.get(a, b) == "ab"
    assert memo.get(b, a) is None  # the order is part of the key
    twin = tuple([1, 2])
    assert twin == a and twin is not a
    assert memo.get(twin, b) is None  # equal is not enough


def test_a_full_memo_starts_over_and_an_unbounded_one_never_does() -> None:
    memo: IdentityMemo[int] = IdentityMemo(2)
    keys = [object() for _ in range(3)]
    memo.put(0, keys[0])
    memo.put(1, keys[1])
    assert memo.full and len(memo) == 2
    memo.put(2, keys[2])
    assert len(memo) == 1 and memo.get(keys[0]) is None and memo.get(keys[2]) == 2
    unbounded: IdentityMemo[int] = IdentityMemo(None)
    for i, key in enumerate(keys):
        unbounded.put(i, key)
    assert not unbounded.full and len(unbounded) == 3
    unbounded.clear()
    assert len(unbounded) == 0 and unbounded.get(keys[0]) is None
