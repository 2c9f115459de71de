"""The ordered grant checks. Each answers a refusal (or already-done) or None.

Three kinds. ``ASKING_CHECKS`` read from the server, so the leaser runs them at once (a
grant waits for one round trip, not one each); ``settled`` writes only for a job that is
settled already, to land its record. ``LOCAL_CHECKS`` only read, from memory. Between
them and the last kind the leaser looks for a live lease of the job (its holder has its
place; the same delivery asking again gets its lease again). ``TAKING_CHECKS`` take
something (an in-flight place; a half-open circuit breaker's one probe; a rate permit only
for workers from before permits moved to the worker), so they run one after another, and
only once nothing else objects. A current worker takes the rate permit itself, just
before the request, so the limiter's clock and the target's are milliseconds apart.
The first objection in ``GRANT_CHECKS`` order wins.
``paused`` is the first local check: after the most final answers, before quarantine.
Each capability adds its check to the right tuple; order
matters: the most final answers come first. A taking check that refuses frees what the
checks before it took (``free_taken``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from jetfleet.schemas.breaker import BreakerRecord
from jetfleet.schemas.lease import (
    LeaseAlreadyDone,
    LeaseRefusal,
    LeaseRequest,
    QuarantineRecord,
    QuarantineScope,
    Sealed,
    SealedDeath,
)
from jetfleet.schemas.permit import PermitAllowed, PermitRequest, PermitWait
from jetfleet.services.leaser.avoid_check import AvoidList
from jetfleet.services.leaser.quarantine_book import QuarantineBook
from jetfleet.services.leaser.version_commands import ApprovedVersions
from nats.js import JetStreamContext

from jetfleet.activity_window import window_of
from jetfleet.breaker_book import BreakerBook
from jetfleet.inflight_caps import CapsUnavailable
from jetfleet.lease_client import BUSY
from jetfleet.lease_store import HistoryEntry
from jetfleet.pause_book import PauseBook
from jetfleet.permit_client import PermitClient
from jetfleet.results import committed_job
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings
from jetfleet.settlement import land
from jetfleet.subnet_holds import OWN_ONLY, canonical_subnet
from jetfleet.target_places import TargetPlaces

# How often a quarantined scope asks again: a quarantine may be lifted early, so a
# worker never holds off longer than this, whatever the quarantine's duration.
QUARANTINE_RETRY_S = 30.0
# A target at its in-flight cap: ask again soon, a place frees when any job ends.
TARGET_BUSY_RETRY_S = 0.25
CAPS_UNAVAILABLE_RETRY_S = 1.0
RATELIMIT_UNAVAILABLE = "ratelimit-unavailable"
# A target outside its activity window is asked about again at least this often, however
# far off the opening: a config change or a new clock reading may open it sooner.
WINDOW_RETRY_S = 60.0
# The server's time cannot be read: a windowed target gets nothing until it can.
CLOCK_UNKNOWN_RETRY_S = 5.0
# Another worker of the subnet serves the target: its hold lasts while it keeps leasing
# jobs of the target, so ask again now and then, not at once.
SUBNET_BUSY_RETRY_S = 2.0
# An open breaker may be closed early by an operator: ask again at least this often.
BREAKER_RETRY_S = 30.0
# A pause may be resumed at any moment, and a resume must restore flow quickly: a
# refused worker asks again this soon (a fleet or target pause also holds the consumers
# at the server, so few asks come while it lasts).
PAUSE_RETRY_S = 1.0


@dataclass(frozen=True)
class GrantContext:
    """What a grant check may look at."""

    request: LeaseRequest
    settings: Settings
    js: JetStreamContext
    quarantine: QuarantineBook
    places: TargetPlaces
    history: asyncio.Future[HistoryEntry]
    """The job's history, read once for every check and for the grant's record."""
    permits: PermitClient
    took_place: list[bool] = field(default_factory=lambda: [False])
    """Whether ``in_flight_cap`` took a new place (a refused permit frees it)."""
    clock: ServerClock | None = None
    """The NATS server's time, for activity windows (never this host's clock)."""
    took_subnet: list[str] = field(default_factory=list)
    """The subnet ``subnet_exclusive`` holds the target for with this ask, if it holds
    it (the lease's record names it)."""
    new_subnet_hold: list[bool] = field(default_factory=lambda: [False])
    """Whether that hold is new, this ask's (freed when the ask leads to no lease); one
    found there is another delivery's of the same worker, and stays."""
    avoid: AvoidList | None = None
    """The job's avoid list judge (None: no avoid list)."""
    breakers: BreakerBook | None = None
    probe: list[int] = field(default_factory=lambda: [0])
    """The revision of the probe ``circuit_probe`` took (0: none): the grant names its
    fence there."""
    pauses: PauseBook | None = None
    """The pauses in force (None: no pause switch)."""
    versions: ApprovedVersions | None = None
    """The approved version set (None: no version gate)."""


GrantCheck = Callable[[GrantContext], Awaitable[LeaseRefusal | LeaseAlreadyDone | None]]
HISTORY_UNREAD_RETRY_S = 1.0
"""How soon a worker asks again when the job's history could not be read."""


async def settled(ctx: GrantContext) -> LeaseRefusal | LeaseAlreadyDone | None:
    """The job has its one terminal decision already (its ack or term was lost, or the
    sink that decided died before writing the record): land that decision's record, then
    answer it, so the worker acks or terminates without running the job again."""
    try:
        read = await ctx.history
    except Exception as exc:
        # Unknown, so nothing may be answered yet: ``already_done`` could otherwise ack a
        # job that is sealed dead (its term lost) as another job's duplicate, ending it
        # both dead and committed. The worker asks again, spending no attempt.
        return LeaseRefusal(
            reason=BUSY,
            retry_after_s=HISTORY_UNREAD_RETRY_S,
            detail=f"the job's history could not be read ({type(exc).__name__}): ask again",
        )
    if read.history is None or read.history.settled is None:
        return None
    return await answer_settled(ctx.js, ctx.request, read.history.settled)


async def answer_settled(
    js: JetStreamContext, request: LeaseRequest, sealed: Sealed
) -> LeaseRefusal | LeaseAlreadyDone:
    """Land ``sealed`` (a no-op when it landed before) and answer the grant from it."""
    reply = await land(js, sealed)
    if isinstance(sealed, SealedDeath):
        return LeaseRefusal(
            reason="dead-lettered", detail=f"the job was dead-lettered ({reply.detail})"
        )
    return LeaseAlreadyDone(key=request.key, committed_by=reply.committed_by or request.job_id)


async def already_done(ctx: GrantContext) -> LeaseAlreadyDone | None:
    """The idempotency key is committed: no second request to the target."""
    committed_by = await committed_job(ctx.js, ctx.request.target, ctx.request.key)
    if committed_by is not None:
        return LeaseAlreadyDone(key=ctx.request.key, committed_by=committed_by)
    return None


async def paused(ctx: GrantContext) -> LeaseRefusal | None:
    """A pause in force covers the ask: the fleet, its target, or the worker's region,
    id or identity (docs/pause.md). From the book's memory; judged by the server's
    clock, since a timed pause lapses by its per-key TTL, which a watch does not see."""
    book, req = ctx.pauses, ctx.request
    if book is None or (not book.entries and book.following()):
        return None
    now = await ctx.clock.now() if ctx.clock is not None else None
    entry = await book.covering(req.target, req.region, req.worker, req.identity, now)
    if entry is None:
        return None
    record = entry.record
    what = "the fleet" if record.scope == "fleet" else f"{record.scope} {record.name}"
    lasts = f"for {record.for_s:g} s" if record.for_s > 0 else "until resumed"
    return LeaseRefusal(
        reason="paused",
        retry_after_s=PAUSE_RETRY_S,
        pause_scope=record.scope,
        detail=f"{what} is paused {lasts} by {record.by or 'an operator'}"
        + (f": {record.why}" if record.why else "")
        + " (`jetfleet resume` ends it)",
    )


async def quarantine_on(
    book: QuarantineBook, target: str, worker: str, identity: str, subnet: str
) -> tuple[QuarantineScope, str, QuarantineRecord] | None:
    """The first of the worker, its identity and its egress subnet quarantined on
    ``target`` (scope, name, record), or None. From the book's watch: a read only for a
    scope it knows of."""
    scopes: tuple[tuple[QuarantineScope, str], ...] = (
        ("worker", worker),
        ("identity", identity),
        ("egress", subnet),
    )
    for scope, name in scopes:
        record = await book.get(scope, name, target)
        if record is not None:
            return scope, name, record
    return None


async def quarantined(ctx: GrantContext) -> LeaseRefusal | None:
    """The worker, its identity or its egress subnet is quarantined on this target."""
    req = ctx.request
    found = await quarantine_on(ctx.quarantine, req.target, req.worker, req.identity, req.subnet)
    if found is None:
        return None
    scope, name, record = found
    return LeaseRefusal(
        reason="quarantined",
        retry_after_s=min(record.for_s or QUARANTINE_RETRY_S, QUARANTINE_RETRY_S),
        detail=f"{scope} {name} is quarantined on {req.target}: {record.reason}",
    )


async def breaker_cooling(book: BreakerBook | None, target: str) -> BreakerRecord | None:
    """The record of ``target``'s breaker if it is open and cooling, else None (closed,
    or half-open). From the book's watch: a read only for a target it knows of."""
    if book is None or not book.known(target):
        return None
    record, _ = await book.record(target)
    if record is None or not await book.cooling(target):
        return None
    return record


async def circuit_open(ctx: GrantContext) -> LeaseRefusal | None:
    """The target's circuit breaker is open (cooling): no grant to anyone."""
    target = ctx.request.target
    record = await breaker_cooling(ctx.breakers, target)
    if record is None:
        return None  # closed, or half-open: circuit_probe decides
    return LeaseRefusal(
        reason="circuit-open",
        retry_after_s=min(record.cool_s, BREAKER_RETRY_S),
        detail=f"the circuit breaker of {target} is open for {record.cool_s:g} s, then one "
        f"probe decides: {record.reason}",
    )


async def circuit_probe(ctx: GrantContext) -> LeaseRefusal | None:
    """A half-open breaker lets one probe lease through, fleet-wide: this grant is it,
    or it is refused while another probe is in flight. After ``in_flight_cap``, so the
    probe is only taken for a grant nothing but the rate permit objects to."""
    book, req = ctx.breakers, ctx.request
    if book is None or not book.known(req.target):
        return None
    record, _ = await book.record(req.target)
    if record is None:
        return None
    ttl = ctx.settings.fleet.lease_ttl_s
    revision = await book.take_probe(req.target, req.job_id, req.worker, ttl)
    if revision is not None:
        ctx.probe[0] = revision
    # Re-opened meanwhile (a probe refused): the probe this ask took is freed with the rest.
    cooling = revision is not None and await book.cooling(req.target)
    if revision is not None and not cooling:
        return None
    await free_taken(ctx)  # the place, subnet hold and probe this ask took, nothing of others'
    if cooling:
        return LeaseRefusal(
            reason="circuit-open",
            retry_after_s=min(record.cool_s, BREAKER_RETRY_S),
            detail=f"the circuit breaker of {req.target} opened again",
        )
    return LeaseRefusal(
        reason="circuit-probing",
        retry_after_s=min(ttl, BREAKER_RETRY_S),
        detail=f"the circuit breaker of {req.target} is half-open and its one probe is in "
        "flight; its outcome closes or re-opens it",
    )


async def version_not_approved(ctx: GrantContext) -> LeaseRefusal | None:
    """The worker's version tuple is not in the approved set (``versions.gate``): about
    this worker only, so its jobs go to workers whose tuple is approved (I8)."""
    if ctx.versions is None:
        return None
    return await ctx.versions.objection(ctx.request)


async def pinned_identity(ctx: GrantContext) -> LeaseRefusal | None:
    """A job pinned to an identity goes only to the worker that owns it."""
    req = ctx.request
    if req.pin_identity and req.pin_identity != req.identity:
        return LeaseRefusal(
            reason="wrong-identity",
            # Another worker owns the identity; give it the job quickly.
            retry_after_s=0.0,
            detail=f"job is pinned to identity {req.pin_identity}, worker has "
            f"{req.identity or 'none'}",
        )
    return None


async def pinned_region(ctx: GrantContext) -> LeaseRefusal | None:
    """A job pinned to a region goes only to a worker of that region (``worker.region``,
    or its identity's)."""
    req = ctx.request
    if req.pin_region and req.pin_region != req.region:
        return LeaseRefusal(
            reason="wrong-region",
            # Another worker may be of the region; give it the job quickly.
            retry_after_s=0.0,
            detail=f"job is pinned to region {req.pin_region}, worker is in "
            f"{req.region or 'no region'}",
        )
    return None


async def outside_window(ctx: GrantContext) -> LeaseRefusal | None:
    """The target declares an activity window (``active_hours``, ``active_days``,
    ``timezone``) and the NATS server's now is outside it: no grant, for any worker.
    ``retry_after_s`` is the time until it opens, at most ``WINDOW_RETRY_S``;
    ``opens_in_s`` the whole of it, so the job itself may stay away until then."""
    req = ctx.request
    target = ctx.settings.targets[req.target]
    window = window_of(target.active_hours, target.active_days, target.timezone)
    if window is None:
        return None
    now = await ctx.clock.now() if ctx.clock is not None else None
    if now is None:
        return LeaseRefusal(
            reason="outside-window",
            retry_after_s=CLOCK_UNKNOWN_RETRY_S,
            detail=f"{req.target} has an activity window and the NATS server's time "
            "cannot be read now: nothing is granted until it can",
        )
    opens_in = window.opens_in_s(now)
    if opens_in <= 0:
        return None
    return LeaseRefusal(
        reason="outside-window",
        retry_after_s=min(opens_in, WINDOW_RETRY_S),
        opens_in_s=opens_in,
        detail=f"{req.target} is outside its activity window "
        f"(targets.{req.target}.active_hours): it opens in {opens_in:.0f} s by the NATS "
        "server's clock",
    )


async def avoided(ctx: GrantContext) -> LeaseRefusal | None:
    """The worker or its identity is on the job's avoid list (the target refused the job
    there, or it was quarantined while running it), and someone else could take it:
    ``refused: avoided``, about the job, not the target (services/leaser/avoid_check.py)."""
    if ctx.avoid is None:
        return None
    return await ctx.avoid.objection(ctx.request, ctx.history)


async def in_flight_cap(ctx: GrantContext) -> LeaseRefusal | None:
    """Take one of the target's ``max_in_flight`` places (in Redis: they count across
    its tiers and partition), or refuse. After every reading check, so a place is only
    taken for a grant nothing else objects to."""
    req = ctx.request
    cap = ctx.settings.targets[req.target].max_in_flight
    try:
        taken = await ctx.places.take(req.target, req.job_id, cap)
    except CapsUnavailable as exc:
        return LeaseRefusal(
            reason="caps-unavailable",
            retry_after_s=CAPS_UNAVAILABLE_RETRY_S,
            detail=f"the in-flight cap of {req.target} cannot be checked ({exc})",
        )
    if taken != "full":
        ctx.took_place[0] = taken == "taken"
        return None
    return LeaseRefusal(
        reason="target-busy",
        retry_after_s=TARGET_BUSY_RETRY_S,
        detail=f"{req.target} has {cap} jobs in flight (targets.{req.target}.max_in_flight)",
    )


async def subnet_exclusive(ctx: GrantContext) -> LeaseRefusal | None:
    """No two workers of one egress subnet serve a target at once: hold the target for
    the worker's subnet (``LeaseRequest.subnet``; none declared, no constraint) with
    this job, or refuse ``subnet-busy`` while another worker of the subnet holds a lease
    of it (jetfleet/subnet_holds.py). After ``in_flight_cap``: a refusal frees the place
    it took."""
    req = ctx.request
    if not req.subnet:
        return None
    try:
        subnet = canonical_subnet(req.subnet)
    except ValueError as exc:
        await _free_place(ctx)
        return LeaseRefusal(
            reason="malformed-request",
            detail=f"$.subnet: {exc}: send a network such as 10.1.0.0/24 (worker.subnet)",
        )
    try:
        held = await ctx.places.hold_subnet(req.target, req.job_id, req.worker, subnet)
    except CapsUnavailable as exc:
        await _free_place(ctx)
        return LeaseRefusal(
            reason="caps-unavailable",
            retry_after_s=CAPS_UNAVAILABLE_RETRY_S,
            detail=f"the subnet hold on {req.target} cannot be checked ({exc})",
        )
    if isinstance(held, str):
        ctx.took_subnet.append(subnet)
        ctx.new_subnet_hold[0] = held == "taken"
        return None
    await _free_place(ctx)
    if held == OWN_ONLY:
        recovering = ctx.places.recovering_s(req.target, subnet)
        return LeaseRefusal(
            reason="subnet-busy",
            retry_after_s=SUBNET_BUSY_RETRY_S,
            detail=f"Redis was unreachable lately: for {recovering:.0f} s "
            f"more {req.target} is held for subnet {subnet} only by a worker whose running "
            "jobs renew their holds (one worker per subnet and target)",
        )
    return LeaseRefusal(
        reason="subnet-busy",
        retry_after_s=SUBNET_BUSY_RETRY_S,
        detail=f"another worker of subnet {subnet} serves {req.target} now (its hold "
        f"lasts {held:.0f} s more unless it leases again): one worker per subnet and target",
    )


async def free_taken(ctx: GrantContext) -> None:
    """Free what the taking checks took for this ask (it led to no lease)."""
    await _free_place(ctx)
    req = ctx.request
    if ctx.new_subnet_hold[0]:
        for subnet in ctx.took_subnet:
            await ctx.places.unhold_subnet(req.target, req.job_id, req.worker, subnet)
    ctx.took_subnet.clear()
    ctx.new_subnet_hold[0] = False
    if ctx.probe[0] and ctx.breakers is not None:
        # The probe this ask took (its revision: one taken since is another's).
        await ctx.breakers.free_probe_at(req.target, ctx.probe[0])
        ctx.probe[0] = 0


async def _free_place(ctx: GrantContext) -> None:
    if ctx.took_place[0]:
        await ctx.places.free_place(ctx.request.target, ctx.request.job_id)
        ctx.took_place[0] = False


async def rate_permit(ctx: GrantContext) -> LeaseRefusal | None:
    """The permit of the request this grant leads to, for a worker that asks the leaser
    to take it (``sends_request`` true: what workers sent before they took their permits
    themselves, just before the request). Such a worker sends nothing without it, so
    during a rolling upgrade every request still pays for exactly one permit: a current
    worker sends ``sends_request`` false and asks the ratelimit service itself. Last, so
    no permit is spent on a grant something else refuses; a refusal frees the place the
    grant took. To be removed once no worker older than the move is left."""
    req = ctx.request
    if not req.sends_request:
        return None
    reply = await ctx.permits.permit(
        PermitRequest(
            target=req.target, worker=req.worker, identity=req.identity, egress=req.egress
        )
    )
    if isinstance(reply, PermitAllowed):
        return None
    await free_taken(ctx)
    if isinstance(reply, PermitWait):
        return LeaseRefusal(
            reason="target-held" if reply.limit == "hold" else "rate-limited",
            retry_after_s=reply.retry_after_s,
            detail=reply.detail,
        )
    return LeaseRefusal(
        reason=RATELIMIT_UNAVAILABLE,
        retry_after_s=reply.retry_after_s,
        detail=f"no rate permit for {req.target} ({reply.reason}: {reply.detail})",
    )


# settled first: the job's own decision is the most final answer, so a job dead-lettered
# (its term lost) whose key another job has since committed ends dead only, not also as
# that commit's duplicate. Every dead letter is sealed before it is written, so the seal
# answers for it; there is no read of JF_DLQ per grant (a seal landing after the history
# read makes record_grant's compare-and-set fail, and the grant then answers the seal).
ASKING_CHECKS: tuple[GrantCheck, ...] = (settled, already_done)
"""Read-only checks that ask the server: they run at once."""
LOCAL_CHECKS: tuple[GrantCheck, ...] = (
    paused,
    outside_window,
    version_not_approved,
    quarantined,
    circuit_open,
    pinned_identity,
    pinned_region,
    avoided,
)
"""Read-only checks answered from memory (the quarantine and breaker watches; a read only
for a scope or target they know of) or from the history read already (``avoided``): run
in line, since a task each would cost more than the check."""
TAKING_CHECKS: tuple[GrantCheck, ...] = (
    in_flight_cap,
    subnet_exclusive,
    circuit_probe,
    rate_permit,
)
GRANT_CHECKS: tuple[GrantCheck, ...] = ASKING_CHECKS + LOCAL_CHECKS + TAKING_CHECKS


async def first_objection(ctx: GrantContext) -> LeaseRefusal | LeaseAlreadyDone | None:
    """The first objection of the reading checks (asking, then local), or None. The
    leaser then looks for a live lease, and only then runs ``taking_objection``."""
    # The first asking check runs in this task, the others beside it.
    others = [asyncio.ensure_future(check(ctx)) for check in ASKING_CHECKS[1:]]
    try:
        verdicts = [await ASKING_CHECKS[0](ctx)]
        verdicts += [await task for task in others]
    finally:
        for task in others:
            task.cancel()
    for verdict in verdicts:
        if verdict is not None:
            return verdict
    for check in LOCAL_CHECKS:
        verdict = await check(ctx)
        if verdict is not None:
            return verdict
    return None


async def taking_objection(ctx: GrantContext) -> LeaseRefusal | None:
    """The first objection of the taking checks (a place, then a permit), or None."""
    for check in TAKING_CHECKS:
        verdict = await check(ctx)
        if verdict is not None:
            return verdict  # type: ignore[return-value]
    return None
