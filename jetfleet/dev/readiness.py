"""Waiting until every child of a dev stack answers, before the stack says it is up.

Each child answers on a loopback HTTP endpoint it serves only once it has started (its
subscriptions made, its consumers declared): the gateway's ``/healthz``, everyone
else's ``/metrics`` (``--metrics-port``). Asking needs no message on the fleet's
subjects, so readiness leaves no trace in counts or logs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import aiohttp

from jetfleet.errors import StackError

READY_TIMEOUT_S = 60.0
"""How long a dev stack's children get to answer (a cold start on a busy laptop)."""
_POLL_S = 0.1
_ASK_TIMEOUT_S = 2.0


async def wait_answering(
    endpoints: Mapping[str, str],
    dead_children: Callable[[], str],
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Return once every endpoint answers 200.

    Args:
        endpoints: child name to the URL it answers on once started.
        dead_children: what died so far, with the end of its log ("" when none).
        timeout_s: how long to wait in all.

    Raises:
        StackError: a child exited first, or some did not answer within ``timeout_s``.
    """
    waiting = dict(endpoints)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    timeout = aiohttp.ClientTimeout(total=_ASK_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while waiting:
            dead = dead_children()
            if dead:
                raise StackError(f"jetfleet dev: a child exited while starting:\n{dead}")
            answers = await asyncio.gather(*(_answers(http, url) for url in waiting.values()))
            waiting = {n: u for (n, u), ok in zip(waiting.items(), answers, strict=True) if not ok}
            if not waiting:
                return
            if loop.time() > deadline:
                raise StackError(
                    f"jetfleet dev: {', '.join(sorted(waiting))} did not answer within "
                    f"{timeout_s:g} s; see their logs in the data folder's logs/"
                )
            await asyncio.sleep(_POLL_S)


async def _answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
