"""What kvxfer-cli shows people: tables (stdout) and a progress bar (stderr), by rich.

On a terminal, tables have rules and the progress bar redraws in place. Where
the stream is not a terminal (a pipe, a file, CI) the output stays plain,
parseable text: tables are columns separated by two spaces with one header
line, and progress is a line per note and per quarter done. `--json` output
never goes through here.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

PLAIN_WIDTH = 240  # wide enough that no plain table wraps


@dataclass(frozen=True)
class Column:
    header: str
    justify: Literal["left", "right"] = "left"


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> str:
    """`rows` under `columns`, for a terminal when stdout is one, else plain text."""
    tty = sys.stdout.isatty()
    grid = Table(
        box=box.SIMPLE_HEAD if tty else None,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1) if tty else (0, 2, 0, 0),
        header_style="bold" if tty else "",
    )
    for column in columns:
        grid.add_column(column.header, justify=column.justify, no_wrap=not tty)
    for row in rows:
        grid.add_row(*row)
    out = io.StringIO()
    console = Console(
        file=out,
        width=None if tty else PLAIN_WIDTH,
        force_terminal=tty,
        color_system="auto" if tty else None,
        highlight=False,
    )
    console.print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


class Progress:
    """Progress of `total` steps named `label`, on stderr (stdout stays clean for
    --json); use as a context manager so a terminal's bar is closed on any exit."""

    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self._label = label
        self._total = max(total, 1)
        self._done = 0
        self._enabled = enabled
        self._last_quarter = 0
        self._bar: RichProgress | None = None
        if enabled and sys.stderr.isatty():
            self._bar = RichProgress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[text]}"),
                console=Console(stderr=True),
            )
            self._task = self._bar.add_task(label, total=self._total, text="")
            self._bar.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.done()

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"{self._label}: {text}", highlight=False)
        elif self._enabled:
            _line(f"{self._label}: {text}")

    def advance(self, text: str = "") -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, text=text)
            return
        quarter = 4 * self._done // self._total
        if not self._enabled or (quarter == self._last_quarter and self._done < self._total):
            return
        self._last_quarter = quarter
        _line(f"{self._label}: {self._done}/{self._total} done {text}".rstrip())

    def done(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
