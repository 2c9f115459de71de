"""``jetfleet demo``: the showcase. A throwaway local fleet meets targets that misbehave
(slow pages, a 429 storm, a challenge streak, removed selectors), loses a worker to
SIGKILL mid-job and runs one with its clock an hour off, then reports what the streams
and the sites themselves say happened (``jetfleet.dev.demo_cast`` is the script)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.cli.progress import ProgressBar, print_json, print_table
from jetfleet.client import submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev import demo_cast
from jetfleet.dev.clock_skew import ClockSkew, clock_skew, measured_offset_s
from jetfleet.dev.demo_report import DemoReport, Scripted, SkewedWorker, build_report
from jetfleet.dev.devstack import DevStack, WorkerSpec
from jetfleet.dev.settings_file import toml_tables
from jetfleet.errors import JetfleetError
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.quarantine_view import read_quarantines
from jetfleet.ops.status import FleetStatus, confirmed_status, fleet_status
from jetfleet.outcome_events import OK_HOLD_S
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare

POLL_S = 0.1
WATCH_S = 0.5
"""How often the fleet's status and the quarantine records are read. The sites run in
this process: reading less often keeps its event loop free, so each arrival is stamped
when it comes, not bunched after a long read (which would show bursts no sender made)."""
KILL_WAIT_S = 30.0
"""How long the demo waits for the victim to hold leases whose requests are pending."""
KILL_HOLDING = 3
KILL_PREFER_S = 4.0
"""How long the demo waits for the victim to hold ``KILL_HOLDING`` leases before it
settles for fewer."""
RETIREMENT_WAIT_S = 60.0
SETTLE_S = 10.0
"""How long the demo waits, once every job has ended, for the last acks to land."""


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only if nothing was lost and every job reached an end."""
    chromium = demo_cast.find_chromium()
    least = demo_cast.least_jobs(demo_cast.mix(chromium is not None))
    if args.jobs < least:
        raise JetfleetError(f"--jobs must be at least {least} (one job of every kind)")
    from jetfleet.cli.run_commands import temp_stack_dir

    folder = temp_stack_dir()
    try:
        demo = _Demo(folder, args.jobs, args.timeout, quiet=args.json, chromium=chromium)
        report = asyncio.run(demo.run())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print_json(report)
    else:
        print_report(report)
    return 0 if report.lost == 0 and report.unfinished == 0 else 1


