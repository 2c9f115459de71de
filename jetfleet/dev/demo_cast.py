"""The showcase's cast: which targets misbehave how, which workers run, and the job mix.

``jetfleet demo`` runs this plan on a ``DevStack``. Each target is its own simulator, so
the site counts its own requests per second:

- ``demo``: fast pages, a few whose selected element was removed (``/noselector``) and
  a few that are gone (``/missing``): dead letters with their reasons.
- ``slow``: every page takes ``SLOW_LATENCY_S``; the victim worker is killed while it
  waits on some of them, so their leases expire and others commit them.
- ``storm``: from its first request on, ``STORM_S`` seconds of 429 with Retry-After.
- ``shop``: three pages challenge their first request; they all meet identity
  ``id-a`` (the only shop worker then), and the quarantine service's default rule
  (three refusals on one target) retires it on ``shop`` alone; a standby worker joins.

- ``items`` (only where a Chromium is found, ``find_chromium``): ``browser.page`` jobs
  for a browser worker, product pages read for title and price, and a few whose price
  the site removed (``?removed=1``): dead letters ``selector-removed``.

The job mix is a list of ``JobKind``; ``mix`` gives the one for this host.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jetfleet.dev.devstack import ScriptedTarget, WorkerSpec
from jetfleet.errors import ConfigError
from jetfleet.schemas import Job
from jetfleet.schemas.browser import Extract, PageSpec
from jetfleet.settings import BrowserSettings
from jetfleet.simulator import SimulatorConfig
from jetfleet.worker.browser_executable import chromium_path

SLOW_LATENCY_S = 2.0
STORM_S = 5.0
STORM_RETRY_AFTER_S = 2
STREAK = 3
"""Challenges that retire one identity on one target (the default quarantine rule)."""
CONTENT_MARK = 'id="content"'
"""What every demo page job extracts; ``/noselector`` pages lack it (selector-removed)."""

LEASE_TTL_S = 4.0
"""Short leases, so the killed worker's jobs come back within seconds, not minutes."""
ACK_WAIT_S = 6.0

BLOCKED_IDENTITY = "id-a"
SHOP = "shop"
VICTIM = "w-3"
"""The worker SIGKILLed while it holds leases on ``slow``."""
VICTIM_SLOTS = "JETFLEET_WORKER__CONCURRENCY"
SKEWED = "w-2"
"""The worker whose wall clock runs ``SKEW`` ahead (libfaketime)."""
SKEW = "+1h"
SKEW_S = 3600.0
ITEMS = "items"
"""The target of the ``browser.page`` jobs, played by a simulator of its own."""
BROWSER_WORKER = "w-5"
BROWSER_ITEMS = 8
BROWSER_REMOVED = 2
REMOVED_FROM = 1000
"""The removed-price pages' first item number: apart from the committed items', so a
removed page's visit is never counted as a second side effect of a committed job."""
PRICE_WAIT_S = 2.0
"""How long a browser job waits for ``.price``: on a removed page, until it dead-letters."""
NO_CHROMIUM = "skipped: no Chromium found (apt-get install chromium)"


def find_chromium() -> str | None:
    """The Chromium a browser worker would drive (the worker's own discovery:
    chromium, chromium-browser, google-chrome on PATH), or None."""
    try:
        return chromium_path(BrowserSettings())
    except ConfigError:
        return None


SEND_JITTER_S = 0.2
"""Every demo target's ``send_jitter_s``: six worker processes and five sites share two
cores, so a permitted request can leave up to ~0.2 s late, bunched with later ones; the
burst is cut by that much so each site still sees at most rate + burst in any 1 s."""


def demo_table() -> dict[str, object]:
    """``[targets.demo]``: a cap low enough that the limiter, not the fleet, sets the pace."""
    return {"rate": 40.0, "burst": 10, "max_in_flight": 32, "send_jitter_s": SEND_JITTER_S}


