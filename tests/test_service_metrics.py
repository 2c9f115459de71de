"""Each service's /metrics shows who is failing: answers by status, target, worker."""

from __future__ import annotations

import aiohttp
from nats.aio.client import Client as NatsClient

from jetfleet.client import jobs_for, submit_jobs
from jetfleet.metrics import OTHER, CounterFamily, MetricsServer
from jetfleet.settings import Settings
from tests.conftest import wait_for
from tests.stack import InProcessStack


def test_a_counter_family_renders_prometheus_text_with_escaped_labels() -> None:
    family = CounterFamily("jf_test_total", "A test counter")
    family.inc(target="demo", reason='say "hi"')
    family.inc(2, target="demo", reason='say "hi"')
    text = family.render()
    assert "# TYPE jf_test_total counter" in text
    assert 'jf_test_total{reason="say \\"hi\\"",target="demo"} 3' in text


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
    assert family.render().count("\njf_test_total{") == 6


def test_item10_a_label_value_over_the_length_cap_counts_as_other() -> None:
    family = CounterFamily("jf_test_total", "A test counter")
    family.inc(target="x" * 10_000, worker="w-1")
    assert family.get(target=OTHER, worker="w-1") == 1
    assert "x" * 200 not in family.render()


async def test_sink_leaser_scheduler_and_worker_metrics_count_real_answers(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    js = nc.jetstream()
    jobs = jobs_for("demo", settings, ["/page/1", "/page/2", "/missing/3"])
    await submit_jobs(js, settings, "demo", jobs)

    async def settled() -> bool:
        totals = (await stack.status()).totals
        return totals.committed == 2 and totals.dead == 1

    await wait_for(settled, 30, "2 commits and 1 dead letter")
    assert stack.sink is not None and stack.leaser is not None and stack.scheduler is not None
    worker = stack.workers[0]
    families = stack.sink.metrics + stack.leaser.metrics + stack.scheduler.metrics
    exporter = MetricsServer(families + worker.metrics)
    port = await exporter.start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as response,
        ):
            assert response.status == 200
            text = await response.text()
    finally:
        await exporter.stop()
    assert 'jetfleet_sink_answers_total{status="committed",target="demo"} 2' in text
    assert 'jetfleet_sink_answers_total{status="dead-lettered",target="demo"} 1' in text
    assert 'jetfleet_admissions_total{reason="",target="demo",verdict="admitted"} 3' in text
    # One grant per job, and one more for each job its permit sent back unrun (a fresh
    # limiter state allows no burst for its first seconds, so jobs arriving together
    # may wait for their permits: each such job is leased, released and leased again).
    unrun = worker.stats["refused:rate-limited"] + worker.stats["refused:target-held"]
    grants = 3 + unrun
    assert (
        'jetfleet_lease_answers_total{answer="granted",reason="",target="demo",worker="w-0"} '
        f"{grants}" in text
    ), text
    assert (
        'jetfleet_worker_attempts_total{identity="",outcome="permanent",reason="http-404",'
        'target="demo",version="http.get@1",worker="w-0"} 1' in text
    )
