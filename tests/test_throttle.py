"""kvxfer/core/throttle.py on a fake clock: one line per key per period, the lines held
back counted, keys independent, and the keys' memory bounded."""

from __future__ import annotations

import pytest

from kvxfer.core import throttle
from kvxfer.core.throttle import LogThrottle


def test_one_line_per_key_per_period_with_the_held_back_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    logs = LogThrottle(10.0)
    assert logs.due("junk") == 0  # the first line of a key goes out
    assert logs.due("junk") is None and logs.due("junk") is None
    assert logs.due("stalled") == 0  # another key is not held back by it
    now[0] = 109.9
    assert logs.due("junk") is None
    now[0] = 110.0
    assert logs.due("junk") == 3  # three held back since its last line
    assert logs.due("junk") is None
    monkeypatch.setattr(throttle, "MAX_KEYS", 3)
    for key in ("a", "b"):
        assert logs.due(key) == 0
    assert len(logs._last) == 1  # a key past the bound (junk, stalled, a: full) starts afresh