def scripted_targets(browser: bool = False) -> dict[str, ScriptedTarget]:
    """The misbehaving targets besides ``demo``, each on its own simulator (and ``items``
    for the browser jobs when ``browser``)."""
    items = {
        ITEMS: ScriptedTarget(
            SimulatorConfig(),
            {
                "rate": 5.0,
                "burst": 3,
                "max_in_flight": 4,
                "timeout_s": 20.0,
                "send_jitter_s": SEND_JITTER_S,
            },
        )
    }
    return {
        **(items if browser else {}),
        **{
            "slow": ScriptedTarget(
                SimulatorConfig(latency_s=SLOW_LATENCY_S),
                {
                    "rate": 10.0,
                    "burst": 5,
                    "max_in_flight": 24,
                    "timeout_s": 10.0,
                    "send_jitter_s": SEND_JITTER_S,
                },
            ),
            "storm": ScriptedTarget(
                SimulatorConfig(storm_s=STORM_S, storm_retry_after_s=STORM_RETRY_AFTER_S),
                # Each 429 is an attempt: enough of them to outlast the storm.
                {
                    "rate": 20.0,
                    "burst": 5,
                    "max_in_flight": 16,
                    "max_attempts": 10,
                    "send_jitter_s": SEND_JITTER_S,
                },
            ),
            SHOP: ScriptedTarget(
                SimulatorConfig(),
                {
                    "rate": 10.0,
                    "burst": 3,
                    "max_in_flight": 8,
                    "max_attempts": 5,
                    "send_jitter_s": SEND_JITTER_S,
                },
            ),
        },
    }


def fleet_table() -> dict[str, object]:
    """``[fleet]`` for the demo: short leases and back-offs, so it ends in seconds."""
    return {
        "lease_ttl_s": LEASE_TTL_S,
        "ack_wait_s": ACK_WAIT_S,
        "retry_base_s": 0.2,
        "retry_max_backoff_s": 1.0,
        "hold_base_s": 0.5,
    }


def cast(skew_env: Mapping[str, str]) -> list[WorkerSpec]:
    """The workers started with the stack (two version releases, so the report has a
    success rate per version). ``skew_env`` is what skews ``SKEWED``'s clock ({} when
    no way to skew it was found)."""

    def release(name: str) -> dict[str, str]:
        return {"JETFLEET_WORKER__VERSION_FIELDS": f"release={name}"}

    return [
        WorkerSpec("w-0", BLOCKED_IDENTITY, ("demo", "storm", SHOP), release("1.4")),
        WorkerSpec("w-1", "id-b", ("demo", "storm", "slow"), release("1.4")),
        WorkerSpec(SKEWED, "id-c", ("demo", "storm"), {**release("1.5"), **skew_env}),
        # Three slots: its leases start within a few permits of each other, so there
        # are moments when all its requests wait at the site and none is answered, the
        # only moment a kill can land mid-job without a page served twice. With eight,
        # on a busy machine one was always just answered and the victim died holding none.
        WorkerSpec(VICTIM, "id-d", ("slow",), {**release("1.5"), VICTIM_SLOTS: "3"}),
    ]


def browser_worker(executable: str, profiles_dir: str) -> WorkerSpec:
    """The worker that runs the ``browser.page`` jobs, its Chromium ``executable`` and its
    profiles in ``profiles_dir`` (the demo's throwaway folder)."""
    return WorkerSpec(
        BROWSER_WORKER,
        "id-f",
        (ITEMS,),
        {
            "JETFLEET_WORKER__VERSION_FIELDS": "release=1.5",
            "JETFLEET_WORKER__BROWSER__ENABLED": "true",
            "JETFLEET_WORKER__BROWSER__EXECUTABLE": executable,
            "JETFLEET_WORKER__BROWSER__PROFILES_DIR": profiles_dir,
        },
    )


def standby() -> WorkerSpec:
    """The worker that joins for ``shop`` once ``id-a`` is retired there."""
    return WorkerSpec(
        "w-4", "id-e", (SHOP, "demo"), {"JETFLEET_WORKER__VERSION_FIELDS": "release=1.5"}
    )


@dataclass(frozen=True)
class JobKind:
    """One kind of job in the mix.

    Attributes:
        name: What it shows, e.g. ``removed-selector``.
        target: The target it is submitted to.
        path: Its path, ``{n}`` the job's number within the kind.
        share: Its part of ``--jobs``; ``fixed`` instead gives an exact count.
        least: The fewest of it (so a small ``--jobs`` still shows it).
        fixed: An exact count, whatever ``--jobs`` is (0: use ``share``).
        first: The ``{n}`` of its first job.
        args: The job's handler arguments.
        handler: The handler that runs it.
        page: A ``browser.page`` job's page spec.
        ends: What it should end as (``committed`` or ``dead:<reason>``), for the docs
            and the report's expectations.
    """

    name: str
    target: str
    path: str
    share: float = 0.0
    least: int = 1
    fixed: int = 0
    first: int = 0
    args: Mapping[str, str] = field(default_factory=dict)
    handler: str = "http.get"
    page: PageSpec | None = None
    ends: str = "committed"


