"""Handlers are plain async functions registered by name.

A handler returns its output on success and raises a control signal otherwise:
``RetryLater`` (worth another attempt), ``PermanentFailure`` (dead-letter now).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from jetfleet.schemas import HandlerOutput, WorkOrder
from jetfleet.settings import TargetSettings
from jetfleet.worker.result_objects import ResultObjects

if TYPE_CHECKING:
    from jetfleet.worker.browser_contexts import BrowserContexts


ReadyFn = Callable[[], Awaitable[None]]
"""``HandlerContext.ready``: takes the attempt's first permit just before its request."""


@dataclass(frozen=True)
class HandlerContext:
    """What a handler gets for one attempt. Identity state never leaves the worker."""

    order: WorkOrder
    target: TargetSettings
    attempt: int
    worker_id: str
    identity: str
    user_agent: str
    session: aiohttp.ClientSession
    objects: ResultObjects | None = None
    """Where bytes too large for a message go (``put`` returns the reference to put in
    the output); None outside a worker, where everything stays inline."""
    another_request: Callable[[str], Awaitable[None]] | None = None
    """Await with its URL before each request to the target beyond the attempt's first
    (a redirect hop): it checks the URL against the target's robots.txt (raising
    PermanentFailure ``robots-disallowed``, or RetryLater while robots.txt is unknown)
    and takes a rate permit, waiting for one if the target's limit says so. The worker
    took the first request's permit just before the handler started (or takes it at
    ``ready``). None outside a worker."""
    browser: BrowserContexts | None = None
    """The worker's browser contexts, one per identity (``browser.page``); None when the
    worker has no browser (``worker.browser.enabled`` is false)."""
    ready: ReadyFn | None = None
    """Set for a handler registered with ``permit_when_ready``: await it once, just
    before the attempt's first request leaves (after slow local setup, such as opening a
    browser page). The worker takes the first request's permit then, so the permit and
    the request's arrival at the target are milliseconds apart, however long the setup
    took. When the request may not go now it raises a signal of the worker's
    (``NotSent``), which the handler lets through unchanged. A handler so registered must
    await it before its first request: nothing else takes that permit. None for other
    handlers, and without leases (``fleet.leases = false``), where the permit is waited
    for in place before the handler starts."""


HandlerFn = Callable[[HandlerContext], Awaitable[HandlerOutput]]

_REGISTRY: dict[str, tuple[HandlerFn, str]] = {}
# Handlers that send nothing to their job's target (robots.txt does not apply to them).
_SENDS_NOTHING: set[str] = set()
# Handlers whose first request's permit is taken at ``HandlerContext.ready``.
_PERMIT_WHEN_READY: set[str] = set()


def handler(
    name: str, version: str = "1", requests_target: bool = True, permit_when_ready: bool = False
) -> Callable[[HandlerFn], HandlerFn]:
    """Register ``fn`` as the handler called ``name`` (jobs ask for it by that name).

    Args:
        name: the name jobs use, e.g. ``"http.get"``.
        version: the handler's version, part of every result's version tuple.
        requests_target: whether it sends requests to the job's target (then the
            target's robots.txt is obeyed, and its first request's rate permit taken,
            before it runs). Only a handler that never touches the target, such as
            ``noop``, says False: its jobs take no permit.
        permit_when_ready: the handler sets up for a while before its first request
            (``browser.page`` opens a page): the permit is taken when it awaits
            ``HandlerContext.ready``, not before it starts. Taken before a setup of a
            second under load, permits spaced at the target's rate reached the target
            bunched, more than the cap in one second.
    """

    def register(fn: HandlerFn) -> HandlerFn:
        _REGISTRY[name] = (fn, version)
        if requests_target:
            _SENDS_NOTHING.discard(name)
        else:
            _SENDS_NOTHING.add(name)
        if permit_when_ready and requests_target:
            _PERMIT_WHEN_READY.add(name)
        else:
            _PERMIT_WHEN_READY.discard(name)
        return fn

    return register


def get_handler(name: str) -> tuple[HandlerFn, str]:
    """The handler registered as ``name`` and its version.

    Raises:
        KeyError: if no handler has that name in this process.
    """
    return _REGISTRY[name]


def requests_target(name: str) -> bool:
    """Whether the handler ``name`` sends requests to its job's target (False for one
    not registered here: its job ends ``unknown-handler`` without a request)."""
    return name in _REGISTRY and name not in _SENDS_NOTHING


def permits_when_ready(name: str) -> bool:
    """Whether the handler ``name`` takes its first request's permit at
    ``HandlerContext.ready`` (registered with ``permit_when_ready``)."""
    return name in _PERMIT_WHEN_READY


def registered() -> tuple[str, ...]:
    """Names of the handlers registered in this process."""
    return tuple(sorted(_REGISTRY))
