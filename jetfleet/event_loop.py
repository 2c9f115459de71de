"""The event loop a long-running jetfleet process (a service, a worker, ``jetfleet dev``)
runs on.

uvloop where it is installed (a dependency on Linux and macOS): the services spend most
of their CPU on small socket writes and wake-ups, which uvloop does in C. On this 2-core
machine it took the noop full path from 4.1 to 3.2 ms of CPU per job, summed over every
process (docs/benchmarks.md). ``process.event_loop = "asyncio"`` turns it off, for
example to rule it out when chasing a bug.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from jetfleet.errors import ConfigError

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
T = TypeVar("T")


def loop_factory(choice: EventLoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop ``choice`` asks for; None: asyncio's own.

    Raises:
        ConfigError: ``uvloop`` was asked for and is not installed.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "process.event_loop is 'uvloop' but uvloop is not installed: "
                "pip install uvloop, or set process.event_loop to 'auto'"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: EventLoopChoice = "auto") -> T:
    """Run ``main`` to completion on a new loop of ``choice``, as ``asyncio.run`` does."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
