"""Prometheus counters a service exposes on its own ``/metrics`` (``--metrics-port``).

Every replica exposes its own counts; Prometheus sums them. Labels say which worker,
identity, target or version a count belongs to, so a failing one stands out.
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

Labels = tuple[tuple[str, str], ...]


class CounterFamily:
    """One counter with labels, e.g. ``jetfleet_sink_answers_total{status,target}``."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help_text = help_text
        self.values: Counter[Labels] = Counter()

    def inc(self, n: int = 1, **labels: str) -> None:
        """Add ``n`` to the series with these labels."""
        self.values[tuple(sorted(labels.items()))] += n

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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    """Serves ``/metrics`` for a set of counter families on a loopback-by-default port."""

    def __init__(
        self, families: list[CounterFamily], host: str = "127.0.0.1", port: int = 0
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
