"""Typed, frozen settings, built once from ``jetfleet.toml`` and the environment.

Sources, later ones winning: defaults, the TOML file (``--config`` or ``JETFLEET_CONFIG``),
then the environment: ``NATS_URL``, ``REDIS_URL`` and ``JETFLEET_<SECTION>__<KEY>`` (for
example ``JETFLEET_FLEET__DEDUPE_TTL_S=86400``). Every error names the key and the fix.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from jetfleet.activity_window import WindowError, window_of
from jetfleet.errors import ConfigError
from jetfleet.event_loop import EventLoopChoice
from jetfleet.redis_url import parse_redis_url
from jetfleet.subjects import TARGET_NAME_RE

_T = TypeVar("_T")

DEFAULT_USER_AGENT = "jetfleet/0.1 (+set fleet.user_agent to your contact address)"


class TargetSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One site the fleet may send work to."""

    base_url: str
    rate: float = 1.0
    """Fleet-wide requests per second to this target, whatever the number of workers,
    retries or requeues: every request takes a permit from the ``ratelimit`` service
    (docs/rate-limits.md). A robots.txt Crawl-delay lowers it; ``jetfleet target set``
    changes it at run time."""
    burst: int = 1
    """How many requests may go at once after an idle spell."""
    send_jitter_s: float = 0.0
    """Allowance for the time between a permit and its request reaching the target,
    which varies on a loaded worker: the target's burst tolerance is cut by this much,
    so requests permitted up to ``send_jitter_s`` apart still arrive within ``rate`` x W
    + ``burst`` in any window of W seconds. It only cuts the burst (with ``burst`` 1
    there is nothing to cut: lower ``rate`` instead); 0: none (docs/rate-limits.md)."""
    daily: int = 0
    """Requests per UTC day (Redis's clock); 0: no daily budget."""
    egress_rate: float = 0.0
    """Requests per second from one egress (``worker.egress``) to this target; 0: none."""
    egress_burst: int = 1
    identity_rate: float = 0.0
    """Requests per second from one identity to this target; 0: none."""
    identity_burst: int = 1
    max_in_flight: int = 16
    """Cap on jobs of this target leased at once across the fleet, its priority tiers
    together: the leaser takes a place in Redis for each grant (docs/rate-limits.md)."""
    max_attempts: int = 3
    timeout_s: float = 30.0
    max_body_bytes: int = 5_000_000
    max_retry_after_s: float = 300.0
    """The longest wait a Retry-After may impose on a job and on this worker's use of the
    target. A longer ask is cut to this and shown as a target hold on ``/metrics``."""
    user_agent: str = ""
    obey_robots: bool = True
    """Fetch, cache and obey this target's robots.txt (Protego), Crawl-delay included."""
    robots_off_reason: str = ""
    """Why robots.txt is not obeyed; required (and logged) when ``obey_robots`` is false."""
    redirect_hosts: tuple[str, ...] = ()
    """Hosts (``host`` or ``host:port``) beyond ``base_url`` that ``http.get`` may follow
    a redirect to; a redirect anywhere else fails the job as ``redirect-off-target``."""
    max_age_s: float = 0.0
    """How old (by the NATS server's clock, from when its work order was stored) a job of
    this target may grow before it is dead-lettered ``expired`` instead of run; 0 takes
    ``fleet.max_job_age_s``."""
    active_hours: tuple[str, ...] = ()
    """Local times the target may be sent work in (``"08:00-18:00"``, ``"22:00-02:00"``
    crosses midnight; HH:MM or HH:MM:SS); empty with ``active_days`` empty: always.
    Outside them the leaser grants nothing (``outside-window``); jobs wait, unspent."""
    active_days: tuple[str, ...] = ()
    """Days (``mon`` ... ``sun``) the spans start on; empty: every day."""
    timezone: str = ""
    """The IANA zone of ``active_hours`` (``Europe/Lisbon``); empty: UTC."""


class IdentitySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One identity a worker may own: its session state and where its traffic leaves
    from (docs/identities.md). At most one running worker owns it at a time."""

    state_dir: str = ""
    """Folder the identity's cookie jar is kept in between runs; empty keeps it in the
    worker's memory only. It never leaves the worker."""
    egress: str = ""
    """The egress label its requests leave by (``worker.egress``, which must agree)."""
    subnet: str = ""
    """The egress's network, such as ``10.1.0.0/24``."""
    region: str = ""
    """The region it belongs to: only a worker of this region (``worker.region``) may own
    it."""


class NatsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where NATS is and how to keep the connection honest."""

    url: str = "nats://127.0.0.1:4222"
    connect_timeout_s: float = 5.0
    # nats-py pings every 120 s by default: a dead server would go unnoticed for minutes.
    ping_interval_s: float = 10.0
    replicas: int = 1
    """Replicas of every stream, consumer and bucket: 3 on a 3-node cluster in production
    (docs/cluster.md); services warn at start below that."""
    monitor_url: str = ""
    """Each server's monitoring endpoint (its ``http:`` port), comma-separated, such as
    ``http://nats-1:8222``: where the start-up check and ``jetfleet doctor`` read whether
    the servers sync every write (``/varz``). Empty: the sync is not checked."""
    dev: bool = False
    """Written by ``jetfleet dev`` and ``demo`` into the configuration they generate: the
    server is their embedded one, so the start-up durability check says "dev" in one
    quiet line instead of warning."""
    credentials: str = ""
    """One role's credentials file, or the folder ``jetfleet auth init`` wrote (each process
    then reads its own role's file); empty: connect without credentials (docs/security.md)."""


class RedisSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the shared rate-limit state lives."""

    url: str = "redis://127.0.0.1:6379/0"
    """One server (``redis://host:port/db``), a Redis Cluster
    (``redis+cluster://host:port,host:port``) or a Sentinel-watched master
    (``redis+sentinel://host:port,host:port/SERVICE``); jetfleet/redis_url.py."""


MAX_LONG_POLL_S = 2.0
"""The longest ``fleet.long_poll_s``: a worker's drain takes it, 1 s, 30 s for jobs and 1 s
for records, inside ``jetfleet dev``'s 35 s before a kill and the deploy's grace."""


class FleetSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Queue and commit policy shared by every service."""

    max_job_bytes: int = 64 * 1024
    max_inline_bytes: int = 256 * 1024
    """Largest body (as JSON text) a result carries inside its message; a larger one is
    kept in the ``jf-result-objects`` object store and referenced. Checked at worker start
    against the server's max_payload."""
    ack_wait_s: float = 60.0
    """Visibility timeout: JetStream redelivers an unacked job after this long."""
    lease_ttl_s: float = 30.0
    retry_base_s: float = 1.0
    retry_max_backoff_s: float = 60.0
    dedupe_ttl_s: float = 7 * 24 * 3600.0
    """How long an idempotency key is remembered after its commit."""
    retention_s: float = 7 * 24 * 3600.0
    """How long submissions, results, rejections and dead letters are kept."""
    user_agent: str = DEFAULT_USER_AGENT
    leases: bool = True
    """Lease every job and fence every commit. False is the foundation's unfenced direct
    path, kept only as a benchmark baseline: never run production without leases."""
    handlers: tuple[str, ...] = ()
    """Names of user handlers (beyond http.get, browser.page and noop) that jobs may ask for."""
    dedicated_targets: int = 100
    """How many targets get consumers of their own (the first ones declared). Targets
    beyond this count share ``target_partitions`` hashed partitions (docs/topology.md)."""
    target_partitions: int = 16
    """How many partitions the targets beyond ``dedicated_targets`` are hashed into."""
    service_concurrency: int = 512
    """Requests each leaser or sink replica handles at once; one more is answered ``busy``
    with a retry-after (workers back off), so an overloaded or just-resumed replica sheds
    load instead of queueing it."""
    max_request_bytes: int = 64 * 1024
    """The largest lease call or quarantine command a leaser reads; a larger one is
    refused unread (``request-too-large``). A sink report is bounded by the server's
    max_payload, the size a worker keeps its reports under."""
    max_deliver: int = 1000
    """The work consumers' ``max_deliver``: the server's backstop. A job delivered this
    many times without ending (pinned to an identity no worker has, handed back for
    ever) is no longer delivered, and the sink dead-letters it (docs/commit.md)."""
    rate: float = 0.0
    """Fleet aggregate: requests per second over every target together; 0: no
    aggregate cap (each target's own still holds)."""
    burst: int = 1
    """The aggregate cap's burst."""
    hold_base_s: float = 1.0
    """A target's first fleet-wide hold after a 429/503 without Retry-After; doubles with
    each such answer in a row (jittered), up to the target's ``max_retry_after_s``."""
    hold_forgive_s: float = 60.0
    """Quiet seconds after which a target's backoff streak is forgiven."""
    robots_ttl_s: float = 3600.0
    """How long a fetched robots.txt is used before it is fetched again (RFC 9309 asks
    for at most a day)."""
    robots_error_hold_s: float = 60.0
    """After a robots.txt fetch failed or answered 5xx, the target is held (nothing is
    requested, jobs wait) this long before robots.txt is tried again."""
    max_job_age_s: float = 7 * 24 * 3600.0
    """How old a job may grow (server clock, from when its work order was stored) before
    it is dead-lettered ``expired`` instead of run; a target's ``max_age_s`` overrides."""
    avoid_s: float = 600.0
    """How long a job is kept from a worker or identity its target challenged or blocked
    it on, or that was quarantined while it ran the job (server clock; the job's avoid
    list, docs/leases.md#the-avoid-list); 0: no avoid list."""
    audit_max_age_s: float = 365 * 24 * 3600.0
    """How long ``JF_AUDIT`` keeps control actions (docs/audit.md); at least a day."""
    long_poll_s: float = 1.0
    """How long an idle pull request (a worker's lane, the scheduler, the quarantine
    service, the sink's backstop) waits at the server for a message. Their drains wait
    out the one in hand (a worker hands back what it delivers): shorter stops sooner,
    longer sends fewer idle requests. At most MAX_LONG_POLL_S: it adds to every drain."""


class GatewaySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = 8080
    token: str = ""
    """Bearer token for state-changing calls; empty allows them only on a loopback bind."""
    open_reads: bool = False
    """With a token set, whether the reads beyond health (``/v1/status``, ``/metrics``) are
    open to anyone (true) or need the token as well (false, the default)."""
    max_concurrent: int = 64
    """Requests served at once; one more is answered 503 with Retry-After."""
    request_timeout_s: float = 10.0
    """Longest a request may run before it is answered 504."""


class BrowserSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``browser.page`` handler of a worker: headless Chromium through Playwright
    (docs/browser.md)."""

    enabled: bool = False
    """Whether this worker runs ``browser.page`` jobs (a worker without it hands them
    back for one that has). Enabled, a worker refuses to start without a Chromium."""
    executable: str = ""
    """The Chromium to drive (such as ``/usr/bin/chromium``); empty: the first of
    ``chromium``, ``chromium-browser``, ``google-chrome`` on PATH."""
    profiles_dir: str = "~/.local/share/jetfleet/browser-profiles"
    """The worker's own folder of browser profiles: each identity's persistent profile is
    ``<profiles_dir>/<worker id>/<identity>``, and never leaves this host."""
    max_contexts: int = 2
    """Browser contexts (one per identity, each a Chromium process) kept open at once;
    the least recently used idle one is closed beyond it."""
    max_screenshot_bytes: int = 2_000_000
    """The largest screenshot kept as a result attachment; a larger one fails the job
    ``result-too-large``."""
    wait_timeout_s: float = 10.0
    """How long a job's ``wait_for`` selector is waited for when the job sets no
    ``wait_timeout_s`` (always within the attempt's own time budget)."""


class WorkerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One worker process."""

    id: str = ""
    identity: str = ""
    region: str = ""
    egress: str = ""
    """The egress (network exit) this worker's requests leave by: the key of each
    target's ``egress_rate``."""
    subnet: str = ""
    """The network its requests leave from (such as ``10.1.0.0/24``); filled from the
    identity's ``subnet`` when empty. No two workers of one subnet serve a target at once,
    and an egress quarantine is on a (subnet, target)."""
    concurrency: int = 8
    """Jobs at once per work lane: per target with consumers of its own, per partition for
    the others (each lane has its own slots, so a target that hangs cannot take another
    lane's), shared by the priority tiers. A lane whose targets all refuse this worker for
    a target-wide reason lends its slots to the others until its hold ends
    (jetfleet/worker/slot_lending.py)."""
    targets: tuple[str, ...] = ()
    """Targets this worker pulls from; empty means every declared target."""
    standby_targets: tuple[str, ...] = ()
    """Targets this worker pulls only with slots its held lanes lend (none of its own):
    a backlog it helps with while its own targets refuse it."""
    tier_shares: dict[str, float] = msgspec.field(
        default_factory=lambda: {"high": 0.5, "normal": 0.3, "bulk": 0.2}
    )
    """Each priority tier's guaranteed share of the worker's slots (idle ones are lent)."""
    claim_ttl_s: float = 30.0
    """How long this worker's claim on its identity lasts unrenewed, by the NATS server's
    clock (whole seconds); it is renewed every third of it. A worker that crashed frees
    its identity this long after its last renewal; one that drains frees it at once."""
    report_patience_s: float = 600.0
    """How long a finished job's report is sent again while the sink is busy, silent or
    absent (its lease, slot and pending place kept all along) before the worker gives up:
    it releases the lease with a refund and naks the job with backoff, to run again."""
    version_fields: dict[str, str] = {}
    """Operator-declared fields of this worker's version tuple (such as a deployment or
    image tag): part of the tuple and its id (docs/versions.md). Keys are lowercase
    names; from the environment, ``JETFLEET_WORKER__VERSION_FIELDS="image=v42,ring=canary"``."""
    browser: BrowserSettings = BrowserSettings()
    """``[worker.browser]``: the ``browser.page`` handler (off by default)."""


QUARANTINE_REASONS = ("challenged", "blocked", "rate-limited")
"""The outcome reasons a quarantine rule may count: a ``blocked`` outcome's kinds."""
QuarantineAction = Literal["retire", "cool"]
QuarantineRuleScope = Literal["identity", "worker"]
ACTION_SCOPES: dict[str, str] = {"retire": "identity", "cool": "worker"}
"""Each action's scope: an identity is retired, a worker is cooled off."""


class QuarantineRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One rule of the quarantine service: ``count`` outcomes with a reason in ``on``,
    from one scope on one target, within ``window_s`` seconds by the NATS server's clock,
    set a quarantine record on (scope, target) lasting ``for_s`` (docs/quarantine.md)."""

    on: str | tuple[str, ...]
    """An outcome reason (``challenged``, ``blocked``, ``rate-limited``) or a list of them."""
    scope: QuarantineRuleScope
    count: int
    window_s: float
    action: QuarantineAction
    for_s: float
    name: str = ""
    """What records and logs call the rule; empty: made from its fields."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """The outcome reasons it counts."""
        return (self.on,) if isinstance(self.on, str) else self.on

    @property
    def label(self) -> str:
        """Its name, or one made from what it counts."""
        if self.name:
            return self.name
        return f"{self.action}-{'-'.join(self.reasons)}-{self.count}-in-{self.window_s:g}s"


DEFAULT_QUARANTINE_RULES = (
    QuarantineRule(
        name="cool-after-block",
        on="blocked",
        scope="worker",
        count=1,
        window_s=60.0,
        action="cool",
        for_s=300.0,
    ),
    QuarantineRule(
        name="retire-after-3-refusals",
        on=("challenged", "blocked"),
        scope="identity",
        count=3,
        window_s=600.0,
        action="retire",
        for_s=3600.0,
    ),
)


class EgressRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[quarantine.egress]``: ``identities`` distinct identities of one subnet with an
    outcome whose reason is in ``on``, on one target within ``window_s`` seconds by the
    NATS server's clock, propose an egress quarantine of (subnet, target) for an operator
    to approve (docs/quarantine.md#egress-proposals)."""

    identities: int = 2
    """Distinct identities of one subnet that make a proposal; 0 proposes nothing."""
    window_s: float = 600.0
    for_s: float = 3600.0
    """How long the egress record lasts once approved (0: until released)."""
    on: str | tuple[str, ...] = ("challenged", "blocked")
    """An outcome reason (``challenged``, ``blocked``, ``rate-limited``) or a list."""
    proposal_ttl_s: float = 86400.0
    """How long a proposal waits for an answer before it lapses (and how long a rejected
    one is shown), by the server's per-key TTL."""
    name: str = "egress-subnet-blocked"
    """What the proposal's ``set_by`` (``rule:<name>``) and its fired marker call it."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """The outcome reasons it counts."""
        return (self.on,) if isinstance(self.on, str) else self.on


class BreakerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The per-target circuit breaker (docs/quarantine.md#the-target-circuit-breaker):
    refusals on one target from ``identities`` distinct identities within ``window_s``
    pause the target fleet-wide for ``cool_s``; then one probe decides."""

    enabled: bool = True
    identities: int = 3
    """K: distinct identities (a worker without one counts as itself) whose refusals open it."""
    window_s: float = 600.0
    """The sliding window the K identities' refusals must fall in (server time)."""
    cool_s: float = 900.0
    """How long the target is paused before one probe is let through."""
    max_cool_s: float = 3600.0
    """A probe refused again doubles the cooling, up to this."""
    on: str | tuple[str, ...] = ("challenged", "blocked")
    """The ``blocked`` outcome reasons that count (``challenged``, ``blocked``,
    ``rate-limited``)."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """The outcome reasons it counts."""
        return (self.on,) if isinstance(self.on, str) else self.on


class QuarantineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The quarantine service (``jetfleet serve quarantine``)."""

    rules: tuple[QuarantineRule, ...] = DEFAULT_QUARANTINE_RULES
    """``[[quarantine.rules]]``; an empty list (``rules = []``) sets no rule."""
    max_evidence: int = 20
    """How many of the outcome events that fired a rule its record names (job ids)."""
    egress: EgressRule = EgressRule()
    """``[quarantine.egress]``: when blocks on one subnet propose an egress quarantine."""
    second_order_window_s: float = 3600.0
    """A retirement whose neighbour (another identity of the same subnet) was retired on
    the same target this recently counts as second-order."""
    breaker: BreakerSettings = BreakerSettings()
    """``[quarantine.breaker]``: the per-target circuit breaker."""

    @property
    def longest_window_s(self) -> float:
        """The longest window (of the rules, the egress rule when on, and the breaker):
        how far back a (re)started quarantine replica reads, so what a fired marker must
        outlive."""
        egress = self.egress.window_s if self.egress.identities else 0.0
        return max([*(r.window_s for r in self.rules), egress, self.breaker.window_s])


VersionGate = Literal["when-set", "always", "off"]
"""When the leaser refuses a tuple not in the approved set (docs/versions.md#gate-modes)."""


class VersionSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The approved version set and the rollout guard (docs/versions.md)."""

    gate: VersionGate = "when-set"
    """``when-set``: refuse unapproved tuples once any tuple has been approved (a fresh
    fleet runs until an operator approves its first; revoking every approval does not
    open it again); ``always``: refuse every tuple not
    approved, even with none approved; ``off``: never refuse for the version."""
    guard_enabled: bool = True
    """Whether the rollout guard may withdraw a newly approved tuple (``jetfleet versions
    guard off`` turns it off fleet-wide at run time as well)."""
    guard_window_s: float = 1800.0
    """The window the guard counts each tuple's outcomes over."""
    guard_min_sample: int = 50
    """Outcomes each side (the new tuple and the incumbent) needs in the window first."""
    guard_fraction: float = 0.8
    """Withdraw a new tuple whose success rate falls below this fraction of the
    incumbent's."""


class ProcessSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How each long-running process runs (not behaviour: left out of the config hash)."""

    event_loop: EventLoopChoice = "auto"
    """``auto``: uvloop where it is installed, else asyncio's loop; ``uvloop`` (an error
    where it is missing); ``asyncio`` (docs/configuration.md#process)."""


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything a jetfleet process is configured with."""

    nats: NatsSettings = NatsSettings()
    redis: RedisSettings = RedisSettings()
    fleet: FleetSettings = FleetSettings()
    gateway: GatewaySettings = GatewaySettings()
    worker: WorkerSettings = WorkerSettings()
    quarantine: QuarantineSettings = QuarantineSettings()
    targets: dict[str, TargetSettings] = {}
    identities: dict[str, IdentitySettings] = {}
    """Identities workers may own; when any is declared, a worker's identity must be one
    of them. None declared: an identity is free text, with no state folder, region or
    egress of its own."""
    versions: VersionSettings = VersionSettings()
    process: ProcessSettings = ProcessSettings()

    def target(self, name: str) -> TargetSettings:
        """The declared target ``name``; raises ConfigError if it is not declared."""
        try:
            return self.targets[name]
        except KeyError:
            raise ConfigError(
                f"unknown target {name!r}: declare it as [targets.{name}] in jetfleet.toml"
            ) from None

    def max_age_s(self, target: str) -> float:
        """How old a job of ``target`` may grow before it is dead-lettered ``expired``."""
        return self.target(target).max_age_s or self.fleet.max_job_age_s


_HINTS = {
    "base_url": "an absolute http(s) URL such as https://example.org/",
    "rate": "a number of requests per second, at least 1/86400 (one a day)",
    "burst": "a whole number >= 1",
    "max_in_flight": "a whole number >= 1",
    "max_attempts": "a whole number >= 1",
    "timeout_s": "a positive number of seconds",
    "max_retry_after_s": "a number of seconds from 1 to 86400 (a day)",
    "url": "a URL such as nats://127.0.0.1:4222 or redis://127.0.0.1:6379/0 "
    "(redis+cluster://h1:6379,h2:6379 or redis+sentinel://s1:26379,s2:26379/SERVICE)",
    "port": "a TCP port number",
    "event_loop": 'one of "auto", "uvloop" or "asyncio"',
}


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from a TOML file and the environment, and validate them.

    Args:
        path: the TOML file; None uses ``JETFLEET_CONFIG`` from ``env`` if set.
        env: the environment (``os.environ`` by the CLI; tests pass their own).

    Raises:
        ConfigError: naming the bad key and what to put there.
    """
    env = dict(env or {})
    path = path or env.get("JETFLEET_CONFIG") or None
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    origins = _apply_env(raw, env)
    settings = _convert(raw, str(path or "environment"), origins)
    validate(settings)
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist: fix --config/JETFLEET_CONFIG"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config path {path} is a folder: point it at a .toml file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text ({exc}): save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Overlay the environment on ``raw``; return which key came from which variable."""
    origins: dict[str, str] = {}
    for name, section in (("NATS_URL", "nats"), ("REDIS_URL", "redis")):
        if env.get(name):
            raw.setdefault(section, {})["url"] = env[name]
            origins[f"{section}.url"] = name
    for name, value in env.items():
        match = re.fullmatch(r"JETFLEET_([A-Z]+)__([A-Z0-9_]+)", name)
        if match:
            section, key = match.group(1).lower(), match.group(2).lower()
            if section == "worker" and key in ("targets", "standby_targets"):
                raw.setdefault(section, {})[key] = [t for t in value.split(",") if t]
            elif section == "worker" and key == "version_fields":
                raw.setdefault(section, {})[key] = _version_fields_from_env(name, value)
            elif section == "worker" and key.startswith("browser__"):
                # JETFLEET_WORKER__BROWSER__ENABLED=true: a key of [worker.browser].
                key = "browser." + key.removeprefix("browser__")
                raw.setdefault(section, {}).setdefault("browser", {})[key[8:]] = value
            else:
                raw.setdefault(section, {})[key] = value
            origins[f"{section}.{key}"] = name
    return origins


def _version_fields_from_env(name: str, value: str) -> dict[str, str]:
    """``k=v,k2=v2`` from the environment as a table."""
    fields: dict[str, str] = {}
    for pair in (p for p in value.split(",") if p.strip()):
        key, eq, field = pair.partition("=")
        if not eq:
            raise ConfigError(
                f"config (environment variable {name}): {pair!r} is not key=value: "
                "give fields as name=value,name2=value2"
            )
        fields[key.strip()] = field.strip()
    return fields


def _convert(raw: dict[str, Any], source: str, origins: dict[str, str]) -> Settings:
    raw_targets = raw.pop("targets", {})
    if not isinstance(raw_targets, dict):
        raise ConfigError(f"config ({source}): targets must be a table of [targets.NAME] tables")
    # Targets are converted one by one so an error can name the target (msgspec hides keys).
    targets = {
        name: _convert_part(body, TargetSettings, source, f"targets.{name}", origins)
        for name, body in raw_targets.items()
    }
    raw_identities = raw.pop("identities", {})
    if not isinstance(raw_identities, dict):
        raise ConfigError(
            f"config ({source}): identities must be a table of [identities.NAME] tables"
        )
    identities = {
        name: _convert_part(body, IdentitySettings, source, f"identities.{name}", origins)
        for name, body in raw_identities.items()
    }
    settings = _convert_part(raw, Settings, source, "", origins)
    return msgspec.structs.replace(settings, targets=targets, identities=identities)


def _convert_part(
    raw: Any, kind: type[_T], source: str, prefix: str, origins: dict[str, str]
) -> _T:
    try:
        # strict=False lets "5" from an environment variable become 5.
        return msgspec.convert(raw, kind, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = re.search(r"at `\$\.?([^`]*)`", text)
        key = ".".join(p for p in (prefix, match.group(1) if match else "") if p)
        if key in origins:
            source = f"environment variable {origins[key]}"
        leaf = key.rsplit(".", 1)[-1]
        if "unknown field" in text:
            field = re.search(r"unknown field `([^`]+)`", text)
            bad = f"{key}.{field.group(1)}" if key and field else (field.group(1) if field else "")
            if bad in origins:
                source = f"environment variable {origins[bad]}"
            raise ConfigError(
                f"config ({source}): unknown key {bad!r}: remove it or fix its spelling"
            ) from None
        hint = _HINTS.get(leaf, "a value of the documented type (docs/configuration.md)")
        first = text.split(" - at ")[0]
        raise ConfigError(f"config ({source}): {key}: {first}; set it to {hint}") from None


MIN_RATE = 1 / 86400
"""The slowest rate a limit may have: one request a day (a slower one's wait would not
fit a permit's answer)."""

ACK_WAIT_OVER_TTL_S = 1.0
"""How much longer than the lease's TTL (whole seconds) the ack wait must be."""


def validate(settings: Settings) -> None:
    """Check the rules a type cannot express; raise ConfigError naming the key."""
    for name, target in settings.targets.items():
        _validate_target(name, target)
    try:
        parse_redis_url(settings.redis.url)
    except ConfigError as exc:
        raise ConfigError(f"config: {exc}") from None
    _require(settings.fleet.max_job_bytes >= 1024, "fleet.max_job_bytes", "at least 1024")
    _require(
        settings.fleet.max_inline_bytes >= 0,
        "fleet.max_inline_bytes",
        "a byte count >= 0 (0 keeps every stored body in the object store)",
    )
    _require(settings.fleet.ack_wait_s > 0, "fleet.ack_wait_s", "a positive number of seconds")
    _require(settings.fleet.lease_ttl_s >= 1, "fleet.lease_ttl_s", "at least 1 second")
    # The server's per-key TTL is whole seconds: a 2.5 s lease lives 3 s.
    lease_lives_s = math.ceil(settings.fleet.lease_ttl_s)
    # A worker counts its lease lost a whole TTL after its last renewal was sent (it
    # waits no longer for an answer) and then stops the handler; the ack wait runs from
    # the +WPI sent after that renewal, so it must outlast the TTL by that much.
    _require(
        settings.fleet.ack_wait_s >= lease_lives_s + ACK_WAIT_OVER_TTL_S,
        "fleet.ack_wait_s",
        f"at least {ACK_WAIT_OVER_TTL_S:g} s more than fleet.lease_ttl_s ({lease_lives_s} s) "
        f"as the server keeps it (whole seconds, rounded up), that is >= "
        f"{lease_lives_s + ACK_WAIT_OVER_TTL_S:g} s, so JetStream redelivers only after a "
        "lease is gone and its worker has stopped; or lower fleet.lease_ttl_s",
    )
    _require(settings.worker.concurrency >= 1, "worker.concurrency", "at least 1")
    _require(
        settings.worker.report_patience_s > 0,
        "worker.report_patience_s",
        "a positive number of seconds (600 by default)",
    )
    _require(
        settings.fleet.dedicated_targets >= 0, "fleet.dedicated_targets", "a whole number >= 0"
    )
    _require(
        1 <= settings.fleet.target_partitions <= 1024,
        "fleet.target_partitions",
        "a whole number from 1 to 1024",
    )
    _validate_consumer_count(settings)
    _validate_rate_settings(settings)
    # The wire bounds count characters, and a character may take 4 bytes in UTF-8: the
    # largest lease call or quarantine command jetfleet itself sends is about 11 KiB.
    _require(
        16 * 1024 <= settings.fleet.max_request_bytes <= 64 * 1024 * 1024,
        "fleet.max_request_bytes",
        "a byte count from 16384 to 67108864 (the largest lease call a leaser reads; "
        "below 16 KiB it could refuse calls jetfleet itself sends)",
    )
    _require(
        1 <= settings.fleet.service_concurrency <= 100_000,
        "fleet.service_concurrency",
        "a whole number from 1 to 100000 (requests a leaser or sink replica handles at once)",
    )
    shares = settings.worker.tier_shares
    _require(
        set(shares) <= {"high", "normal", "bulk"}
        and all(v >= 0 for v in shares.values())
        and sum(shares.values()) > 0,
        "worker.tier_shares",
        'shares (>= 0, not all 0) for "high", "normal" and "bulk"',
    )
    _require(0 <= settings.gateway.port <= 65535, "gateway.port", _HINTS["port"])
    _require(settings.gateway.max_concurrent >= 1, "gateway.max_concurrent", "a whole number >= 1")
    _require(
        0 < settings.gateway.request_timeout_s <= 300,
        "gateway.request_timeout_s",
        "a number of seconds above 0, at most 300",
    )
    _require(settings.nats.replicas in (1, 3, 5), "nats.replicas", "1, 3 or 5")
    _require(
        all(
            u.strip().startswith(("http://", "https://"))
            for u in settings.nats.monitor_url.split(",")
            if u.strip()
        ),
        "nats.monitor_url",
        "http(s):// URLs of the servers' monitoring ports, comma-separated "
        "(http://nats-1:8222,http://nats-2:8222)",
    )
    for name in settings.worker.targets:
        _require(name in settings.targets, "worker.targets", f"declared targets, not {name!r}")
    for name in settings.worker.standby_targets:
        _require(
            name in settings.targets, "worker.standby_targets", f"declared targets, not {name!r}"
        )
    _require(
        2 <= settings.worker.claim_ttl_s <= 600,
        "worker.claim_ttl_s",
        "a number of seconds from 2 to 600 (30 by default; renewed every third of it)",
    )
    for name, identity in settings.identities.items():
        _validate_identity(name, identity)
    _validate_state_dirs(settings.identities)
    _require(
        len(settings.worker.identity) <= 256
        and not _CONTROL_CHARS.search(settings.worker.identity),
        "worker.identity",
        "at most 256 characters without control characters",
    )
    _validate_subnet("worker.subnet", settings.worker.subnet)
    owned_identity(settings, settings.worker.identity)
    _validate_dedupe_ttl(settings)
    _require(
        settings.fleet.audit_max_age_s >= 86400,
        "fleet.audit_max_age_s",
        "at least 86400 (a day): an audit log must outlive the incident it records",
    )
    _validate_job_ends(settings)
    _validate_quarantine(settings.quarantine)
    _validate_version_fields(settings.worker.version_fields)
    _validate_versions(settings.versions)
    _validate_browser(settings.worker.browser)


def _validate_browser(browser: BrowserSettings) -> None:
    key = "worker.browser"
    _require(1 <= browser.max_contexts <= 64, f"{key}.max_contexts", "a whole number from 1 to 64")
    _require(
        browser.max_screenshot_bytes >= 1024,
        f"{key}.max_screenshot_bytes",
        "a byte count of at least 1024",
    )
    _require(
        0 < browser.wait_timeout_s <= 300,
        f"{key}.wait_timeout_s",
        "a number of seconds above 0, at most 300",
    )
    _require(
        not browser.enabled or bool(browser.profiles_dir.strip()),
        f"{key}.profiles_dir",
        "a folder this worker alone uses for its browser profiles",
    )


_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _validate_identity(name: str, identity: IdentitySettings) -> None:
    key = f"identities.{name}"
    _require(
        0 < len(name) <= 256 and not _CONTROL_CHARS.search(name),
        key,
        "a name of 1 to 256 characters without control characters (as worker.identity)",
    )
    for field in ("egress", "region"):
        value = getattr(identity, field)
        _require(
            len(value) <= 256 and not _CONTROL_CHARS.search(value),
            f"{key}.{field}",
            "at most 256 characters without control characters",
        )
    _validate_subnet(f"{key}.subnet", identity.subnet)


def _validate_subnet(key: str, subnet: str) -> None:
    if not subnet:
        return
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise ConfigError(
            f"config: {key} is invalid ({exc}): set it to a network such as "
            "10.1.0.0/24 or 2001:db8::/64 (host bits zero)"
        ) from None
    # Subnets are compared as text (egress records, the subnet lanes): one network
    # spelled two ways would be two subnets.
    if str(network) != subnet:
        raise ConfigError(
            f"config: {key} is {subnet!r}: write it as {str(network)!r} (the canonical "
            "spelling; subnets are compared as written)"
        )


def _validate_state_dirs(identities: dict[str, IdentitySettings]) -> None:
    """Refuse two identities with one state folder: each would read the other's session
    (its cookies), and their two owners would write one file."""
    seen: dict[str, str] = {}
    for name, identity in identities.items():
        if not identity.state_dir:
            continue
        folder = os.path.abspath(identity.state_dir)
        other = seen.setdefault(folder, name)
        if other != name:
            raise ConfigError(
                f"config: identities.{_toml_key(other)}.state_dir and "
                f"identities.{_toml_key(name)}.state_dir are both {folder!r}: an identity's "
                "state is its own; give each identity a folder of its own"
            )


def _toml_key(name: str) -> str:
    """``name`` as one TOML key, quoted: an identity's name may hold spaces and dots."""
    return json.dumps(name, ensure_ascii=False).replace("\x7f", "\\u007f")


def owned_identity(settings: Settings, identity: str) -> IdentitySettings | None:
    """The declared identity a worker of these settings may own as ``identity``; None
    for no identity, or when none is declared (an identity is then free text).

    Raises:
        ConfigError: identities are declared and ``identity`` is not one of them, or it
            belongs to another region (an identity never leaves its region) or egress
            than the worker's.
    """
    if not identity or not settings.identities:
        return None
    declared = settings.identities.get(identity)
    if declared is None:
        names = ", ".join(sorted(settings.identities))
        raise ConfigError(
            f"config: worker.identity (or --identity) {identity!r} is not declared: "
            f"declare it as [identities.{_toml_key(identity)}] or use one of {names}"
        )
    worker = settings.worker
    key = f"identities.{identity}"
    if declared.region and worker.region and declared.region != worker.region:
        raise ConfigError(
            f"config: worker.region is {worker.region!r} but {key}.region is "
            f"{declared.region!r}: an identity never leaves its region; run {identity!r} "
            f"on a worker of region {declared.region!r}, or give this worker another identity"
        )
    if declared.subnet and worker.subnet and declared.subnet != worker.subnet:
        raise ConfigError(
            f"config: worker.subnet is {worker.subnet!r} but {key}.subnet is "
            f"{declared.subnet!r}: an identity's requests leave from its own subnet; set "
            f"worker.subnet to {declared.subnet!r} (or leave it empty), or give this worker "
            "another identity"
        )
    if declared.egress and worker.egress and declared.egress != worker.egress:
        raise ConfigError(
            f"config: worker.egress is {worker.egress!r} but {key}.egress is "
            f"{declared.egress!r}: an identity's requests leave by its own egress; set "
            f"worker.egress to {declared.egress!r} (or leave it empty), or give this worker "
            "another identity"
        )
    return declared


def with_identity(settings: Settings, identity: str) -> Settings:
    """``settings`` for a worker owning ``identity``: ``worker.identity`` set to it, and
    ``worker.region`` and ``worker.egress`` filled from the declared identity where the
    worker's own are empty.

    Raises:
        ConfigError: as ``owned_identity``.
    """
    declared = owned_identity(settings, identity)
    worker = msgspec.structs.replace(
        settings.worker,
        identity=identity,
        region=settings.worker.region or (declared.region if declared else ""),
        egress=settings.worker.egress or (declared.egress if declared else ""),
        subnet=settings.worker.subnet or (declared.subnet if declared else ""),
    )
    return msgspec.structs.replace(settings, worker=worker)


def _validate_rate_settings(settings: Settings) -> None:
    fleet = settings.fleet
    _require(
        fleet.rate >= 0 and math.isfinite(fleet.rate),
        "fleet.rate",
        "a number of requests per second >= 0 (0: no aggregate cap)",
    )
    _require(fleet.burst >= 1, "fleet.burst", _HINTS["burst"])
    _require(fleet.hold_base_s > 0, "fleet.hold_base_s", "a positive number of seconds")
    _require(fleet.hold_forgive_s > 0, "fleet.hold_forgive_s", "a positive number of seconds")
    _require(
        60 <= fleet.robots_ttl_s <= 86400,
        "fleet.robots_ttl_s",
        "a number of seconds from 60 to 86400 (RFC 9309: a robots.txt is cached at most a day)",
    )
    _require(
        0.05 <= fleet.long_poll_s <= MAX_LONG_POLL_S,
        "fleet.long_poll_s",
        f"a number of seconds from 0.05 to {MAX_LONG_POLL_S:g} (each drain waits it out on "
        "top of its 30 s, inside the deploy's 35 to 45 s grace)",
    )
    _require(
        1 <= fleet.robots_error_hold_s <= 86400,
        "fleet.robots_error_hold_s",
        "a number of seconds from 1 to 86400",
    )
    _require(
        0 <= fleet.avoid_s <= 86400,
        "fleet.avoid_s",
        "a number of seconds from 0 (no avoid list) to 86400",
    )


def _validate_target(name: str, target: TargetSettings) -> None:
    key = f"targets.{name}"
    _require(
        bool(TARGET_NAME_RE.match(name)),
        key,
        "a name of lowercase letters, digits, '-' or '_' (it becomes a NATS subject token)",
    )
    url = urlsplit(target.base_url)
    _require(
        url.scheme in ("http", "https") and bool(url.netloc),
        f"{key}.base_url",
        _HINTS["base_url"],
    )
    _require(target.rate >= MIN_RATE and math.isfinite(target.rate), f"{key}.rate", _HINTS["rate"])
    _require(target.burst >= 1, f"{key}.burst", _HINTS["burst"])
    _require(
        0.0 <= target.send_jitter_s < 1.0,
        f"{key}.send_jitter_s",
        "seconds from 0 up to (not including) 1",
    )
    _require(target.max_in_flight >= 1, f"{key}.max_in_flight", _HINTS["max_in_flight"])
    _require(target.max_attempts >= 1, f"{key}.max_attempts", _HINTS["max_attempts"])
    _require(target.timeout_s > 0, f"{key}.timeout_s", _HINTS["timeout_s"])
    _require(target.max_body_bytes >= 1, f"{key}.max_body_bytes", "a positive byte count")
    # At least a second, or a target's "wait" would be no wait at all; at most a day,
    # past which a job waiting on a header is a job lost (an operator decides instead).
    _require(
        1 <= target.max_retry_after_s <= 86400,
        f"{key}.max_retry_after_s",
        _HINTS["max_retry_after_s"],
    )
    _require(target.daily >= 0, f"{key}.daily", "a whole number >= 0 (0: no daily budget)")
    for kind in ("egress", "identity"):
        rate = getattr(target, f"{kind}_rate")
        burst = getattr(target, f"{kind}_burst")
        _require(
            rate >= 0 and math.isfinite(rate),
            f"{key}.{kind}_rate",
            "a number of requests per second >= 0 (0: no such limit)",
        )
        _require(burst >= 1, f"{key}.{kind}_burst", _HINTS["burst"])
    _require(
        target.obey_robots or bool(target.robots_off_reason.strip()),
        f"{key}.robots_off_reason",
        "why robots.txt is not obeyed (required with obey_robots = false; it is logged)",
    )
    _validate_redirect_hosts(key, target.redirect_hosts)
    _require(
        target.max_age_s >= 0,
        f"{key}.max_age_s",
        "a number of seconds >= 0 (0 takes fleet.max_job_age_s)",
    )
    try:
        window_of(target.active_hours, target.active_days, target.timezone)
    except WindowError as exc:
        raise ConfigError(f"config: {key}.{exc.setting} is invalid: {exc}") from None


_REDIRECT_HOST_RE = re.compile(r"^[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]{1,5})?$")


def _validate_redirect_hosts(key: str, hosts: tuple[str, ...]) -> None:
    for host in hosts:
        _require(
            bool(_REDIRECT_HOST_RE.match(host)),
            f"{key}.redirect_hosts",
            f"lowercase host names or host:port pairs such as cdn.example.org:8443, not "
            f"{host!r} (no scheme, path or upper case)",
        )


# nats-server refuses a stream's 1001st consumer (err 10026) unless the stream sets
# max_consumers; every work lane takes three (one per tier) on JF_WORK.
MAX_CONSUMERS_PER_STREAM = 1000
TIERS_PER_LANE = 3


def _validate_consumer_count(settings: Settings) -> None:
    fleet = settings.fleet
    targets = len(settings.targets)
    own = min(targets, fleet.dedicated_targets)
    lanes = own + min(targets - own, fleet.target_partitions)
    if lanes * TIERS_PER_LANE <= MAX_CONSUMERS_PER_STREAM:
        return
    most_lanes = MAX_CONSUMERS_PER_STREAM // TIERS_PER_LANE
    room = own
    while room > 0 and room + min(targets - room, fleet.target_partitions) > most_lanes:
        room -= 1
    raise ConfigError(
        f"config: fleet.dedicated_targets is invalid: {own} targets with consumers of their "
        f"own plus up to {lanes - own} partitions make {lanes * TIERS_PER_LANE} work "
        f"consumers, more than the {MAX_CONSUMERS_PER_STREAM} nats-server allows on one "
        f"stream; set fleet.dedicated_targets to at most {room} (the other targets "
        "share hashed partitions)"
    )


def retry_horizon_s(settings: Settings) -> float:
    """The longest a job can keep being retried: attempts x max backoff, worst target."""
    attempts = max([t.max_attempts for t in settings.targets.values()] or [3])
    return attempts * settings.fleet.retry_max_backoff_s


def _validate_dedupe_ttl(settings: Settings) -> None:
    horizon = retry_horizon_s(settings)
    needed = horizon + settings.fleet.ack_wait_s
    if settings.fleet.dedupe_ttl_s < needed:
        attempts = round(horizon / settings.fleet.retry_max_backoff_s)
        raise ConfigError(
            f"fleet.dedupe_ttl_s = {settings.fleet.dedupe_ttl_s:g} s is shorter than the retry "
            f"horizon plus the visibility timeout: {attempts} attempts x "
            f"{settings.fleet.retry_max_backoff_s:g} s max backoff + "
            f"{settings.fleet.ack_wait_s:g} s ack_wait = {needed:g} s; a late retry could then "
            f"repeat a committed side effect. Set fleet.dedupe_ttl_s to at least {needed:g}."
        )


# Deliveries a job may use beyond its attempts: each attempt may also see a
# retry-elsewhere and a no-slot hand-back, and holds, lease refusals and restarts add more.
DELIVERIES_PER_ATTEMPT = 4
SPARE_DELIVERIES = 20


def min_max_deliver(settings: Settings) -> int:
    """The smallest ``fleet.max_deliver`` the targets' attempt budgets allow."""
    attempts = max([t.max_attempts for t in settings.targets.values()] or [3])
    return DELIVERIES_PER_ATTEMPT * attempts + SPARE_DELIVERIES


def _validate_job_ends(settings: Settings) -> None:
    """The backstop must sit well above a runnable job's deliveries, and a job must end
    before its submission ages out of JF_SUBMIT (or status loses track of it)."""
    fleet = settings.fleet
    needed = min_max_deliver(settings)
    _require(
        fleet.max_deliver >= needed,
        "fleet.max_deliver",
        f"at least {needed} ({DELIVERIES_PER_ATTEMPT} deliveries per attempt of the largest "
        f"targets.*.max_attempts, plus {SPARE_DELIVERIES} for holds and refusals), so the "
        "backstop never ends a job that could still run",
    )
    keep = f"at most fleet.retention_s ({fleet.retention_s:g} s), so a job ends before its "
    keep += "submission ages out of JF_SUBMIT"
    _require(0 < fleet.max_job_age_s <= fleet.retention_s, "fleet.max_job_age_s", "> 0 and " + keep)
    for name, target in settings.targets.items():
        _require(target.max_age_s <= fleet.retention_s, f"targets.{name}.max_age_s", keep)
        _validate_window_fits_max_age(settings, name)


def _validate_window_fits_max_age(settings: Settings, name: str) -> None:
    """A job submitted as its target's window closes waits the whole closed spell: one
    longer than the job's max age would end it ``expired`` unrun."""
    target = settings.targets[name]
    window = window_of(target.active_hours, target.active_days, target.timezone)
    if window is None:
        return
    closed = window.longest_closed_s()
    max_age = settings.max_age_s(name)
    # An hour of margin: a DST change lengthens one closed spell by an hour.
    if closed + 3600 >= max_age:
        needed = closed + 3600
        retention = settings.fleet.retention_s
        # max_age_s may not pass fleet.retention_s: say so when the fix needs both.
        also = (
            f", and fleet.retention_s (now {retention:.0f}) at least as high"
            if needed >= retention
            else f" (at most fleet.retention_s, {retention:.0f})"
        )
        raise ConfigError(
            f"config: targets.{name}.active_hours is invalid: the window is closed for up to "
            f"{closed / 3600:g} h at a stretch, and a job of {name} expires after "
            f"{max_age / 3600:g} h (targets.{name}.max_age_s, else fleet.max_job_age_s): a job "
            "submitted at closing would be dead-lettered expired unrun. Widen active_hours "
            f"or active_days, or set targets.{name}.max_age_s above {needed:.0f} "
            f"(the longest closed spell plus an hour for a DST change){also}"
        )


MAX_RULE_WINDOW_S = 7 * 86400.0
"""The longest window or record a rule may have: a week, as long as outcome events are
kept by default (a longer window would count events already gone)."""


def _validate_quarantine(quarantine: QuarantineSettings) -> None:
    _require(
        1 <= quarantine.max_evidence <= 100,
        "quarantine.max_evidence",
        "a whole number from 1 to 100 (job ids a record names)",
    )
    _validate_breaker(quarantine.breaker)
    names: set[str] = set()
    for n, rule in enumerate(quarantine.rules):
        key = f"quarantine.rules[{n}]"
        reasons = rule.reasons
        _require(
            bool(reasons) and all(r in QUARANTINE_REASONS for r in reasons),
            f"{key}.on",
            f"one of {', '.join(QUARANTINE_REASONS)} or a list of them, not {rule.on!r}",
        )
        _require(
            ACTION_SCOPES[rule.action] == rule.scope,
            f"{key}.scope",
            f'"{ACTION_SCOPES[rule.action]}" for action = "{rule.action}" (retire acts on '
            "an identity, cool on a worker), or change the action",
        )
        _require(rule.count >= 1, f"{key}.count", "a whole number >= 1 (outcomes in the window)")
        _require(
            0 < rule.window_s <= MAX_RULE_WINDOW_S and math.isfinite(rule.window_s),
            f"{key}.window_s",
            f"a number of seconds above 0 and at most {MAX_RULE_WINDOW_S:g} (a week)",
        )
        _require(
            1 <= rule.for_s <= MAX_RULE_WINDOW_S,
            f"{key}.for_s",
            f"a number of seconds from 1 to {MAX_RULE_WINDOW_S:g} (how long the record "
            "lasts; an operator lifts it early with `jetfleet quarantine release`)",
        )
        _require(
            # A KV key token may not be empty: no "..", and no "." at the end.
            bool(re.fullmatch(r"[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?", rule.label))
            and ".." not in rule.label,
            f"{key}.name",
            "lowercase letters, digits, '-', '_' or '.', at most 64 characters, starting and "
            "ending with a letter or digit, no '..' (it becomes part of a KV key)",
        )
        _require(
            rule.label not in names, f"{key}.name", f"a name no other rule has, not {rule.label!r}"
        )
        names.add(rule.label)
    _validate_egress(quarantine.egress, names)
    _require(
        0 < quarantine.second_order_window_s <= MAX_RULE_WINDOW_S,
        "quarantine.second_order_window_s",
        f"a number of seconds above 0 and at most {MAX_RULE_WINDOW_S:g} (a week)",
    )


_RULE_NAME = re.compile(r"[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?")


def _validate_egress(egress: EgressRule, rule_names: set[str]) -> None:
    key = "quarantine.egress"
    _require(
        egress.identities == 0 or egress.identities >= 2,
        f"{key}.identities",
        "a whole number >= 2 (distinct identities of one subnet), or 0 to propose nothing",
    )
    _require(
        bool(egress.reasons) and all(r in QUARANTINE_REASONS for r in egress.reasons),
        f"{key}.on",
        f"one of {', '.join(QUARANTINE_REASONS)} or a list of them, not {egress.on!r}",
    )
    _require(
        0 < egress.window_s <= MAX_RULE_WINDOW_S and math.isfinite(egress.window_s),
        f"{key}.window_s",
        f"a number of seconds above 0 and at most {MAX_RULE_WINDOW_S:g} (a week)",
    )
    _require(
        egress.for_s == 0 or 1 <= egress.for_s <= MAX_RULE_WINDOW_S,
        f"{key}.for_s",
        f"0 (until released) or a number of seconds from 1 to {MAX_RULE_WINDOW_S:g}",
    )
    _require(
        1 <= egress.proposal_ttl_s <= MAX_RULE_WINDOW_S,
        f"{key}.proposal_ttl_s",
        f"a number of seconds from 1 to {MAX_RULE_WINDOW_S:g} (how long a proposal waits)",
    )
    _require(
        bool(_RULE_NAME.fullmatch(egress.name))
        and ".." not in egress.name
        and egress.name not in rule_names,
        f"{key}.name",
        "lowercase letters, digits, '-', '_' or '.', at most 64 characters, starting and "
        "ending with a letter or digit, no '..', and no rule's name",
    )


def _validate_breaker(breaker: BreakerSettings) -> None:
    key = "quarantine.breaker"
    reasons = breaker.reasons
    _require(
        bool(reasons) and all(r in QUARANTINE_REASONS for r in reasons),
        f"{key}.on",
        f"one of {', '.join(QUARANTINE_REASONS)} or a list of them, not {breaker.on!r}",
    )
    _require(
        1 <= breaker.identities <= 1000,
        f"{key}.identities",
        "a whole number from 1 to 1000 (distinct identities refused within window_s)",
    )
    _require(
        0 < breaker.window_s <= MAX_RULE_WINDOW_S and math.isfinite(breaker.window_s),
        f"{key}.window_s",
        f"a number of seconds above 0 and at most {MAX_RULE_WINDOW_S:g} (a week)",
    )
    _require(
        1 <= breaker.cool_s <= MAX_RULE_WINDOW_S,
        f"{key}.cool_s",
        f"a number of seconds from 1 to {MAX_RULE_WINDOW_S:g} (how long the target pauses)",
    )
    _require(
        breaker.cool_s <= breaker.max_cool_s <= MAX_RULE_WINDOW_S,
        f"{key}.max_cool_s",
        f"a number of seconds from cool_s ({breaker.cool_s:g}) to {MAX_RULE_WINDOW_S:g} "
        "(the longest cooling after refused probes)",
    )


def _require(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"config: {key} is invalid: set it to {what}")


VERSION_FIELD_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")
MAX_VERSION_FIELDS = 8
MAX_VERSION_VALUE = 64


def _validate_version_fields(fields: dict[str, str]) -> None:
    key = "worker.version_fields"
    _require(
        len(fields) <= MAX_VERSION_FIELDS,
        key,
        f"at most {MAX_VERSION_FIELDS} fields (a version tuple is read by people)",
    )
    for name, value in fields.items():
        _require(
            bool(VERSION_FIELD_RE.match(name)),
            f"{key}.{name}",
            "a field name of lowercase letters, digits, '_', '-' or '.', starting with a "
            "letter, at most 32 characters",
        )
        # ASCII and short: the tuple rides on every lease call, within its byte bound.
        _require(
            0 < len(value) <= MAX_VERSION_VALUE and value.isascii() and value.isprintable(),
            f"{key}.{name}",
            f"a value of 1 to {MAX_VERSION_VALUE} printable ASCII characters",
        )


def _validate_versions(versions: VersionSettings) -> None:
    _require(
        0 < versions.guard_window_s <= MAX_RULE_WINDOW_S and math.isfinite(versions.guard_window_s),
        "versions.guard_window_s",
        f"a number of seconds above 0 and at most {MAX_RULE_WINDOW_S:g} (a week)",
    )
    _require(
        1 <= versions.guard_min_sample <= 1_000_000,
        "versions.guard_min_sample",
        "a whole number from 1 to 1000000 (outcomes each side needs before the guard judges)",
    )
    _require(
        0 < versions.guard_fraction <= 1,
        "versions.guard_fraction",
        "a number above 0 and at most 1 (0.8: withdraw below 80% of the incumbent's success rate)",
    )
