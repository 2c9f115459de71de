"""TargetSimulator: a local aiohttp website standing in for a crawl target."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from aiohttp import web

from jetfleet.simulator.config import SimulatorConfig
from jetfleet.simulator.counters import Arrival, Pending, RequestCounters, Visit
from jetfleet.simulator.routes import TargetRoutes

# How long stop() waits for cancelled handlers to unwind before tearing down anyway.
_STOP_GRACE_S = 1.0


class TargetSimulator:
    """A simulated target website for tests, the demo and benchmarks.

    Use it as ``async with TargetSimulator(cfg) as sim:`` (started on a free port of
    127.0.0.1) or call ``start`` and ``stop`` yourself.

    Args:
        config: Knobs; defaults to ``SimulatorConfig()``.
    """

    def __init__(self, config: SimulatorConfig | None = None) -> None:
        self._counters = RequestCounters()
        self._routes = TargetRoutes(config or SimulatorConfig(), self._counters)
        self._runner: web.AppRunner | None = None
        self._base_url: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts serving.

        Args:
            host: Address to bind.
            port: Port to bind; 0 picks a free one.

        Returns:
            The base URL, e.g. ``http://127.0.0.1:54321``.

        Raises:
            RuntimeError: If already started.
        """
        if self._runner is not None:
            raise RuntimeError("simulator already started")
        # handler_cancellation lets a client giving up on /hang end its handler too.
        runner = web.AppRunner(
            self._routes.build_app(),
            handler_cancellation=True,
            shutdown_timeout=_STOP_GRACE_S,
            access_log=None,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        bound_host, bound_port = runner.addresses[0][:2]
        shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        self._runner = runner
        self._base_url = f"http://{shown_host}:{bound_port}"
        return self._base_url

    async def stop(self) -> None:
        """Stops serving; requests still in flight are dropped unanswered.

        Safe to call when not started or already stopped.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._base_url = None
        pending = self._routes.cancel_inflight()
        if pending:
            await asyncio.wait(pending, timeout=_STOP_GRACE_S)
        await runner.cleanup()

    @property
    def base_url(self) -> str:
        """The base URL served, e.g. ``http://127.0.0.1:54321``.

        Raises:
            RuntimeError: If not started.
        """
        if self._base_url is None:
            raise RuntimeError("simulator not started")
        return self._base_url

    @property
    def config(self) -> SimulatorConfig:
        """The knobs in force now (latency may have changed at runtime)."""
        return self._routes.config

    def set_latency(self, latency_s: float) -> None:
        """Changes the delay added to every counted request, as ``POST /__sim/config`` does.

        Raises:
            ValueError: If ``latency_s`` is not a finite number >= 0.
        """
        self._routes.set_latency(latency_s)

    def set_robots(self, text: str | None = None, status: int | None = None) -> None:
        """Changes what ``/robots.txt`` answers (body, status; None keeps that part), as
        ``POST /__sim/config`` with ``robots_txt`` / ``robots_status`` does.

        Raises:
            ValueError: If ``status`` is not from 200 to 599.
        """
        self._routes.set_robots(text, status)

    def counts(self) -> dict[str, Any]:
        """Returns the counters as a plain dict, the same as ``GET /__sim/counts``.

        Keys: ``total``, ``by_client``, ``by_path_kind``, ``windows`` (unix second, as
        a string, to count) and ``max_per_second`` (sliding one-second maximum).
        """
        return self._counters.snapshot()

    def release_hung(self) -> int:
        """Answers every ``/hang/N`` request waiting now with its 504 at once (later ones
        hang again); returns how many were released."""
        return self._routes.release_hung()

    def rate_limit_next(self, retry_after_s: int) -> None:
        """Answers the next counted request, whatever its path, with 429 and
        ``Retry-After: retry_after_s`` (its arrival counted as kind ``ratelimited``);
        later requests as usual.

        Raises:
            ValueError: If ``retry_after_s`` is negative.
        """
        self._routes.rate_limit_next(retry_after_s)

    def in_flight(self, kind: str = "*") -> int:
        """Returns how many requests of route ``kind`` (default: any) are being handled."""
        return self._counters.in_flight(kind)

    def requests_by_path(self) -> dict[str, int]:
        """Returns requests per path (query left out) since the last reset.

        Raises:
            OverflowError: If more than 100,000 distinct paths were asked for.
        """
        return self._counters.requests_by_path()

    def max_in_any_window(self, seconds: float) -> int:
        """Returns the most counted requests seen in any sliding window of ``seconds``.

        Raises:
            ValueError: If ``seconds`` is not positive.
        """
        return self._counters.max_in_any_window(seconds)

    def arrivals(self) -> list[Arrival]:
        """Returns every counted request since the last reset (the last 100,000 at
        most), in arrival order, as ``(at, kind, path)``: ``at`` on the monotonic clock
        (``time.monotonic()``, so several simulators in one process line up), ``kind``
        the route kind, ``path`` without the query."""
        return self._counters.arrivals()

    def visits(self) -> list[Visit]:
        """Returns every answered request since the last reset (the last 100,000 at
        most) as ``(client, began, ended, path)``: who sent it (the ``X-Jetfleet-Worker``
        header, else the user agent) and when it arrived and was answered, on the
        monotonic clock. Who was being served at the same moment is read from these."""
        return self._counters.visits()

    def served_by_path(self) -> dict[str, int]:
        """Returns 2xx pages answered per path (query left out) since the last reset:
        the effect each job has on the site. A request whose client went away before
        its answer (a worker killed mid-request) served nothing."""
        return self._counters.served_by_path()

    def pending(self) -> list[Pending]:
        """Returns the counted requests being handled now, oldest first, each with who
        sent it (``client_id``), when it arrived (monotonic) and its path."""
        return self._counters.pending()

    def sessions_issued(self) -> list[str]:
        """Every session token ``/session/N`` has set as its cookie since the last reset,
        in order."""
        return list(self._routes.sessions_issued)

    def sessions_presented(self) -> list[tuple[str, str]]:
        """Every ``/session/N`` request since the last reset, in arrival order, as
        ``(path, token)``: the session cookie it brought ("" for none)."""
        return list(self._routes.sessions_presented)

    def challenge_session(self, token: str) -> None:
        """From now on every ``/session/N`` request bringing session ``token`` answers
        the 503 challenge page (a site that has flagged that session), until reset;
        requests without it, or with another session, are served as usual."""
        self._routes.challenged_sessions.add(token)

    def reset(self) -> None:
        """Zeroes the counters, as ``POST /__sim/reset`` does (``times=`` paths fail
        again)."""
        self._routes.reset()

    async def __aenter__(self) -> TargetSimulator:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
