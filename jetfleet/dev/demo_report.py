"""The showcase's final report, read from the streams and from each target's own counts.

Nothing here is the demo's own tally: jobs come from ``fleet_status`` (the streams),
dead letters from ``JF_DLQ``, versions from the outcome events, quarantines from the
leaser's records, and side effects and rates from the simulators (what the sites saw).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from urllib.parse import urlsplit

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.ops.status import FleetStatus
from jetfleet.outcome_events import read_outcomes
from jetfleet.results import iter_results
from jetfleet.schemas.browser import ExtractedValue, PageVisit
from jetfleet.schemas.events import CommittedResult
from jetfleet.schemas.report import Versions
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator, most_in_any_window
from jetfleet.stream_reader import read_stream
from jetfleet.version_tuple import tuple_id


class RateAtTarget(msgspec.Struct):
    """The most requests one target saw in any 1 s, against its cap (rate + burst)."""

    observed: int
    cap: int
    within_cap: bool


class VersionRate(msgspec.Struct):
    """Attempts of one version tuple (outcome events) and how many succeeded."""

    attempts: int
    ok: int
    success_rate: float


class QuarantineShown(msgspec.Struct):
    """One quarantine record in force at the end."""

    scope: str
    name: str
    target: str
    set_by: str
    second_order_of: str = ""


class KilledWorker(msgspec.Struct):
    """The worker SIGKILLed mid-job, and what became of the jobs it held."""

    worker: str
    jobs_held: list[str]
    """Jobs whose leases it held when it was killed (each had its request pending)."""
    committed_once: int
    """Of those, committed exactly once, by another worker."""


class SkewedWorker(msgspec.Struct):
    """The worker whose wall clock was skewed, and what it still committed."""

    worker: str
    offset: str
    applied: bool
    via: str
    measured_offset_s: float | None
    committed: int


class DemoReport(msgspec.Struct):
    """What ``jetfleet demo`` prints at the end (``--json``: this object)."""

    submitted: int
    committed: int
    dead: int
    dead_by_reason: dict[str, int]
    rejected: int
    unfinished: int
    """Jobs still queued, leased or awaiting admission when the demo stopped waiting."""
    lost: int
    """Submitted jobs in no state at all (submitted minus every state): always 0."""
    side_effects: int
    """Pages the targets served (2xx, by their own counts) for the committed jobs."""
    distinct_jobs: int
    """Distinct committed units of work (target and path) that had a side effect."""
    over_apply_ratio: float
    """side_effects / distinct_jobs: 1.00 is exactly once."""
    largest_1s_rate: dict[str, RateAtTarget]
    quarantines: list[QuarantineShown]
    second_order_retirements: int
    version_success_rates: dict[str, VersionRate]
    killed_worker: KilledWorker
    skewed_worker: SkewedWorker
    seconds: float
    jobs_per_s: float
    workers: int
    dashboard_url: str
    events: list[str]
    """What the script did, and when (seconds from the first submission)."""
    unfinished_by_target: dict[str, int]
    """Of ``unfinished``, per target (queued + leased): where to look when it is not 0."""
    browser: str = ""
    """``ran: <Chromium>`` when browser.page jobs were in the mix, else ``skipped: why``."""
    over_applied: dict[str, int] = msgspec.field(default_factory=dict)
    """Committed units of work served more than once (``target path`` -> pages served):
    where to look when ``over_apply_ratio`` is above 1."""
    browser_pages: list[PageRead] = msgspec.field(default_factory=list)
    """What the committed ``browser.page`` jobs read from their pages, by job id."""


class PageRead(msgspec.Struct):
    """One committed ``browser.page`` job: its page's title and what it extracted."""

    job_id: str
    title: str
    values: dict[str, ExtractedValue]


class Scripted(msgspec.Struct):
    """What the run did on purpose, for the report to follow up."""

    killed: str
    held_when_killed: list[str]
    skewed: SkewedWorker
    workers: int
    dashboard_url: str
    events: list[str] = []
    browser: str = ""


