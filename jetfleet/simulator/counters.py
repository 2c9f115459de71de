"""Request counters: totals, per client, per User-Agent, per route kind, per time window,
and the most requests in flight at once."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

# Enough per-second buckets to cover a ten-minute benchmark run.
MAX_WINDOWS = 600
# Bounds memory under a long benchmark while still covering any test's burst.
MAX_TIMESTAMPS = 100_000
# Distinct paths counted one by one (``requests_by_path``); later new paths are not.
MAX_PATHS = 100_000
# The key of ``max_in_flight`` that counts every route kind together.
ALL_KINDS = "*"


class Arrival(NamedTuple):
    """One counted request as it arrived: when (monotonic seconds), its route kind and
    its path (query left out)."""

    at: float
    kind: str
    path: str


class Visit(NamedTuple):
    """One counted request from arrival to answer (monotonic seconds), and who sent it
    (``client_id``: the worker header, else the user agent, else the address)."""

    client: str
    began: float
    ended: float
    path: str


class Pending(NamedTuple):
    """One counted request not answered yet: who sent it, when it arrived (monotonic
    seconds) and its path."""

    client: str
    began: float
    path: str


def most_in_any_window(stamps: Iterable[float], seconds: float) -> int:
    """The most of ``stamps`` (seconds, one clock) in any half-open window
    ``[t, t + seconds)``: the same count for one simulator's arrivals or for several
    merged, so a cap over many targets is checked as the targets saw it together.

    Raises:
        ValueError: If ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    ordered = sorted(stamps)
    best = 0
    start = 0
    for end, stamp in enumerate(ordered):
        while stamp - ordered[start] >= seconds:
            start += 1
        best = max(best, end - start + 1)
    return best


