"""Terminal output: JSON, tables and a progress bar that stays quiet when not a TTY."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Sequence

import msgspec


def print_json(value: object) -> None:
    """Print ``value`` as indented JSON on stdout."""
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a plain aligned table."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def progress_wanted(as_json: bool = False, data_on_stdout: bool = False) -> bool:
    """Whether a long operation draws a bar (docs/cli.md, "Progress"): only for a person
    at a terminal. Never with ``--json`` (a program reads the output), never when stdout
    is a pipe or socket (``| head``, ``| jq``: a script is reading), and, for a command
    whose data is its stdout (``results export``), only when that goes to a file: on a
    terminal the bar would be drawn into the data."""
    if as_json or not _is_tty(sys.stderr):
        return False
    mode = _stdout_mode()
    if mode is None or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return False
    return not (data_on_stdout and _is_tty(sys.stdout))


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _stdout_mode() -> int | None:
    try:
        return os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):  # no real descriptor (a test's captured stdout)
        return None


class ProgressBar:
    """A one-line bar on stderr, redrawn at most 10 times a second; silent unless
    ``enabled`` (default: ``progress_wanted()``)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = progress_wanted() if enabled is None else enabled
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, extra: str = "") -> None:
        """Show ``done`` of ``total``."""
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        self._drawn = True
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{self.total} {extra}   "
        )
        sys.stderr.flush()

    def close(self) -> None:
        """End the line (if one was drawn)."""
        if self._drawn:
            sys.stderr.write("\n")