class _Demo:
    def __init__(
        self, folder: Path, jobs: int, timeout_s: float, quiet: bool, chromium: str | None
    ) -> None:
        self.folder = folder
        self.jobs = jobs
        self.timeout_s = timeout_s
        self.quiet = quiet
        self.skew: ClockSkew = clock_skew(demo_cast.SKEW)
        self.cast = demo_cast.cast(self.skew.env)
        self.chromium = chromium
        """The Chromium the browser worker drives; None: the browser part is skipped."""
        if chromium is not None:
            profiles = str(folder / "browser-profiles")
            self.cast.append(demo_cast.browser_worker(chromium, profiles))
        self.events: list[str] = []
        self.started = 0.0
        self.held_when_killed: list[str] = []
        self.paths: dict[str, str] = {}
        """Each submitted job's path, to match a lease to its request at the site."""

    def say(self, event: str) -> None:
        since = time.monotonic() - self.started if self.started else 0.0
        self.events.append(f"+{since:.1f} s {event}")

    async def run(self) -> DemoReport:
        config = self.folder / "demo.toml"
        config.write_text(toml_tables({"fleet": demo_cast.fleet_table()}))
        stack = DevStack(
            self.folder / "stack",
            workers=0,
            user_config=config,
            scripted_targets=demo_cast.scripted_targets(browser=self.chromium is not None),
            worker_specs=self.cast,
            demo_table=demo_cast.demo_table(),
            # The sites' 1 s counts are the report's rate check: stamped on their own loop,
            # not when this one, reading status and streams, gets round to them.
            sites_on_own_loop=True,
        )
        async with stack:
            assert stack.settings is not None
            self.stack = stack
            self.sites: dict[str, TargetSimulator] = {"demo": stack.simulator, **stack.simulators}
            if not self.quiet:
                self._introduce()
            nc = await connect_nats(stack.settings.nats, "jetfleet-demo", role="admin")
            try:
                js = nc.jetstream()
                await declare(js, stack.settings)
                return await self._play(js)
            finally:
                await nc.close()

    def _introduce(self) -> None:
        print(f"dashboard: {self.stack.gateway_url}/", flush=True)
        for name, sim in self.sites.items():
            print(f"target {name}: {sim.base_url}", flush=True)
        workers = ", ".join(f"{w.id} ({w.identity}: {','.join(w.targets)})" for w in self.cast)
        print(f"workers: {workers}", flush=True)
        if not self.skew.applied:
            print(f"clock skew of {demo_cast.SKEWED}: {self.skew.via}", flush=True)

    async def _play(self, js: JetStreamContext) -> DemoReport:
        assert self.stack.settings is not None
        settings = self.stack.settings
        # Time the fleet, not the workers' start-up: wait until every worker pulls.
        await _workers_pulling(js, self.cast, deadline=time.monotonic() + 60)
        started = self.started = time.monotonic()
        mix = demo_cast.by_target(self.jobs, browser=self.chromium is not None)
        for target, batch in mix.items():
            self.paths.update((job.id, urlsplit(job.url).path) for job in batch)
            await submit_jobs(js, settings, target, batch)
        self.say(f"{self.jobs} jobs submitted")
        scripts = [
            asyncio.create_task(self._kill_mid_job(js)),
            asyncio.create_task(self._standby_after_retirement(js)),
        ]
        try:
            full = await self._watch(js, started)
        finally:
            for task in scripts:
                task.cancel()
            await asyncio.gather(*scripts, return_exceptions=True)
        elapsed = time.monotonic() - started
        if self.stack.dead_children():
            raise JetfleetError(self.stack.describe_dead_children())
        full = await _settled(js, settings, full)
        return await build_report(js, settings, full, self.sites, self._scripted(), elapsed)

    async def _watch(self, js: JetStreamContext, started: float) -> FleetStatus:
        assert self.stack.settings is not None
        bar = ProgressBar(self.jobs, "jobs", enabled=False if self.quiet else None)
        deadline = started + self.timeout_s
        while True:
            full = await fleet_status(js, self.stack.settings)
            status = full.totals
            done = status.committed + status.dead + status.rejected
            bar.update(done, f"committed {status.committed} dead {status.dead} | {self.events[-1]}")
            if done >= self.jobs or time.monotonic() > deadline or self.stack.dead_children():
                bar.close()
                return full
            await asyncio.sleep(WATCH_S)

    async def _kill_mid_job(self, js: JetStreamContext) -> None:
        """SIGKILL the victim once it holds leases mid-job (``_mid_job``), preferring
        several at once; its leases then expire by the server's clock and others commit
        the jobs."""
        store = await LeaseStore.open(js)
        site = self.sites["slow"]
        deadline = time.monotonic() + KILL_WAIT_S
        held: list[str] = []
        first_chance = 0.0
        while time.monotonic() < deadline:
            held = [
                x.record.job_id
                for x in await store.all_live()
                if x.record.worker == demo_cast.VICTIM
            ]
            if held and _mid_job(held, self.paths, site):
                first_chance = first_chance or time.monotonic()
                # Several leases at once shows more; one will do after a while.
                if len(held) >= KILL_HOLDING or time.monotonic() - first_chance > KILL_PREFER_S:
                    break
            await asyncio.sleep(POLL_S)
        self.stack.kill(f"worker-{demo_cast.VICTIM}")
        self.held_when_killed = sorted(held)
        self.say(f"{demo_cast.VICTIM} killed holding {len(held)} leases")

    async def _standby_after_retirement(self, js: JetStreamContext) -> None:
        """Once the streak retires the blocked identity on the shop, a standby worker
        joins for the shop (the retired one keeps its other targets)."""
        deadline = time.monotonic() + RETIREMENT_WAIT_S
        while time.monotonic() < deadline:
            view = await read_quarantines(js)
            if any(
                r.scope == "identity"
                and r.name == demo_cast.BLOCKED_IDENTITY
                and r.target == demo_cast.SHOP
                for r in view.records
            ):
                self.say(f"{demo_cast.BLOCKED_IDENTITY} retired on {demo_cast.SHOP}")
                spec = demo_cast.standby()
                await self.stack.add_worker(spec)
                self.say(f"{spec.id} joined for {demo_cast.SHOP}")
                return
            await asyncio.sleep(WATCH_S)
        self.say(f"no retirement on {demo_cast.SHOP} within {RETIREMENT_WAIT_S:g} s")

    def _scripted(self) -> Scripted:
        skewed = SkewedWorker(
            worker=demo_cast.SKEWED,
            offset=demo_cast.SKEW,
            applied=self.skew.applied,
            via=self.skew.via,
            measured_offset_s=_rounded(measured_offset_s(self.skew)),
            committed=0,
        )
        return Scripted(
            killed=demo_cast.VICTIM,
            held_when_killed=self.held_when_killed,
            skewed=skewed,
            workers=len(self.stack.children) - len(_service_children(self.stack.children)),
            events=self.events,
            dashboard_url=self.stack.gateway_url + "/",
            browser=f"ran: {self.chromium}" if self.chromium else demo_cast.NO_CHROMIUM,
        )


async def _settled(js: JetStreamContext, settings: Settings, full: FleetStatus) -> FleetStatus:
    """Read again until the counts add up and no ended job is still counted as queued or
    leased (its ack is on its way as its commit is already counted), or until
    ``SETTLE_S`` has passed: then what is left is reported as it is."""
    deadline = time.monotonic() + SETTLE_S
    while not full.conserved or _open(full):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_S)
        full = await confirmed_status(js, settings)
    await _outcomes_quiet(js, deadline)
    return full


