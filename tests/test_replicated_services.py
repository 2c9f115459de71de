"""Every service replicated, no single point of failure: two processes of each service
(scheduler, leaser, ratelimit, quarantine, sink, gateway) in a ``DevStack``, and one
replica of each SIGKILLed in turn while a few hundred jobs run. Nothing is lost and
nothing is done twice, as a user would see it:

- scheduler: each job admitted once (one work order per job in ``JF_WORK``);
- leaser and sink: each job committed once (one record per job), and each page served
  once by the site (its own count): no second run;
- ratelimit: the site never saw more than its cap in any 1 s;
- quarantine: both replicas read every outcome event, and a challenge streak retires the
  identity once (one ``quarantine.set`` in the audit log), not once per replica;
- gateway: the surviving replica answers the status API.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from jetfleet.schemas import Job

from jetfleet import subjects
from jetfleet.audit import read_actions
from jetfleet.client import submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.devstack import DevStack, ScriptedTarget, WorkerSpec
from jetfleet.dev.settings_file import toml_tables
from jetfleet.ops.quarantine_view import read_quarantines
from jetfleet.ops.status import confirmed_status, fleet_status
from jetfleet.results import iter_results
from jetfleet.simulator import SimulatorConfig, most_in_any_window
from tests.conftest import wait_for
from tests.prom_text import samples

PAGES = 300
STREAK = 3
"""Challenges that retire one identity on one target (the default quarantine rule)."""
RATE, BURST = 60.0, 10
KILL_ORDER = ("scheduler", "ratelimit", "leaser", "sink", "gateway", "quarantine")
"""Quarantine last: both its replicas read the streak's events first."""


def _stack(folder: Path) -> DevStack:
    config = folder / "replicas.toml"
    config.write_text(
        toml_tables(
            {
                "fleet": {
                    "lease_ttl_s": 4.0,
                    "ack_wait_s": 8.0,
                    "retry_base_s": 0.2,
                    "retry_max_backoff_s": 1.0,
                    "hold_base_s": 0.5,
                }
            },
        )
    )
    shop = ScriptedTarget(
        SimulatorConfig(), {"rate": 10.0, "burst": 3, "max_in_flight": 8, "max_attempts": 5}
    )
    return DevStack(
        folder / "stack",
        workers=0,
        user_config=config,
        scripted_targets={"shop": shop},
        worker_specs=[
            WorkerSpec("w-0", "id-a", ("demo", "shop")),
            WorkerSpec("w-1", "id-b", ("demo",)),
        ],
        demo_table={"rate": RATE, "burst": BURST, "max_in_flight": 32, "send_jitter_s": 0.2},
        sites_on_own_loop=True,
        service_replicas=2,
    )