class RequestCounters:
    """Counts requests seen by the simulator.

    Two clocks are kept on purpose: wall-clock seconds name the per-second windows so
    they can be lined up with other logs, while sliding-window maxima use a monotonic
    clock so they survive wall-clock jumps.

    Args:
        clock: Monotonic clock, in seconds, for sliding-window maxima.
        wall_clock: Wall clock, in unix seconds, for naming per-second windows.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._total = 0
        self._by_client: Counter[str] = Counter()
        self._by_kind: Counter[str] = Counter()
        self._by_agent: Counter[str] = Counter()
        self._by_path: Counter[str] = Counter()
        self._paths_dropped = False
        self._in_flight: Counter[str] = Counter()
        self._most_in_flight: Counter[str] = Counter()
        self._windows: dict[int, int] = {}
        self._arrivals: deque[Arrival] = deque(maxlen=MAX_TIMESTAMPS)
        self._visits: deque[Visit] = deque(maxlen=MAX_TIMESTAMPS)
        self._served: Counter[str] = Counter()
        self._pending: dict[int, Pending] = {}

    def record(self, client_id: str, kind: str, user_agent: str = "", path: str = "") -> None:
        """Counts one request.

        Args:
            client_id: Who sent it (worker header, user agent or remote address).
            kind: Which kind of route it hit, e.g. ``"page"`` or ``"hang"``.
            user_agent: Its ``User-Agent`` header, as sent ("" when absent).
            path: The path asked for, without the query.
        """
        self._total += 1
        self._by_client[client_id] += 1
        self._by_kind[kind] += 1
        self._by_agent[user_agent] += 1
        if path in self._by_path or len(self._by_path) < MAX_PATHS:
            self._by_path[path] += 1
        else:
            self._paths_dropped = True
        second = int(self._wall_clock())
        self._windows[second] = self._windows.get(second, 0) + 1
        while len(self._windows) > MAX_WINDOWS:
            del self._windows[min(self._windows)]
        self._arrivals.append(Arrival(self._clock(), kind, path))

    def began(self, kind: str) -> None:
        """A request of ``kind`` is now being handled (until ``ended``)."""
        self._in_flight[kind] += 1
        self._in_flight[ALL_KINDS] += 1
        for key in (kind, ALL_KINDS):
            self._most_in_flight[key] = max(self._most_in_flight[key], self._in_flight[key])

    def ended(self, kind: str) -> None:
        """A request counted by ``began`` has been answered (or dropped)."""
        self._in_flight[kind] -= 1
        self._in_flight[ALL_KINDS] -= 1

    def visited(self, client_id: str, began: float, path: str) -> None:
        """A request that arrived at ``began`` (this counter's clock) is answered now."""
        self._visits.append(Visit(client_id, began, self._clock(), path))

    def now(self) -> float:
        """This counter's clock (monotonic seconds)."""
        return self._clock()

    def visits(self) -> list[Visit]:
        """Every answered request since the last reset (the last 100,000 at most), in
        the order they were answered, with who sent it and when it arrived and ended:
        for checks of who was being served at the same time."""
        return list(self._visits)

    def in_flight(self, kind: str = ALL_KINDS) -> int:
        """Requests of ``kind`` (default: any) being handled now."""
        return self._in_flight[kind]

    def reset(self) -> None:
        """Zeroes every counter; the most in flight starts again from those in flight now."""
        self._total = 0
        self._by_client.clear()
        self._by_kind.clear()
        self._by_agent.clear()
        self._by_path.clear()
        self._paths_dropped = False
        self._most_in_flight = Counter({k: n for k, n in self._in_flight.items() if n})
        self._windows.clear()
        self._arrivals.clear()
        self._visits.clear()
        self._served.clear()

    def requests_by_path(self) -> dict[str, int]:
        """Requests per path (query left out), for the first 100,000 distinct paths since
        the last reset; not in ``snapshot``, which stays small.

        Raises:
            OverflowError: If more distinct paths were asked for than are counted.
        """
        if self._paths_dropped:
            raise OverflowError(f"more than {MAX_PATHS} distinct paths; reset more often")
        return dict(self._by_path)

    def max_in_any_window(self, seconds: float) -> int:
        """Returns the most requests seen in any sliding window of the given length.

        The window is half-open (``[t, t + seconds)``), so a client spacing requests
        exactly ``1 / rate`` apart never shows more than ``rate`` in one second.

        Args:
            seconds: Window length; must be positive.

        Returns:
            The maximum count over the recorded timestamps (the last 100,000 at most).

        Raises:
            ValueError: If ``seconds`` is not positive.
        """
        return most_in_any_window((a.at for a in self._arrivals), seconds)

    def arrivals(self) -> list[Arrival]:
        """Every counted request since the last reset (the last 100,000 at most), in
        arrival order: when, which route kind, which path. For checks a window count
        cannot make, such as a quiet spell after one path's answer, or caps over
        several simulators' arrivals merged."""
        return list(self._arrivals)

    # --- pages served and requests pending (the demo's side-effect and kill checks) ---

    def served(self, path: str) -> None:
        """A counted request for ``path`` was answered with a 2xx page: the effect a
        job has on the target, which must happen once per unit of work."""
        if path in self._served or len(self._served) < MAX_PATHS:
            self._served[path] += 1

    def served_by_path(self) -> dict[str, int]:
        """2xx pages answered per path (query left out) since the last reset; a request
        whose client went away before its answer is not among them."""
        return dict(self._served)

    def opened(self, token: int, pending: Pending) -> None:
        """A counted request is being handled until ``closed(token)``."""
        self._pending[token] = pending

    def closed(self, token: int) -> None:
        """The request ``opened`` with ``token`` was answered or dropped."""
        self._pending.pop(token, None)

    def pending(self) -> list[Pending]:
        """The counted requests being handled now, oldest first."""
        return sorted(self._pending.values(), key=lambda p: p.began)

    def snapshot(self) -> dict[str, Any]:
        """Returns the counters as a JSON-ready dict.

        Window keys are strings (unix seconds) so the dict is identical before and
        after a JSON round trip. ``max_in_flight`` is the most requests handled at the
        same moment (arrival to answer) since the last reset, by route kind and
        over all of them (key ``"*"``).
        """
        return {
            "total": self._total,
            "by_client": dict(self._by_client),
            "by_user_agent": dict(self._by_agent),
            "by_path_kind": dict(self._by_kind),
            "max_in_flight": {k: n for k, n in self._most_in_flight.items() if n},
            "windows": {str(second): count for second, count in sorted(self._windows.items())},
            "max_per_second": self.max_in_any_window(1.0),
        }
