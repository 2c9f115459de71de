"""A real skew of one child process's wall clock, through libfaketime.

The library is preloaded into the child (``LD_PRELOAD``), so every wall-clock read in
it (Python's ``time.time``, ``datetime.now``, the C library) is off by the offset, while
its monotonic clock is left alone, as on a machine whose clock was set wrong. It comes
from the ``libfaketime`` Python package when installed (the dev extra: it builds the
library from C at install time, so it is no runtime dependency), else from Debian's
``libfaketime`` package. Without either, no skew is applied and ``ClockSkew.via``
says so: nothing is faked in its place.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# Debian's `apt-get install libfaketime` puts it here.
DEBIAN_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
HOW_TO_GET_IT = (
    "not applied: no libfaketime here (pip install libfaketime, which compiles it, "
    "or apt-get install libfaketime)"
)


@dataclass(frozen=True)
class ClockSkew:
    """How to run a child with its wall clock ``offset`` (libfaketime's ``+1h`` form)
    away, and where the library came from (or why there is none)."""

    offset: str
    env: dict[str, str] = field(default_factory=dict)
    """Variables to add to the child's environment; empty: no skew is possible here."""
    via: str = HOW_TO_GET_IT

    @property
    def applied(self) -> bool:
        """Whether a child run with ``env`` has its clock skewed."""
        return bool(self.env)


def clock_skew(offset: str) -> ClockSkew:
    """The environment that skews a child's wall clock by ``offset``, if this machine
    has libfaketime (the Python package's build first, then Debian's)."""
    try:
        import libfaketime
    except ImportError:
        libfaketime = None
    if libfaketime is not None:
        _, preload = libfaketime.get_reload_information()
        return ClockSkew(offset, {**preload, "FAKETIME": offset}, "libfaketime (Python package)")
    if DEBIAN_LIBRARY.exists():
        env = {
            "LD_PRELOAD": str(DEBIAN_LIBRARY),
            "FAKETIME": offset,
            "DONT_FAKE_MONOTONIC": "1",
        }
        return ClockSkew(offset, env, f"libfaketime ({DEBIAN_LIBRARY})")
    return ClockSkew(offset)


def measured_offset_s(skew: ClockSkew, timeout_s: float = 10.0) -> float | None:
    """The offset a child run with ``skew.env`` really sees: its ``date +%s`` minus
    ours (None when no skew is applied or ``date`` fails)."""
    if not skew.applied:
        return None
    try:
        out = subprocess.run(
            ["date", "+%s"],
            env={**os.environ, **skew.env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out.stdout.strip()) - time.time()
