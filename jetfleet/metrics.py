"""Metric families a service keeps, exported through OpenTelemetry (docs/metrics.md).

A component declares its families (``CounterFamily``, ``GaugeFamily``,
``HistogramFamily``) and counts into them; the service lists them in ``metrics``. When
the service is run with ``--metrics-port`` (or OTLP export is asked for), its families
are bound to a ``ServiceMeters``: a MeterProvider of its own with a Prometheus reader on
a registry of its own (never prometheus_client's global ``REGISTRY``), so several
services in one process each show only their own counts.

Counters and gauges keep their (bounded) series here and reach OpenTelemetry as
asynchronous instruments read at collection; histograms are OpenTelemetry histograms,
recorded into every provider bound to them.

Cardinality is bounded here, before OpenTelemetry sees a value: a label value over
``MAX_LABEL_CHARS`` counts as ``OTHER``, and once a family has ``max_series`` label sets
a new one is folded into the series whose every label is ``OTHER`` (counters and
histograms) or not kept (gauges: a set value cannot be summed). OpenTelemetry's own
limit (2000 points a stream) is never reached below ours.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from aiohttp import web
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest

Labels = tuple[tuple[str, str], ...]
log = logging.getLogger(__name__)


MAX_SERIES = 1000
"""Label sets a family keeps by default; later new ones are folded (see the module)."""
MAX_LABEL_CHARS = 128
"""A longer label value is counted as ``OTHER``."""
OTHER = "_other"
"""Where folded counts go: no target can be named so (a name starts with a letter or
digit), so a target called ``other`` keeps its own series."""
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Histogram bounds (seconds) for round trips: a lease grant is milliseconds, a permit
wait can be seconds."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format that ``generate_latest`` writes for our names (plain
ASCII); prometheus_client's own constant says 1.0.0, which Prometheus 2 does not know."""


class MetricFamily(Protocol):
    """A family a service lists in ``metrics``: it can be bound to a meter."""

    name: str

    def bind(self, meter: Meter) -> None:
        """Create this family's instrument on ``meter`` (one per provider)."""

    def unbind(self, meter: Meter) -> None:
        """Stop recording into ``meter`` (its provider is shutting down)."""


class _Bounded:
    """The label bound every family shares."""

    def __init__(self, name: str, help_text: str, max_series: int) -> None:
        self.name = name
        self.help_text = help_text
        self.max_series = max_series
        self._warned = False

    def unbind(self, meter: Meter) -> None:
        """Asynchronous instruments need nothing: their provider stops reading them."""

    def _labels(self, labels: Mapping[str, str]) -> Labels:
        return tuple(
            sorted((k, v if len(v) <= MAX_LABEL_CHARS else OTHER) for k, v in labels.items())
        )

    def _fold(self, series: Labels, known: Mapping[Labels, object]) -> Labels | None:
        """``series`` if it may be kept, else the overflow series (None: not kept)."""
        if series in known or len(known) < self.max_series:
            return series
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: %d label sets reached; new ones are folded into %r",
                self.name,
                self.max_series,
                OTHER,
            )
        return tuple((k, OTHER) for k, _ in series)


class _Observed(_Bounded):
    """A family read by an asynchronous instrument: its ``values`` at collection."""

    values: Mapping[Labels, float]

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(labels)) for labels, v in list(self.values.items())]


class CounterFamily(_Observed):
    """One counter with labels, e.g. ``jetfleet_sink_answers_total{status,target}``.

    Label values such as target and worker names can come from any NATS client, so a
    family is bounded (see the module); series kept before the cap go on counting and no
    count is dropped.
    """

    def __init__(self, name: str, help_text: str, max_series: int = MAX_SERIES) -> None:
        super().__init__(name, help_text, max_series)
        self.values: Counter[Labels] = Counter()

    def inc(self, n: int = 1, **labels: str) -> None:
        """Add ``n`` to the series with these labels (or to its ``OTHER`` series)."""
        series = self._fold(self._labels(labels), self.values)
        assert series is not None  # counters always fold
        self.values[series] += n

    def get(self, **labels: str) -> int:
        """The current value of one series (0 if never incremented)."""
        return self.values[tuple(sorted(labels.items()))]

    def bind(self, meter: Meter) -> None:
        """An asynchronous counter reading this family's totals."""
        meter.create_observable_counter(
            self.name, callbacks=[self._observe], description=self.help_text
        )


