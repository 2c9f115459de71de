"""Each service's and worker's /metrics (OpenTelemetry, one MeterProvider each) shows its
own series with who is failing: answers by status, target, worker, version tuple."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import aiohttp
import msgspec
import pytest
from jetfleet.schemas.breaker import BreakerRecord, BreakerView
from jetfleet.services.gateway import Gateway
from jetfleet.services.gateway.metrics import FleetGauges, QueueDepths
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

import jetfleet.ops.status as status_module
from jetfleet import subjects
from jetfleet.auth.credentials import settings_for_role
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.lease_client import LeaseClient
from jetfleet.metrics import (
    OTHER,
    CounterFamily,
    GaugeFamily,
    HistogramFamily,
    MetricFamily,
    MetricsServer,
    ServiceMeters,
    otlp_requested,
)
from jetfleet.ops.status import FleetStatus, TargetCounts
from jetfleet.service import serve_until_signalled
from jetfleet.settings import GatewaySettings, Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.worker import Worker
from jetfleet.worker.verdict import Held
from tests.conftest import wait_for
from tests.leasing import ask, granted, order_for, refused, report_failure
from tests.prom_text import names, samples, value
from tests.stack import InProcessStack


def test_a_counter_family_renders_prometheus_text_with_escaped_labels() -> None:
    family = CounterFamily("jf_test_total", "A test counter")
    family.inc(target="demo", reason='say "hi"')
    family.inc(2, target="demo", reason='say "hi"')
    text = ServiceMeters("test", [family]).render().decode()
    assert "# TYPE jf_test_total counter" in text
    assert 'jf_test_total{reason="say \\"hi\\"",target="demo"} 3.0' in text


def test_item10_label_sets_beyond_the_cap_fold_into_other_and_counts_are_kept() -> None:
    # Target and worker names can come from any client: a flood of distinct names must
    # not grow a family's series (and the /metrics page) without end.
    family = CounterFamily("jf_test_total", "A test counter", max_series=5)
    for n in range(5):
        family.inc(target=f"t-{n}", worker="w-1")
    for n in range(10_000):
        family.inc(target=f"attacker-{n}", worker=f"w-{n}")
    family.inc(3, target="t-0", worker="w-1")  # a series kept before the cap still counts
    assert len(family.values) == 6
    assert family.get(target="t-0", worker="w-1") == 4
    assert family.get(target=OTHER, worker=OTHER) == 10_000
    assert sum(family.values.values()) == 5 + 10_000 + 3
    text = ServiceMeters("test", [family]).render().decode()
    assert text.count("\njf_test_total{") == 6
    assert value(text, "jf_test_total", target=OTHER, worker=OTHER) == 10_000


def test_item10_histograms_fold_and_gauges_stop_adding_series_at_the_cap() -> None:
    histogram = HistogramFamily("jf_wait_seconds", "A test histogram", max_series=2)
    gauge = GaugeFamily("jf_depth", "A test gauge", max_series=2)
    text_of = ServiceMeters("test", [histogram, gauge])
    for n in range(50):
        histogram.observe(0.01, target=f"t-{n}")
        gauge.set(n, target=f"t-{n}")
    text = text_of.render().decode()
    assert value(text, "jf_wait_seconds_count", target="t-0") == 1
    assert value(text, "jf_wait_seconds_count", target=OTHER) == 48
    assert text.count("\njf_wait_seconds_count{") == 3
    assert text.count("\njf_depth{") == 2  # a set value cannot be summed: not kept
    assert value(text, "jf_depth", target="t-1") == 1


def test_item10_a_label_value_over_the_length_cap_counts_as_other() -> None:
    family = CounterFamily("jf_test_total", "A test counter")
    family.inc(target="x" * 10_000, worker="w-1")
    assert family.get(target=OTHER, worker="w-1") == 1
    assert "x" * 200 not in ServiceMeters("test", [family]).render().decode()


def test_otlp_export_is_off_unless_the_standard_variables_ask() -> None:
    assert not otlp_requested({})
    assert otlp_requested({"OTEL_METRICS_EXPORTER": "otlp"})
    assert otlp_requested({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:1/v1/metrics"})
    assert not otlp_requested(
        {"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://x"}
    )


def test_two_services_in_one_process_each_show_only_their_own_counts() -> None:
    sink = CounterFamily("jf_sink_total", "sink's")
    leaser = CounterFamily("jf_leaser_total", "leaser's")
    sink.inc(target="demo")
    leaser.inc(4, target="demo")
    sink_text = ServiceMeters("sink", [sink]).render().decode()
    leaser_text = ServiceMeters("leaser", [leaser]).render().decode()
    assert "jf_leaser_total" not in sink_text and "jf_sink_total" not in leaser_text
    assert value(leaser_text, "jf_leaser_total", target="demo") == 4
    assert value(sink_text, "target_info", **_target_info(sink_text)) == 1
    assert _target_info(sink_text)["service_name"] == "jetfleet-sink"


def _target_info(text: str) -> dict[str, str]:
    [labels] = [dict(k) for name, k in samples(text) if name == "target_info"]
    return labels


@dataclass
class Scrapes:
    """What each endpoint answered before and after the known run."""

    before: dict[str, str]
    after: dict[str, str]
    refused: str
    """The reason the one lease refusal of the run was given."""


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[Gateway]:
    own = msgspec.structs.replace(settings, gateway=GatewaySettings(port=0))
    conn = await connect_nats(settings.nats, "gateway", role="gateway")
    service = Gateway(settings_for_role(own, "gateway"), conn)
    await service.start()
    yield service
    await service.drain(5.0)
    await conn.close()


async def _scrape(http: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, str]:
    texts = {}
    for name, url in urls.items():
        async with http.get(url) as response:
            assert response.status == 200, (name, response.status)
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            texts[name] = await response.text()
    return texts


async def known_run(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    gateway: Gateway,
    simulator: TargetSimulator,
) -> tuple[Scrapes, int]:
    """Two jobs committed, one dead-lettered (404), one rejected at admission, one lease
    refused (to worker ``w-other``); every service's endpoint scraped before and after.
    Returns the scrapes and how many requests the target counted."""
    quarantine = await stack.add_quarantine()
    assert stack.sink and stack.leaser and stack.scheduler and stack.ratelimit
    families: dict[str, Sequence[MetricFamily]] = {
        "sink": stack.sink.metrics,
        "leaser": stack.leaser.metrics,
        "scheduler": stack.scheduler.metrics,
        "ratelimit": stack.ratelimit.metrics,
        "quarantine": quarantine.metrics,
        "worker": stack.workers[0].metrics,
    }
    servers = {name: MetricsServer(f, service=name) for name, f in families.items()}
    urls = {name: f"http://127.0.0.1:{await s.start()}/metrics" for name, s in servers.items()}
    urls["gateway"] = f"{gateway.url}/metrics"
    sent_before = simulator.counts()["total"]
    try:
        async with aiohttp.ClientSession() as http:
            before = await _scrape(http, urls)
            js = nc.jetstream()
            jobs = jobs_for("demo", settings, ["/page/1", "/page/2", "/missing/3"])
            jobs += jobs_for("demo", settings, ["/page/4"], handler="no-such-handler")
            await submit_jobs(js, settings, "demo", jobs)

            async def settled() -> bool:
                totals = (await stack.status()).totals
                read = quarantine.events.get(verdict="counted")
                return (totals.committed, totals.dead, totals.rejected, read) == (2, 1, 1, 3)

            await wait_for(settled, 30, "2 commits, 1 dead letter, 1 rejection, 3 events read")
            # One lease refused: a job leased to one worker, asked for by another.
            leases = LeaseClient(nc)
            order = order_for(settings, "/page/9")
            await granted(leases, ask(order, worker="w-probe"))
            refusal = await refused(leases, ask(order, worker="w-other"))
            after = await _scrape(http, urls)
    finally:
        for server in servers.values():
            await server.stop()
    return Scrapes(before, after, refusal.reason), simulator.counts()["total"] - sent_before


async def test_every_service_and_the_worker_expose_the_named_series_after_a_known_run(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    gateway: Gateway,
    simulator: TargetSimulator,
) -> None:
    scrapes, sent = await known_run(settings, nc, stack, gateway, simulator)
    got = scrapes.after
    worker = stack.workers[0]
    tuple_id = worker.version_tuple.id
    assert tuple_id

    # Sink: commits, dead letters by reason; nobody else's series.
    sink = got["sink"]
    assert value(sink, "jetfleet_sink_answers_total", status="committed", target="demo") == 2
    assert value(sink, "jetfleet_sink_answers_total", status="dead-lettered", target="demo") == 1
    assert value(sink, "jetfleet_sink_dead_letters_total", target="demo", reason="http-404") == 1
    assert not any(n.startswith(("jetfleet_lease_", "jetfleet_worker_")) for n in names(sink))

    # Leaser: one grant per job, and one more for each job its permit sent back unrun.
    unrun = worker.stats["refused:rate-limited"] + worker.stats["refused:target-held"]
    grants = 3 + unrun
    leaser = got["leaser"]
    granted = {"answer": "granted", "reason": "", "target": "demo", "worker": "w-0"}
    assert value(leaser, "jetfleet_lease_answers_total", **granted) == grants
    handled = value(leaser, "jetfleet_lease_handle_seconds_count", op="grant", answer="granted")
    assert handled == grants + 1  # and w-probe's
    refusal = {"answer": "refused", "reason": scrapes.refused, "target": "demo"}
    assert value(leaser, "jetfleet_lease_answers_total", **refusal, worker="w-other") == 1
    refusals = sum(
        v
        for (name, labels), v in samples(leaser).items()
        if name == "jetfleet_lease_answers_total" and ("answer", "refused") in labels
    )
    timed = value(leaser, "jetfleet_lease_handle_seconds_count", op="grant", answer="refused")
    assert timed == refusals >= 1
    assert "jetfleet_sink_answers_total" not in names(leaser)

    # Scheduler: three admitted, one rejected with its reason.
    scheduler = got["scheduler"]
    admitted = {"reason": "", "target": "demo", "verdict": "admitted"}
    assert value(scheduler, "jetfleet_admissions_total", **admitted) == 3
    rejected = [
        (dict(labels), v)
        for (name, labels), v in samples(scheduler).items()
        if name == "jetfleet_admissions_total" and dict(labels)["verdict"] == "rejected"
    ]
    assert [v for _, v in rejected] == [1] and rejected[0][0]["reason"], rejected

    # Ratelimit: a permit for every request the target counted; Redis answers.
    ratelimit = got["ratelimit"]
    allowed = sum(
        v
        for (name, labels), v in samples(ratelimit).items()
        if name == "jetfleet_ratelimit_answers_total" and ("answer", "allowed") in labels
    )
    assert allowed == sent == 3
    assert value(ratelimit, "jetfleet_ratelimit_failing_closed") == 0

    # Quarantine: it read the three outcome events; no second-order retirement.
    quarantine = got["quarantine"]
    assert value(quarantine, "jetfleet_quarantine_events_total", verdict="counted") == 3
    assert "jetfleet_quarantine_second_order_total" not in names(quarantine)

    # Worker: attempts by worker, identity, target, version and tuple; lease round trips.
    attempt = {"worker": "w-0", "identity": "", "target": "demo", "tuple": tuple_id}
    ok = {**attempt, "version": "http.get@1", "outcome": "ok", "reason": ""}
    dead = {**attempt, "version": "http.get@1", "outcome": "permanent", "reason": "http-404"}
    assert value(got["worker"], "jetfleet_worker_attempts_total", **ok) == 2
    assert value(got["worker"], "jetfleet_worker_attempts_total", **dead) == 1
    round_trip = {"worker": "w-0", "target": "demo", "op": "grant", "answer": "granted"}
    assert value(got["worker"], "jetfleet_worker_lease_seconds_count", **round_trip) == grants

    # Gateway: the fleet's state, read from JetStream; conserved; the limiter answers.
    fleet = got["gateway"]
    for state, n in {"submitted": 4, "committed": 2, "dead": 1, "rejected": 1}.items():
        assert value(fleet, "jetfleet_jobs", target="demo", state=state) == n
    assert value(fleet, "jetfleet_unaccounted_jobs") == 0
    assert value(fleet, "jetfleet_ratelimit_ok") == 1
    assert value(fleet, "jetfleet_second_order_in_force") == 0
    assert "jetfleet_breaker_open" not in names(fleet)


def test_the_gateway_gauges_show_queue_depth_by_tier_breakers_and_the_mismatch() -> None:
    targets = {"demo": TargetCounts(submitted=5, queued=2, leased=1, committed=1)}
    breaker = BreakerView(record=BreakerRecord(target="demo", cool_s=60.0, opens=2), state="open")
    status = FleetStatus(
        totals=TargetCounts(), targets=targets, unaccounted=1, conserved=False, breakers=[breaker]
    )
    queue: QueueDepths = Counter({("demo", "high"): 1, ("demo", "normal"): 2})
    gauges = FleetGauges({"demo"})
    text = gauges.render(status, queue).decode()
    assert value(text, "jetfleet_queue_messages", target="demo", tier="high") == 1
    assert value(text, "jetfleet_queue_messages", target="demo", tier="normal") == 2
    assert value(text, "jetfleet_unaccounted_jobs") == 1
    assert value(text, "jetfleet_breaker_open", target="demo", state="open", opens="2") == 1
    # The next scrape replaces every series: a closed breaker and a drained tier are gone.
    calm = FleetStatus(totals=TargetCounts(), targets=targets)
    text = gauges.render(calm, Counter({("demo", "normal"): 1})).decode()
    assert "jetfleet_breaker_open" not in names(text)
    assert value(text, "jetfleet_queue_messages", target="demo", tier="high") is None
    assert value(text, "jetfleet_unaccounted_jobs") == 0


class _OtlpReceiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP metrics receiver (protobuf), in a thread: the SDK's exporter posts
    synchronously, so it cannot be answered by this test's event loop."""

    got: ClassVar[list[ExportMetricsServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.append(ExportMetricsServiceRequest.FromString(body))
        answer = ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_with_the_otlp_variables_set_a_service_pushes_its_metrics_over_otlp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _OtlpReceiver.got.clear()  # another test's exports (the receiver's list is shared)
    server = http.server.HTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/metrics"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
        family = CounterFamily("jetfleet_sink_answers_total", "answers")
        family.inc(2, status="committed", target="demo")
        meters = ServiceMeters("sink", [family], prometheus=False, otlp=True)
        assert meters.provider.force_flush()
        meters.shutdown()
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    points = [
        (metric.name, {a.key: a.value.string_value for a in p.attributes}, p.as_int or p.as_double)
        for request in _OtlpReceiver.got
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        for p in metric.sum.data_points
    ]
    assert ("jetfleet_sink_answers_total", {"status": "committed", "target": "demo"}, 2) in points
    services = {
        a.value.string_value
        for request in _OtlpReceiver.got
        for rm in request.resource_metrics
        for a in rm.resource.attributes
        if a.key == "service.name"
    }
    assert services == {"jetfleet-sink"}


async def test_the_gateway_shows_queue_depth_per_target_and_tier_read_from_the_work_stream(
    settings: Settings, nc: NatsClient, services: InProcessStack, gateway: Gateway
) -> None:
    # No worker: what is admitted stays queued.
    js = nc.jetstream()
    jobs = jobs_for("demo", settings, ["/page/1", "/page/2"])
    jobs += jobs_for("demo", settings, ["/page/3"], tier="high")
    await submit_jobs(js, settings, "demo", jobs)

    async def queued() -> bool:
        return (await services.status()).totals.queued == 3

    await wait_for(queued, 30, "3 jobs queued")
    async with aiohttp.ClientSession() as http:
        [text] = (await _scrape(http, {"gateway": f"{gateway.url}/metrics"})).values()
    assert value(text, "jetfleet_queue_messages", target="demo", tier="normal") == 2
    assert value(text, "jetfleet_queue_messages", target="demo", tier="high") == 1
    assert value(text, "jetfleet_queue_messages", target="demo", tier="bulk") is None
    assert value(text, "jetfleet_jobs", target="demo", state="queued") == 3


async def test_a_failure_report_sent_again_counts_one_dead_letter(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """A worker whose sink answer was lost sends its report again, and the sink answers
    ``dead-lettered`` again from the seal; the letter was written once, so
    ``jetfleet_sink_dead_letters_total`` counts one (its answers count both)."""
    order = order_for(settings, "/page/dead-twice")
    fence = (await granted(LeaseClient(nc), ask(order, worker="w-a"))).fence
    first = await report_failure(nc, order, fence, "w-a", reason="http-404")
    again = await report_failure(nc, order, fence, "w-a", reason="http-404")
    assert (first.status, again.status) == ("dead-lettered", "dead-lettered")
    assert services.sink is not None
    assert services.sink.answers.get(status="dead-lettered", target="demo") == 2
    assert services.sink.dead_letters.get(target="demo", reason="http-404") == 1


class _LoopWatch(GaugeFamily):
    """A gauge whose collection waits (up to a deadline) for the event loop to run a
    step of its own: it reads 1 if the loop ran meanwhile, 0 if it was stuck."""

    def __init__(self) -> None:
        super().__init__("jetfleet_loop_ran", "Whether the loop ran during a scrape.")
        self.collecting = threading.Event()
        self.loop_ran = threading.Event()

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        self.collecting.set()
        return [Observation(1 if self.loop_ran.wait(10.0) else 0)]


async def test_a_scrape_runs_off_the_event_loop_so_commits_go_on_meanwhile() -> None:
    """Collecting 1000 series takes tens of milliseconds of OpenTelemetry's Python; on the
    loop it would stall every lease and commit of the service for that long."""
    watch = _LoopWatch()
    server = MetricsServer([watch], service="test")
    port = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            scrape = asyncio.ensure_future(http.get(f"http://127.0.0.1:{port}/metrics"))
            assert await asyncio.to_thread(watch.collecting.wait, 10.0), "no collection began"
            watch.loop_ran.set()  # runs only if the loop is free while collecting
            async with await scrape as response:
                text = await response.text()
    finally:
        await server.stop()
    assert value(text, "jetfleet_loop_ran") == 1


async def test_the_gateways_conservation_gauge_reads_again_while_a_read_does_not_add_up(
    settings: Settings, nc: NatsClient, gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a steady flow most single reads catch a job between two counts (measured:
    28 of 42 reads during a 300-job run, off by up to 200), so a gauge from one read is
    non-zero scrape after scrape and JetfleetConservationMismatch pages for nothing. The
    gateway reads as ``jetfleet status`` does: again until the counts add up. Here the
    first read of each scrape is made to catch a job between two counts."""
    real = status_module.fleet_status
    calls = 0

    async def first_read_mid_move(js: JetStreamContext, s: Settings) -> FleetStatus:
        nonlocal calls
        calls += 1
        status = await real(js, s)
        if calls == 1:
            return msgspec.structs.replace(status, unaccounted=1, conserved=False)
        return status

    monkeypatch.setattr(status_module, "fleet_status", first_read_mid_move)
    async with aiohttp.ClientSession() as http:
        text = (await _scrape(http, {"gateway": f"{gateway.url}/metrics"}))["gateway"]
    assert value(text, "jetfleet_unaccounted_jobs") == 0
    assert calls == 2


async def test_a_renewal_nobody_answers_is_timed_as_unanswered_not_refused(
    settings: Settings, nc: NatsClient
) -> None:
    """No leaser running: the renewal gets no responders (the lease client says
    unknown); then a leaser that hangs: the renewal runs out of the lease's time left.
    Both are the leaser's trouble, not a lost lease, and both are timed."""
    worker = Worker(settings_for_role(settings, "worker"), nc, "w-renew")
    order = order_for(settings, "/page/renew")
    held = Held(fence=1, ttl_s=10.0, attempt=1)
    labels = {"worker": "w-renew", "target": "demo", "op": "renew"}
    assert await worker._renew_within(None, order, held, 5.0) is None  # type: ignore[arg-type]
    hung = await nc.subscribe(subjects.LEASE)  # takes the call, never answers
    try:
        assert await worker._renew_within(None, order, held, 0.3) is None  # type: ignore[arg-type]
    finally:
        await hung.unsubscribe()
    assert worker.lease_latency.count(**labels, answer="refused") == 0
    assert worker.lease_latency.count(**labels, answer="unanswered") == 2


class _FailingDrain:
    """A service whose drain fails (a store gone mid-drain, say)."""

    name = "failing"

    def __init__(self) -> None:
        self.metrics = [CounterFamily("jetfleet_failing_total", "a count")]

    async def start(self) -> None:
        self.metrics[0].inc()

    async def drain(self, timeout_s: float = 30.0) -> None:
        raise RuntimeError("drain failed")


@pytest.mark.parametrize("port", [None, 0])
async def test_a_failed_drain_still_shuts_the_metrics_down(
    monkeypatch: pytest.MonkeyPatch, port: int | None
) -> None:
    """No OTLP export thread (nor /metrics listener) outlives its service, whatever
    its drain did."""
    receiver = http.server.HTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    serving = threading.Thread(target=receiver.serve_forever, daemon=True)
    serving.start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/metrics"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
    before = set(threading.enumerate())
    stop = asyncio.Event()
    stop.set()
    try:
        with pytest.raises(RuntimeError, match="drain failed"):
            await serve_until_signalled(_FailingDrain(), metrics_port=port, stop=stop)
    finally:
        receiver.shutdown()
        receiver.server_close()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not [name for name in left if "Otel" in name], left