EXTRACT = {"expect": CONTENT_MARK}

MIX: tuple[JobKind, ...] = (
    JobKind("challenge-streak", SHOP, "/challenge/{n}?times=1", fixed=STREAK),
    JobKind("shop-page", SHOP, "/page/{n}", share=0.03, least=2),
    JobKind("storm-page", "storm", "/page/{n}", share=0.10, least=3),
    JobKind("slow-page", "slow", "/page/{n}", share=0.08, least=4),
    JobKind(
        "removed-selector",
        "demo",
        "/noselector/{n}",
        share=0.02,
        args=EXTRACT,
        ends="dead:selector-removed",
    ),
    JobKind("gone-page", "demo", "/missing/{n}", share=0.01, ends="dead:http-404"),
)
"""Every kind but the plain demo pages (which take the rest of ``--jobs``) and the
browser ones."""

ITEM_PAGE = PageSpec(
    wait_for=".price",
    wait_timeout_s=PRICE_WAIT_S,
    extract={"title": Extract("h1.title"), "price": Extract(".price")},
)

BROWSER_MIX: tuple[JobKind, ...] = (
    JobKind(
        "browser-item",
        ITEMS,
        "/shop/item/{n}",
        fixed=BROWSER_ITEMS,
        handler="browser.page",
        page=ITEM_PAGE,
    ),
    JobKind(
        "browser-removed",
        ITEMS,
        "/shop/item/{n}?removed=1",
        fixed=BROWSER_REMOVED,
        first=REMOVED_FROM,
        handler="browser.page",
        page=ITEM_PAGE,
        ends="dead:selector-removed",
    ),
)
"""The ``browser.page`` jobs, in the mix only where a Chromium is found."""


def mix(browser: bool) -> tuple[JobKind, ...]:
    """The kinds besides the plain pages: ``MIX``, and ``BROWSER_MIX`` when ``browser``."""
    return MIX + BROWSER_MIX if browser else MIX


PAGE = JobKind("page", "demo", "/page/{n}", args=EXTRACT)


def counts(total: int, mix: Sequence[JobKind] = MIX) -> list[tuple[JobKind, int]]:
    """How many of each kind ``total`` jobs hold; plain pages take what is left.

    Raises:
        ValueError: ``total`` is too small to hold one of every kind and a page.
    """
    wanted = [(k, k.fixed or max(k.least, int(total * k.share))) for k in mix]
    rest = total - sum(n for _, n in wanted)
    if rest < 1:
        raise ValueError(f"--jobs must be at least {least_jobs(mix)} (one of every kind)")
    return [*wanted, (PAGE, rest)]


def least_jobs(mix: Sequence[JobKind] = MIX) -> int:
    """The smallest ``--jobs`` that holds every kind."""
    return sum(k.fixed or k.least for k in mix) + 1


def jobs_of(kind: JobKind, count: int) -> list[Job]:
    """``count`` jobs of ``kind``, with ids that say what they are."""
    return [
        Job(
            id=f"{kind.name}-{n}",
            url=kind.path.format(n=n),
            handler=kind.handler,
            args=dict(kind.args),
            page=kind.page,
        )
        for n in range(kind.first, kind.first + count)
    ]


def by_target(total: int, browser: bool = False) -> dict[str, list[Job]]:
    """The whole mix of ``total`` jobs (with the browser kinds when ``browser``), grouped
    by target, streak first."""
    grouped: dict[str, list[Job]] = {}
    for kind, count in counts(total, mix(browser)):
        grouped.setdefault(kind.target, []).extend(jobs_of(kind, count))
    return grouped


def every_target() -> tuple[str, ...]:
    """The targets the demo submits to, ``demo`` first."""
    return tuple(dict.fromkeys(itertools.chain(["demo"], (k.target for k in MIX))))
