"""Prometheus counters a service exposes on its own ``/metrics`` (``--metrics-port``).

Every replica exposes its own counts; Prometheus sums them. Labels say which worker,
identity, target or version a count belongs to, so a failing one stands out.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from aiohttp import web

Labels = tuple[tuple[str, str], ...]
log = logging.getLogger(__name__)


MAX_SERIES = 1000
"""Label sets a family keeps by default; later new ones are counted under ``OTHER``."""
MAX_LABEL_CHARS = 128
"""A longer label value is counted as ``OTHER``."""
OTHER = "_other"
"""Where folded counts go: no target can be named so (a name starts with a letter or
digit), so a target called ``other`` keeps its own series."""


class MetricFamily(Protocol):
    """Anything that renders itself in the Prometheus text format."""

    def render(self) -> str:
        """The family's HELP, TYPE and series lines, ending in a newline."""


class CounterFamily:
    """One counter with labels, e.g. ``jetfleet_sink_answers_total{status,target}``.

    Label values such as target and worker names can come from any NATS client, so a
    family is bounded: a value over ``MAX_LABEL_CHARS`` counts as ``OTHER``, and once
    ``max_series`` label sets exist, a new one is counted with every value ``OTHER``
    (logged once). Series kept before the cap go on counting; no count is dropped.
    """

    def __init__(self, name: str, help_text: str, max_series: int = MAX_SERIES) -> None:
        self.name = name
        self.help_text = help_text
        self.max_series = max_series
        self.values: Counter[Labels] = Counter()
        self._warned = False

    def inc(self, n: int = 1, **labels: str) -> None:
        """Add ``n`` to the series with these labels (or to its ``OTHER`` series)."""
        self.values[self._series(labels)] += n

    def _series(self, labels: dict[str, str]) -> Labels:
        series = tuple(
            sorted((k, v if len(v) <= MAX_LABEL_CHARS else OTHER) for k, v in labels.items())
        )
        if series in self.values or len(self.values) < self.max_series:
            return series
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: %d label sets reached; new ones are counted with every label %r",
                self.name,
                self.max_series,
                OTHER,
            )
        return tuple((k, OTHER) for k, _ in series)

    def get(self, **labels: str) -> int:
        """The current value of one series (0 if never incremented)."""
        return self.values[tuple(sorted(labels.items()))]

    def render(self) -> str:
        """The family in Prometheus text format."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        for labels, value in sorted(self.values.items()):
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{self.name}{{{body}}} {value}")
        return "\n".join(lines) + "\n"


class GaugeFamily:
    """One gauge with labels: a value that is set, replaced and removed, not summed."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help_text = help_text
        self.values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        """Set the series with these labels to ``value``."""
        self.values[tuple(sorted(labels.items()))] = value

    def remove(self, **labels: str) -> None:
        """Drop the series with these labels (a no-op if it is not there)."""
        self.values.pop(tuple(sorted(labels.items())), None)

    def get(self, **labels: str) -> float | None:
        """The current value of one series, or None if it is not set."""
        return self.values.get(tuple(sorted(labels.items())))

    def render(self) -> str:
        """The family in Prometheus text format."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} gauge"]
        for labels, value in sorted(self.values.items()):
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{self.name}{{{body}}} {value:g}")
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    """Serves ``/metrics`` for a set of counter families on a loopback-by-default port."""

    def __init__(
        self, families: Sequence[MetricFamily], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.families = families
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Start serving; returns the bound port (a free one when ``port`` is 0)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.port
        return self.port

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        text = "".join(family.render() for family in self.families)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")
