"""The ``jetfleet`` command's exit codes, and the one place that maps exceptions to them.

docs/cli.md has the table; tests/test_cli_pipes.py holds the command to it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from jetfleet.errors import JetfleetError

OK = 0
"""The command did what was asked."""
FAILED = 1
"""It ran, but something was refused, failed or is incomplete: a job refused at submit, a
check that found problems, a result written without its body, a replay that published
nothing (each command's help says which)."""
ERROR = 2
"""It could not run: bad arguments (argparse's own code), invalid configuration, an
unknown target, NATS unreachable: ``jetfleet: error: ...`` on stderr."""
INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as a shell reports a process SIGINT ended."""
OUTPUT_CLOSED = 141
"""Standard output was closed before the command finished writing (``| head``): it stops
quietly, as ``yes | head`` does (128 + SIGPIPE, what a shell shows for a process SIGPIPE
ended). Python ignores SIGPIPE, so the write raises instead; catching it lets the
command close its connections rather than die mid-write."""


def run_guarded(body: Callable[[], int]) -> int:
    """Run ``body`` (a whole command) and return its exit code, mapping what it raises.

    Output still buffered is flushed inside the guard, so a reader that went away is
    noticed here and not by the interpreter at exit (which would print "Exception
    ignored ... BrokenPipeError").
    """
    try:
        try:
            code = body()
        except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
            code = exc.code if isinstance(exc.code, int) else ERROR
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return OUTPUT_CLOSED
    except JetfleetError as exc:
        _say(f"jetfleet: error: {exc}")
        return ERROR
    except KeyboardInterrupt:
        return INTERRUPTED


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what is still
    buffered for the closed pipe fails silently (Python docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass


def _say(line: str) -> None:
    with contextlib.suppress(BrokenPipeError):  # stderr closed too (`2>&1 | head`)
        print(line, file=sys.stderr)
