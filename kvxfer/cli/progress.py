"""A one-line progress bar on stderr (stdout stays clean for --json)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self._label = label
        self._total = max(total, 1)
        self._done = 0
        self._enabled = enabled
        self._tty = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last_pct = -1

    def note(self, text: str) -> None:
        if self._enabled:
            self._write(f"{self._label}: {text}", final=not self._tty)

    def advance(self, text: str = "") -> None:
        self._done += 1
        if not self._enabled:
            return
        pct = 100 * self._done // self._total
        if not self._tty and pct // 25 == self._last_pct // 25 and self._done < self._total:
            return
        self._last_pct = pct
        width = 30
        filled = width * self._done // self._total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self._start
        line = f"{self._label} [{bar}] {self._done}/{self._total} {elapsed:5.1f}s {text}"
        self._write(line, final=not self._tty)

    def done(self) -> None:
        if self._enabled and self._tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _write(self, line: str, *, final: bool) -> None:
        if final:
            sys.stderr.write(line + "\n")
        else:
            sys.stderr.write("\r\033[K" + line[:160])
        sys.stderr.flush()