class GaugeFamily(_Observed):
    """One gauge with labels: a value that is set, replaced and removed, not summed."""

    def __init__(self, name: str, help_text: str, max_series: int = MAX_SERIES) -> None:
        super().__init__(name, help_text, max_series)
        self.values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        """Set the series with these labels to ``value`` (not kept past the cap)."""
        series = self._labels(labels)
        if series in self.values or len(self.values) < self.max_series:
            self.values[series] = value
        else:
            self._fold(series, self.values)  # warns once

    def remove(self, **labels: str) -> None:
        """Drop the series with these labels (a no-op if it is not there)."""
        self.values.pop(self._labels(labels), None)

    def clear(self) -> None:
        """Drop every series (before setting them all again from a fresh read)."""
        self.values.clear()

    def get(self, **labels: str) -> float | None:
        """The current value of one series, or None if it is not set."""
        return self.values.get(tuple(sorted(labels.items())))

    def bind(self, meter: Meter) -> None:
        """An asynchronous gauge reading this family's values."""
        meter.create_observable_gauge(
            self.name, callbacks=[self._observe], description=self.help_text
        )


class HistogramFamily(_Bounded):
    """One histogram with labels, e.g. lease round trips in seconds.

    Observations go to the OpenTelemetry histograms of every provider bound so far; the
    family itself keeps only how many each series had (``count``), for tests and status.
    """

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
        max_series: int = MAX_SERIES,
    ) -> None:
        super().__init__(name, help_text, max_series)
        self.buckets = tuple(buckets)
        self.counts: Counter[Labels] = Counter()
        self._instruments: dict[int, Histogram] = {}
        """The histogram on each bound meter, by the meter's id."""

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation (seconds, for a latency) in its series."""
        series = self._fold(self._labels(labels), self.counts)
        assert series is not None
        self.counts[series] += 1
        attributes = dict(series)
        for histogram in list(self._instruments.values()):
            histogram.record(value, attributes)

    def count(self, **labels: str) -> int:
        """How many observations one series had."""
        return self.counts[tuple(sorted(labels.items()))]

    def bind(self, meter: Meter) -> None:
        """A synchronous OpenTelemetry histogram with this family's bounds."""
        self._instruments[id(meter)] = meter.create_histogram(
            self.name,
            description=self.help_text,
            explicit_bucket_boundaries_advisory=list(self.buckets),
        )

    def unbind(self, meter: Meter) -> None:
        """Record no more into ``meter``'s histogram."""
        self._instruments.pop(id(meter), None)


def otlp_requested(environ: Mapping[str, str]) -> bool:
    """Whether the standard OpenTelemetry variables ask for OTLP metric export:
    ``OTEL_METRICS_EXPORTER`` names ``otlp``, or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``
    is set (and the exporter is not ``none``). Off when neither is set."""
    exporters = {e.strip() for e in environ.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if "none" in exporters:
        return False
    return "otlp" in exporters or bool(environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))


def _otlp_reader() -> MetricReader:
    # Imported only when asked for; the exporter reads the OTEL_EXPORTER_OTLP_* variables.
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(OTLPMetricExporter())


class ServiceMeters:
    """One service's MeterProvider, with a Prometheus reader on its own registry and,
    when asked, an OTLP reader; its families are bound to it."""

    def __init__(
        self,
        service: str,
        families: Sequence[MetricFamily],
        prometheus: bool = True,
        otlp: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = []
        if prometheus:
            readers.append(PrometheusMetricReader(scope_info_enabled=False, registry=self.registry))
        if otlp:
            readers.append(_otlp_reader())
        self.provider = MeterProvider(
            metric_readers=readers,
            resource=Resource.create({"service.name": f"jetfleet-{service}"}),
        )
        self.families = tuple(families)
        self.meter = self.provider.get_meter("jetfleet")
        for family in self.families:
            family.bind(self.meter)

    def render(self) -> bytes:
        """What ``/metrics`` answers: the exposition text of this service only."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Flush (OTLP) and stop the readers; the families stop recording into them."""
        for family in self.families:
            family.unbind(self.meter)
        self.provider.shutdown()


class MetricsServer:
    """Serves ``/metrics`` for one service's families on a loopback-by-default port."""

    def __init__(
        self,
        families: Sequence[MetricFamily],
        host: str = "127.0.0.1",
        port: int = 0,
        service: str = "jetfleet",
        otlp: bool = False,
    ) -> None:
        self.meters = ServiceMeters(service, families, otlp=otlp)
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
        """Stop serving and shut the meters down."""
        if self._runner is not None:
            await self._runner.cleanup()
        self.meters.shutdown()

    async def _metrics(self, request: web.Request) -> web.Response:
        # Collecting is OpenTelemetry's Python, tens of milliseconds for 1000 series:
        # in a thread, so the service's leases and commits go on meanwhile. The families
        # are read thread-safely (a list of a dict's items is taken in one step under
        # the GIL; histograms are the SDK's, locked), as the OTLP reader's thread does.
        body = await asyncio.to_thread(self.meters.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