async def test_one_replica_of_each_service_killed_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path,
) -> None:
    async with _stack(tmp_path) as stack:
        assert stack.settings is not None
        settings = stack.settings
        assert all(
            stack.children[name].poll() is None
            for service in KILL_ORDER
            for name in stack.replicas(service)
        )
        nc = await connect_nats(settings.nats, "test-replicas")
        js = nc.jetstream()
        try:
            pages = [Job(id=f"page-{n}", url=f"/page/{n}") for n in range(PAGES)]
            streak = [Job(id=f"streak-{n}", url=f"/challenge/{n}?times=1") for n in range(STREAK)]
            await submit_jobs(js, settings, "shop", streak)
            await submit_jobs(js, settings, "demo", pages)
            jobs = PAGES + STREAK

            async def ended() -> int:
                totals = (await fleet_status(js, settings)).totals
                return totals.committed + totals.dead + totals.rejected

            async def retired() -> bool:
                view = await read_quarantines(js)
                return any(r.name == "id-a" and r.target == "shop" for r in view.records)

            # One replica of each service SIGKILLed in turn, spread over the run.
            killed = []
            for n, service in enumerate(KILL_ORDER):
                threshold = PAGES * n // (len(KILL_ORDER) + 1)

                async def reached(threshold: int = threshold) -> bool:
                    return await ended() >= threshold

                await wait_for(reached, 60, f"{threshold} jobs ended before killing {service}")
                if service == "quarantine":
                    await wait_for(retired, 60, "id-a retired on shop")
                    await wait_for(
                        lambda: _both_replicas_met_the_rule(stack), 30, "both replicas judged"
                    )
                victim = stack.replicas(service)[0]
                stack.kill(victim)
                killed.append(victim)

            # The streak's jobs finish once a worker with another identity serves shop.
            await stack.add_worker(WorkerSpec("w-2", "id-c", ("shop",)))

            async def all_ended() -> bool:
                return await ended() >= jobs

            await wait_for(all_ended, 120, f"{jobs} jobs ended")
            began = time.monotonic()
            status = await confirmed_status(js, settings)
            while status.totals.queued + status.totals.leased + status.admitting:
                assert time.monotonic() - began < 30, status.totals
                await asyncio.sleep(0.2)
                status = await confirmed_status(js, settings)
            assert not stack.dead_children(), stack.describe_dead_children()

            # Nothing lost: every job committed (the streak's on their second try).
            totals = status.totals
            assert (totals.committed, totals.dead, totals.rejected) == (jobs, 0, 0), totals
            assert status.unaccounted == 0

            # Scheduler: each job admitted once, one work order each.
            work = await js.stream_info(subjects.STREAM_WORK)
            assert work.state.last_seq == jobs, work.state

            # Leaser and sink: one record per job, and one page served per job.
            records = [r async for r in iter_results(js)]
            per_job = Counter(r.job_id for r in records)
            assert set(per_job) == {j.id for j in pages + streak}
            assert set(per_job.values()) == {1}, {j: n for j, n in per_job.items() if n > 1}
            served = stack.simulator.served_by_path()
            served.pop("/robots.txt", None)  # fetched by each worker, outside the jobs
            twice = {p: n for p, n in served.items() if n != 1}
            assert len(served) == PAGES and not twice, twice
            shop_served = stack.simulators["shop"].served_by_path()
            shop_served.pop("/robots.txt", None)
            assert {urlsplit(j.url).path for j in streak} == set(shop_served)
            assert set(shop_served.values()) == {1}, shop_served

            # Ratelimit: the cap held at the site.
            stamps = [a.at for a in stack.simulator.arrivals() if a.kind != "robots"]
            assert most_in_any_window(stamps, 1.0) <= RATE + BURST

            # Quarantine: one retirement, set once although both replicas met the rule.
            sets = [
                r.entry
                async for r in read_actions(js, None)
                if r.entry.action == "quarantine.set" and "id-a" in r.entry.what
            ]
            assert len(sets) == 1, sets
            view = await read_quarantines(js)
            assert [(r.name, r.target) for r in view.records] == [("id-a", "shop")]

            # Gateway: the replica left answers.
            gateway = stack.ready_urls[stack.replicas("gateway")[1]].removesuffix("/healthz")
            async with aiohttp.ClientSession() as http, http.get(f"{gateway}/v1/status") as got:
                assert got.status == 200
                assert (await got.json())["totals"]["committed"] == jobs
            assert killed == [stack.replicas(s)[0] for s in KILL_ORDER]
        finally:
            await nc.close()


async def _fired(url: str) -> Counter[str]:
    """A quarantine replica's rule firings by what came of them (its /metrics)."""
    async with aiohttp.ClientSession() as http, http.get(url) as got:
        text = await got.text()
    outcomes: Counter[str] = Counter()
    for (name, labels), count in samples(text).items():
        if name == "jetfleet_quarantine_fired_total":
            outcomes[dict(labels)["outcome"]] += int(count)
    return outcomes


async def _both_replicas_met_the_rule(stack: DevStack) -> bool:
    """Each quarantine replica read the streak and met the rule; one of them set the
    record, the other found it fired already."""
    each = [await _fired(stack.ready_urls[name]) for name in stack.replicas("quarantine")]
    met = [sum(c.values()) for c in each]
    if not all(met):
        return False
    assert sorted(c["set"] for c in each) == [0, 1], each
    return True