async def build_report(
    js: JetStreamContext,
    settings: Settings,
    status: FleetStatus,
    sites: Mapping[str, TargetSimulator],
    scripted: Scripted,
    seconds: float,
) -> DemoReport:
    """The report, from the streams, the records and the sites' own counts."""
    totals = status.totals
    results = [r async for r in iter_results(js)]
    dead = Counter(e.letter.reason for e in await list_dead_letters(js))
    side_effects, distinct = _side_effects(results, sites)
    done = totals.committed + totals.dead + totals.rejected
    per_job = Counter(r.job_id for r in results)
    committer = {r.job_id: r.worker for r in results}
    held = scripted.held_when_killed
    skewed = msgspec.structs.replace(
        scripted.skewed,
        committed=sum(1 for r in results if r.worker == scripted.skewed.worker),
    )
    return DemoReport(
        submitted=totals.submitted,
        committed=totals.committed,
        dead=totals.dead,
        dead_by_reason=dict(sorted(dead.items())),
        rejected=totals.rejected,
        unfinished=totals.queued + totals.leased + status.admitting,
        lost=status.unaccounted,
        side_effects=side_effects,
        distinct_jobs=distinct,
        over_apply_ratio=round(side_effects / distinct, 2) if distinct else 0.0,
        largest_1s_rate=_rates(settings, sites),
        quarantines=[
            QuarantineShown(r.scope, r.name, r.target, r.set_by, r.second_order_of)
            for r in status.quarantines
        ],
        second_order_retirements=status.second_order,
        version_success_rates=await _version_rates(js),
        killed_worker=KilledWorker(
            worker=scripted.killed,
            jobs_held=held,
            committed_once=sum(
                1 for j in held if per_job[j] == 1 and committer[j] != scripted.killed
            ),
        ),
        skewed_worker=skewed,
        seconds=round(seconds, 2),
        jobs_per_s=round(done / seconds, 1) if seconds > 0 else 0.0,
        workers=scripted.workers,
        dashboard_url=scripted.dashboard_url,
        events=scripted.events,
        browser=scripted.browser,
        over_applied=_over_applied(results, sites),
        browser_pages=sorted(
            (
                PageRead(r.job_id, r.output.title, r.output.values)
                for r in results
                if isinstance(r.output, PageVisit)
            ),
            key=lambda p: p.job_id,
        ),
        unfinished_by_target={
            name: t.queued + t.leased for name, t in status.targets.items() if t.queued + t.leased
        },
    )


def _side_effects(
    results: list[CommittedResult], sites: Mapping[str, TargetSimulator]
) -> tuple[int, int]:
    """Pages served for the committed units of work, and how many units had one."""
    units = {(r.target, urlsplit(r.url).path) for r in results}
    served = {name: sim.served_by_path() for name, sim in sites.items()}
    per_unit = [served.get(target, {}).get(path, 0) for target, path in units]
    return sum(per_unit), sum(1 for n in per_unit if n)


def _over_applied(
    results: list[CommittedResult], sites: Mapping[str, TargetSimulator]
) -> dict[str, int]:
    units = sorted({(r.target, urlsplit(r.url).path) for r in results})
    served = {name: sim.served_by_path() for name, sim in sites.items()}
    counts = {f"{t} {p}": served.get(t, {}).get(p, 0) for t, p in units}
    return {unit: n for unit, n in counts.items() if n > 1}


def _rates(settings: Settings, sites: Mapping[str, TargetSimulator]) -> dict[str, RateAtTarget]:
    rates = {}
    for name, sim in sites.items():
        target = settings.targets[name]
        # robots.txt is fetched outside the permits (once per worker and TTL).
        stamps = [a.at for a in sim.arrivals() if a.kind != "robots"]
        observed = most_in_any_window(stamps, 1.0)
        cap = int(target.rate) + target.burst
        rates[name] = RateAtTarget(observed, cap, observed <= cap)
    return rates


def version_name(versions: Versions) -> str:
    """A version tuple as people name it: its declared fields, else its id."""
    declared = ",".join(f"{k}={v}" for k, v in sorted(versions.declared.items()))
    return declared or tuple_id(versions)


async def _version_rates(js: JetStreamContext) -> dict[str, VersionRate]:
    attempts: Counter[str] = Counter()
    ok: Counter[str] = Counter()
    async for msg in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>"):
        for outcome in read_outcomes(msg.subject, msg.data, msg.headers):
            if isinstance(outcome, str) or not outcome.called:
                continue  # skipped, or judged without a request: says nothing of the version
            name = version_name(outcome.versions)
            attempts[name] += 1
            ok[name] += outcome.kind == "ok"
    return {
        name: VersionRate(n, ok[name], round(ok[name] / n, 3))
        for name, n in sorted(attempts.items())
    }