async def _outcomes_quiet(js: JetStreamContext, deadline: float) -> None:
    """Wait until no outcome event has been stored for longer than a worker holds its
    ok events for a batch (OK_HOLD_S), so the report's version rates count every
    attempt, or until ``deadline``."""
    last = (await js.stream_info(subjects.STREAM_OUTCOMES)).state.last_seq
    while time.monotonic() < deadline:
        await asyncio.sleep(max(POLL_S, 2 * OK_HOLD_S))
        now = (await js.stream_info(subjects.STREAM_OUTCOMES)).state.last_seq
        if now == last:
            return
        last = now


def _open(full: FleetStatus) -> int:
    return full.totals.queued + full.totals.leased + full.admitting


def _mid_job(held: list[str], paths: Mapping[str, str], site: TargetSimulator) -> bool:
    """Whether killing the victim now lands mid-job: at least one held job's request is
    waiting at the site, and none has been answered yet (an answered one may be about to
    commit; the site would have served it once, and would again for the next holder). A
    held job neither pending nor served is waiting for its permit: nothing sent yet."""
    now = time.monotonic()
    # Requests with time left to run, so none is answered between the look and the kill.
    waiting = {
        p.path
        for p in site.pending()
        if p.client == demo_cast.VICTIM and now - p.began < demo_cast.SLOW_LATENCY_S - 0.5
    }
    served = site.served_by_path()
    mine = [paths.get(job, "") for job in held]
    return any(path in waiting for path in mine) and not any(path in served for path in mine)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value)


def _service_children(children: Mapping[str, object]) -> list[str]:
    return [name for name in children if not name.startswith("worker-")]


async def _workers_pulling(js: JetStreamContext, cast: list[WorkerSpec], deadline: float) -> None:
    """Wait until every target's consumer has as many pulls waiting as the cast has
    workers for it."""
    wanted: dict[str, int] = {}
    for spec in cast:
        for target in spec.targets:
            wanted[target] = wanted.get(target, 0) + 1
    while time.monotonic() < deadline:
        waiting = {
            t: (
                await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer(t, "normal"))
            ).num_waiting
            or 0
            for t in wanted
        }
        if all(waiting[t] >= n for t, n in wanted.items()):
            return
        await asyncio.sleep(POLL_S)
    raise JetfleetError(f"the {len(cast)} demo workers did not start pulling within 60 s")


def print_report(report: DemoReport) -> None:
    """The report as people read it: totals, then what each misbehaviour came to."""
    print()
    print_table(
        ["submitted", "committed", "dead", "rejected", "unfinished", "lost", "seconds"],
        [
            [
                report.submitted,
                report.committed,
                report.dead,
                report.rejected,
                report.unfinished,
                report.lost,
                f"{report.seconds:.1f}",
            ]
        ],
    )
    print()
    dead = ", ".join(f"{r} {n}" for r, n in report.dead_by_reason.items()) or "none"
    print(f"dead by reason: {dead}")
    print(
        f"side effects {report.side_effects} over {report.distinct_jobs} distinct jobs: "
        f"over-apply ratio {report.over_apply_ratio:.2f} (1.00 = exactly once)"
    )
    print()
    print_table(
        ["target", "largest 1 s", "cap", "within"],
        [
            [name, r.observed, r.cap, "yes" if r.within_cap else "NO"]
            for name, r in report.largest_1s_rate.items()
        ],
    )
    print()
    print_table(
        ["version", "attempts", "ok", "success"],
        [
            [name, v.attempts, v.ok, f"{v.success_rate:.1%}"]
            for name, v in report.version_success_rates.items()
        ],
    )
    print()
    shown = [f"{q.scope} {q.name} on {q.target} (by {q.set_by})" for q in report.quarantines]
    print(f"quarantines: {'; '.join(shown) or 'none'}")
    print(f"second-order retirements: {report.second_order_retirements}")
    killed = report.killed_worker
    print(
        f"killed {killed.worker} holding {len(killed.jobs_held)} leases: "
        f"{killed.committed_once} of them committed once by others"
    )
    skew = report.skewed_worker
    if skew.applied:
        print(
            f"{skew.worker}'s clock {skew.offset} (measured {skew.measured_offset_s} s, "
            f"{skew.via}): {skew.committed} committed"
        )
    else:
        print(f"{skew.worker}'s clock skew {skew.via}")
    read = report.browser_pages
    shown_read = f"; {len(read)} pages read, e.g. {read[0].title}: {read[0].values}" if read else ""
    print(f"browser: {report.browser}{shown_read}")
    print(f"dashboard was at {report.dashboard_url}")
    print()
    for event in report.events:
        print(event)
