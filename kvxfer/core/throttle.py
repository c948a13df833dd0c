"""At most one log line per key in a period: input from outside (junk frames, an engine's
addresses, a silent peer) must not turn into a flood of lines, nor one kind hide another."""

from __future__ import annotations

import time
from collections.abc import Hashable

MAX_KEYS = 4096  # keys can come from outside: the memory they take is bounded


class LogThrottle:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def due(self, key: Hashable) -> int | None:
        """None while `key` logged within the period (counted as held back); else how many
        lines of it were held back since its last one, which it may log now."""
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) >= MAX_KEYS and key not in self._last:
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)
