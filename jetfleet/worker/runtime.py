"""The worker: pull loops per work lane (a target's own consumers, or a partition's
shared ones: jetfleet/work_lanes.py), a bounded number of jobs at once per lane.

Life of a delivery (docs/architecture.md): decode the work order, take the job's lease,
run the handler while the lease is renewed (leaser renew + ``in_progress`` in one beat),
publish the outcome, report to the sink, and only then ack (committed or suppressed),
terminate (dead-lettered) or, having given the lease back, nak with backoff (retryable).
Acks and terms are confirmed by the server and sent again while unconfirmed, off the
job's path (jetfleet/worker/settle_confirm.py): one sent while the consumer elects a
leader is not lost.
A worker that lost its lease touches the message no more: JetStream would honour an ack,
nak or term from a superseded delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import aiohttp
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from jetfleet import subjects, tracing
from jetfleet.attempt_history import record_of
from jetfleet.backoff import Backoff
from jetfleet.bounded_fetch import fetch_at_most, take_queued
from jetfleet.errors import (
    Blocked,
    JetfleetError,
    NotSent,
    PermanentFailure,
    RetryLater,
    SubmitError,
)
from jetfleet.identity_presence import IdentityClaim, IdentityPresence
from jetfleet.js_errors import is_unavailable
from jetfleet.last_hand_back import note_last_hand_back
from jetfleet.lease_client import LeaseClient, is_busy
from jetfleet.metrics import CounterFamily, HistogramFamily, MetricFamily
from jetfleet.outcome_events import JOB_HEADER
from jetfleet.permit_client import PermitClient
from jetfleet.presence_writer import LeaserPresenceWriter
from jetfleet.publish import publish_durably
from jetfleet.region_presence import RegionPresence
from jetfleet.retry import RetryPolicy
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    HandlerOutput,
    Outcome,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.lease import (
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    LeaseReply,
    LeaseRequest,
)
from jetfleet.schemas.permit import (
    HoldPlaced,
    HoldRequest,
    PermitAllowed,
    PermitRefused,
    PermitRequest,
    PermitWait,
)
from jetfleet.schemas.report import MAX_DECODE_ERROR_CHARS, Malformed
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings, owned_identity, with_identity
from jetfleet.task_stop import raise_if_cancel_dropped, stop_task
from jetfleet.unrunnable_orders import unrunnable
from jetfleet.version_tuple import local_tuple, with_handler
from jetfleet.work_lanes import LaneMap, WorkLane
from jetfleet.worker import attempt_spans
from jetfleet.worker import builtin as _builtin  # noqa: F401  (registers built-in handlers)
from jetfleet.worker.ack_timer import AckTimer
from jetfleet.worker.attempt_deadline import AttemptDeadline
from jetfleet.worker.browser_contexts import BrowserContexts
from jetfleet.worker.browser_executable import chromium_path
from jetfleet.worker.browser_page import HANDLER as BROWSER_HANDLER
from jetfleet.worker.browser_page import NO_BROWSER
from jetfleet.worker.failed_here import FailedHere
from jetfleet.worker.hand_back_pace import HandBackPace
from jetfleet.worker.handlers import (
    HandlerContext,
    HandlerFn,
    ReadyFn,
    get_handler,
    permits_when_ready,
    requests_target,
)
from jetfleet.worker.identity_cookies import IdentityCookies
from jetfleet.worker.manners import start_warnings
from jetfleet.worker.ok_outcomes import OkOutcomeBatches
from jetfleet.worker.rate_pacing import RatePacing
from jetfleet.worker.result_objects import RESULT_TOO_LARGE, ResultObjects
from jetfleet.worker.retry_after import BoundedWait
from jetfleet.worker.robots import RobotsAllowed, RobotsBook, RobotsDisallowed, RobotsNotYet
from jetfleet.worker.settle_confirm import SettleConfirmations
from jetfleet.worker.slot_lending import SlotLending, standby_lanes
from jetfleet.worker.target_gate import TargetGate
from jetfleet.worker.target_holds import TargetHolds
from jetfleet.worker.target_scope import OUTSIDE_TARGET, job_outside_target
from jetfleet.worker.tier_slots import TierSlots
from jetfleet.worker.verdict import Held, Verdict, fit_reason, target_answered
from jetfleet.worker.worker_names import check_worker_names

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_order_decoder = msgspec.json.Decoder(WorkOrder)
_reply_decoder = msgspec.json.Decoder(SinkReply)
_encoder = msgspec.json.Encoder()
OUTPUT_UNENCODABLE = "output-unencodable"
"""A handler returned what no JSON encoder can write (a lone surrogate, an object)."""
FETCH_BATCH = 10
# How long a fetched message may wait for a slot before it is handed back.
SLOT_WAIT_S = 0.5
SINK_TIMEOUT_S = 5.0
# A malformed-order report's fields beside its bytes (worker id, subject, error, JSON).
MALFORMED_ROOM_BYTES = 4096
OUTCOME_TIMEOUT_S = 2.0
RECORDS_IN_FLIGHT = 64
"""Releases sent in the background only to put an attempt's record in its job's history
(``_send_record``) at once at most: past that, a record is dropped (logged), so a
leaser outage cannot pile up tasks."""
RECORD_TRIES = 3
"""Asks of such a release while the leaser does not answer (a repeat is harmless: the
entry keeps one record per fence)."""
RECORD_DRAIN_S = 1.0
"""How long a drain waits for those releases, after the jobs, before cancelling them."""
CLAIM_WAIT_S = 30.0
"""How long a starting worker waits for a leaser to write its identity claim (one started
beside the leaser must not die because it asked first); then it refuses to start."""
OPEN_WAIT_S = 60.0
"""How long a starting worker waits for JetStream to answer for its result bucket."""
# Refusals that concern the whole target for this worker: stop pulling it until then.
TARGET_WIDE_REFUSALS = frozenset(
    {
        "quarantined",
        "paused",
        "rate-limited",
        "target-held",
        "ratelimit-unavailable",
        "outside-window",
        "version-not-approved",
        "caps-unavailable",
        "subnet-busy",
        "circuit-open",
        "circuit-probing",
    }
)
# Of those, the ones about this worker or its identity only (the others may run the job):
# its jobs go back at a flat pace, not one growing with their deliveries.
WORKER_SCOPED_REFUSALS = frozenset({"quarantined", "version-not-approved", "subnet-busy"})
# A ``paused`` refusal of these scopes is about this worker only (its region, its id, its
# identity): its jobs go back flat for the other workers. A fleet or target pause holds
# the whole target for everyone (docs/pause.md).
WORKER_SCOPED_PAUSES = frozenset({"region", "worker", "identity"})
# Blocks that are about this worker's identity (or the worker), not the whole target: the
# job goes on to someone else (the avoid list, docs/leases.md#the-avoid-list). A 429 is
# the target's load, the same for everyone: no.
AVOID_BLOCKS = frozenset({"challenged", "blocked"})
AVOIDED = "avoided"
# Refusals whose retry-after is the moment the target's next permit frees.
RATE_REFUSALS = frozenset({"rate-limited", "target-held"})
MIN_RATE_WAIT_S = 0.01
# The longest a redirect hop waits for its permit inside a running attempt.
HOP_PERMIT_PATIENCE_S = 2.0
# How long drain waits, beyond fleet.long_poll_s (a fetch in flight ends within it), for
# the pull loops to notice it before cancelling them.
LOOP_STOP_MARGIN_S = 1.0
# How long after its expiry a pull request is taken as over (its last answer read).
PULL_END_MARGIN_S = 0.05
# A job of a target this worker's settings do not declare (a newer config elsewhere).
UNKNOWN_TARGET_DELAY_S = 5.0
MIN_REFUSAL_DELAY_S = 0.25
# The longest a partitioned target's job is handed back for (see _hand_back_delay).
HAND_BACK_MAX_S = 2.0
# Deliveries a job pinned to another identity is handed back with a growing delay (about
# 10 s in all), time for a worker owning the identity to take it, even one starting.
# After that, if no running worker owns the identity (jetfleet/identity_presence.py), it
# goes back at once without asking the leaser, so it uses up the consumer's max_deliver
# (the backstop) in moments and leaves the pending window to runnable jobs. A job whose
# owner is running but busy keeps the growing delay and waits for it.
PINNED_PATIENCE = 8
# The refusals of a pinned job by a worker not its pin's, and what its hand-back is called
# once its pin's owner is known to run and so is only busy (not no-eligible-worker).
PIN_REFUSALS = {"wrong-identity": "identity-busy", "wrong-region": "region-busy"}
# The longest this worker leaves a target alone for another worker of its subnet.
SUBNET_BUSY_MAX_S = 30.0
# A job refused outside its target's activity window returns within this many seconds
# after the window opens (spread, so a backlog does not all ask at the opening instant).
WINDOW_SPREAD_S = 2.0
# How long a retry handed back for another worker stays away (jittered, so jobs handed
# back together do not return together into one worker's batch fetch).
RETRY_ELSEWHERE_S = 0.5
# How often a lane held while the identity's claim is unsure looks again.
CLAIM_HOLD_S = 0.25


class Worker:
    """Pulls jobs of its targets and runs them; ``drain()`` stops it gracefully."""

    def __init__(
        self,
        settings: Settings,
        nc: NatsClient,
        worker_id: str,
        targets: Iterable[str] = (),
        identity: str = "",
    ) -> None:
        # The identity's region and egress fill the worker's where it sets none; a
        # declared identity of another region (or an undeclared one) is refused here,
        # for --identity as for worker.identity.
        # Names first: an identity with a control character is refused as such, not as
        # one that is not declared.
        check_worker_names(worker_id, identity, settings.worker.region, settings.worker.egress)
        declared = owned_identity(settings, identity)
        settings = with_identity(settings, identity)
        # Again with the region and egress the identity brought.
        check_worker_names(worker_id, identity, settings.worker.region, settings.worker.egress)
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.worker_id = worker_id
        self.identity = identity
        # Built once: what is installed and configured does not change while it runs.
        self.version_tuple = local_tuple(settings)
        self.lane_map = LaneMap(settings)
        # A partition's consumer carries all its members: a worker pulling it serves them.
        self.lanes: tuple[WorkLane, ...] = self.lane_map.lanes_for(
            tuple(targets) or tuple(settings.targets)
        )
        # Pulled only with slots lent by held lanes: none of their own.
        self.standby = standby_lanes(
            self.lane_map, self.lanes, settings.worker.standby_targets, every=not tuple(targets)
        )
        self.lanes += self.standby
        self.targets = tuple(t for lane in self.lanes for t in lane.targets)
        self.policy = RetryPolicy.from_settings(settings.fleet)
        self.leases = LeaseClient(nc)
        self.permits = PermitClient(nc)
        self.stats: Counter[str] = Counter()
        self.settles = SettleConfirmations(nc, self.stats)
        """Acks and terms, each confirmed by the server off the job's path."""
        self.ok_outcomes = OkOutcomeBatches(nc)
        """``ok`` outcome events, sent a batch per target (failures go one by one)."""
        self.attempts = CounterFamily(
            "jetfleet_worker_attempts_total",
            "Attempts by worker, identity, target, handler version, version tuple id, "
            "outcome (ok, retryable, permanent, blocked, unrun) and reason",
        )
        self.lease_latency = HistogramFamily(
            "jetfleet_worker_lease_seconds",
            "Seconds a lease grant or renewal took, asked by this worker, by worker, target, "
            "op (grant, renew) and answer (granted, refused, busy, unanswered)",
        )
        self.permit_waits = CounterFamily(
            "jetfleet_worker_permit_waits_total",
            "Permit asks answered wait (or refused) instead of allowed, by worker, target and "
            "answer",
        )
        self.hand_backs = CounterFamily(
            "jetfleet_worker_hand_backs_total",
            "Jobs handed back unrun by worker, target and reason (held, a lease refusal, "
            "no slot, retry elsewhere)",
        )
        self.holds = TargetHolds(worker_id)
        self.metrics: list[MetricFamily] = [
            self.attempts,
            self.hand_backs,
            self.lease_latency,
            self.permit_waits,
            self.holds.asked,
            self.holds.count,
        ]
        # Slots per lane: a target that hangs can fill only its lane's, never another's.
        self._slots = {
            lane.name: TierSlots(
                0 if lane in self.standby else settings.worker.concurrency,
                settings.worker.tier_shares,
                subjects.TIERS,
            )
            for lane in self.lanes
        }
        # ... but a lane whose targets are all held lends its slots to lanes with a backlog.
        self.lending = SlotLending(
            worker_id,
            self.lanes,
            self._slots,
            may_borrow=lambda lane: not self.rate_pacing.is_bound(lane.targets),
        )
        self.metrics += self.lending.metrics
        self._tasks: set[asyncio.Task[None]] = set()
        # History-only releases (_send_record): outside _tasks, so no job waits on them.
        self._records: set[asyncio.Task[None]] = set()
        self._subnet_busy: dict[str, int] = {}  # subnet-busy refusals in a row, by target
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.quit = asyncio.Event()
        """Set when the worker stops by itself (it lost its identity): drain it then."""
        self.gate = TargetGate()
        self.rate_pacing = RatePacing()
        self.pace = HandBackPace(settings)
        self._failed_here = FailedHere()
        self._deadline = AttemptDeadline()
        self.clock = ServerClock(nc)
        # No KV rights of its own: its presence is written by the leaser, on jf.presence
        # (docs/identities.md#who-writes-what).
        self.presence_writer = LeaserPresenceWriter(nc)
        self.identities = IdentityPresence(self.js, self.clock, self.presence_writer)
        self.regions = RegionPresence(self.js, self.presence_writer)
        self._announcing: asyncio.Task[None] | None = None
        self.claim: IdentityClaim | None = None
        self._claiming: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[Verdict]] = set()
        """Handlers running now: cancelled when the identity's claim stops being sure."""
        self.cookies = IdentityCookies(identity, declared.state_dir if declared else "")
        self._session: aiohttp.ClientSession | None = None
        self._objects: ResultObjects | None = None
        self._robots: RobotsBook | None = None
        self.browser: BrowserContexts | None = None
        """Its browser contexts when it runs ``browser.page`` (``worker.browser``)."""
        if settings.worker.browser.enabled:
            # The tuple above found (and asked) it already: a missing one refused there.
            self.browser = BrowserContexts(
                settings.worker.browser,
                chromium_path(settings.worker.browser),
                worker_id,
                settings.fleet.user_agent,
            )

    async def start(self) -> None:
        """Check the result caps against the server, bind to each lane's durable
        consumers and start pulling.

        Raises:
            ConfigError: a result with an inline body could exceed the server's max_payload.
            IdentityOwned: another live worker owns this worker's identity.
        """
        self._objects = await self._open_result_objects()
        if self.identity:
            # Before anything of the identity is used: a second owner never starts.
            self.claim = await self._first_claim(self.identity)
            self._claiming = asyncio.create_task(self._keep_claim(self.claim))
        self.cookies.load()
        if self.settings.worker.region:
            # So workers elsewhere know a job pinned to this region has somebody to wait for.
            self._announcing = asyncio.create_task(
                self.regions.announce(self.settings.worker.region, self.settings.worker.claim_ttl_s)
            )
        if not self.settings.fleet.leases:
            log.warning(
                "fleet.leases = false: no lease and no fence for any job (rate permits are "
                "still taken); "
                "a benchmark baseline only, never for traffic to a real target"
            )
        concurrency = self.settings.worker.concurrency
        self._session = aiohttp.ClientSession(
            # Room for every lane's slots, so a lane that hangs cannot take the others'
            # connections.
            connector=aiohttp.TCPConnector(limit=concurrency * (len(self.lanes) + 1)),
            cookie_jar=self.cookies.jar,
            trace_configs=[tracing.http_trace_config()],
        )
        self._robots = RobotsBook(
            self.settings,
            self.js,
            self.permits,
            self._session,
            self.worker_id,
            self.identity,
            self.presence_writer,
        )
        if self.browser is not None:
            # Opened now, not by the first job after its permit: a launch (a second or
            # more) must not eat into an attempt's budget with the target's permit spent.
            await self.browser.acquire(self.identity)
            self.browser.release(self.identity)
        for line in start_warnings(self.settings, self.targets):
            log.warning("worker %s: %s", self.worker_id, line)
        for lane in self.lanes:
            for tier in subjects.TIERS:
                self._loops.append(asyncio.create_task(self._pull_loop(lane, tier)))
        log.info(
            "worker %s pulling %s",
            self.worker_id,
            ", ".join(
                (f"{lane.name} ({', '.join(lane.targets)})" if lane.shared else lane.name)
                + (" (standby: lent slots only)" if lane in self.standby else "")
                for lane in self.lanes
            ),
        )

    async def _open_result_objects(self) -> ResultObjects:
        """The result bucket, waiting up to ``OPEN_WAIT_S`` while JetStream does not
        answer: a worker started while a cluster node is down or just back may ask while
        the bucket's stream elects a leader, and must come up all the same.

        Raises:
            ConfigError: see ``ResultObjects.open``.
            Exception: what kept it from opening, once the wait is over.
        """

        def warn(exc: Exception) -> None:
            log.warning(
                "worker %s cannot open the result bucket yet (%s); waiting up to "
                "%g s for JetStream to answer",
                self.worker_id,
                type(exc).__name__,
                OPEN_WAIT_S,
            )

        return await _while_unavailable(
            lambda: ResultObjects.open(self.js, self.settings, self.nc.max_payload),
            OPEN_WAIT_S,
            warn,
        )

    async def _first_claim(self, identity: str) -> IdentityClaim:
        """Claim ``identity``, waiting up to ``CLAIM_WAIT_S`` for a leaser to answer.

        Raises:
            IdentityOwned: another live worker owns it.
            Exception: what kept the claim from being written, once the wait is over.
        """
        ttl_s = self.settings.worker.claim_ttl_s

        def warn(exc: Exception) -> None:
            log.warning(
                "worker %s cannot claim identity %s yet (%s): no leaser answers "
                "%s; waiting up to %g s for one (start `jetfleet serve leaser`)",
                self.worker_id,
                identity,
                type(exc).__name__,
                subjects.PRESENCE,
                CLAIM_WAIT_S,
            )

        # IdentityOwned is an answer, not unavailability: it is raised at once.
        return await _while_unavailable(
            lambda: self.identities.claim(identity, self.worker_id, ttl_s), CLAIM_WAIT_S, warn
        )

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop pulling, let in-flight jobs finish (release them after ``timeout_s``)."""
        self._stopping.set()
        if self._loops:
            # A loop queued for a slot waits for a job to end; those jobs are waited for
            # (and cancelled) below, so the loops need not be.
            stop_s = self.settings.fleet.long_poll_s + LOOP_STOP_MARGIN_S
            _, waiting = await asyncio.wait(self._loops, timeout=stop_s)
            for loop in waiting:
                loop.cancel()
            await asyncio.gather(*self._loops, return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()  # _process gives a cancelled job back so it is retried now
            await asyncio.gather(*pending, return_exceptions=True)
        if self._records:
            # Only history: a short wait, then cancelled (the record is lost, logged).
            _, unsent = await asyncio.wait(self._records, timeout=RECORD_DRAIN_S)
            for task in unsent:
                task.cancel()
            await asyncio.gather(*unsent, return_exceptions=True)
        # The last jobs' ok events, then their acks, confirmed before the connection
        # closes (a lost ack only makes the job wait out its ack wait: the wait is short).
        await self.ok_outcomes.drain()
        await self.settles.drain()
        if self._announcing is not None:
            # Not deleted: other workers of the region may share the key; it lapses.
            with contextlib.suppress(Exception):
                await _stop(self._announcing)
        if self._claiming is not None:
            # An error it somehow died of must not fail the drain and skip the rest.
            with contextlib.suppress(Exception):
                await _stop(self._claiming)
        if self.claim is None or self.claim.live():
            try:
                self.cookies.save()
            except OSError as exc:
                log.warning("cookies of identity %s not saved: %s", self.identity, exc)
        else:
            # Lost, or not surely ours: another worker may own the identity now, its
            # state folder and all, and its jar there is newer than this one.
            log.warning(
                "cookies of identity %s not saved: its claim is not surely this worker's",
                self.identity,
            )
        if self.claim is not None:
            # Released once nothing uses the identity any more: a successor may start now.
            await self.identities.release(self.claim)
        if self.browser is not None:
            # After the jobs: no page is closed under a running one.
            await self.browser.close()
        if self._session is not None:
            await self._session.close()

    async def _keep_claim(self, claim: IdentityClaim) -> None:
        """Renew the identity's claim (stopping the handlers whenever it goes unconfirmed
        past the time it surely lives); once it is lost (another worker holds the
        identity, the claim lapsed, it stayed unconfirmed too long, or renewing it
        died), stop taking jobs and cancel the
        running ones at once: each goes back with its attempt refunded, and none goes on
        using an identity another worker may be using already."""
        try:
            await self.identities.keep(claim, self._stop_handlers)
        except Exception:
            # Nothing renews the claim now: it lapses while the identity would still be
            # used, and another worker may claim it.
            log.exception("renewing the claim on identity %s died", self.identity)
            claim.lost.set()
        if claim.lost.is_set():
            log.error(
                "worker %s no longer owns identity %s: it takes no more jobs and stops "
                "those running",
                self.worker_id,
                self.identity,
            )
            self._stopping.set()
            self.quit.set()
            for task in list(self._tasks):
                task.cancel()  # _process_order hands a cancelled job back, refunded

    def _stop_handlers(self) -> None:
        """The claim is no longer surely ours: no handler goes on using the identity
        (each job goes back refunded, as at a drain). The lanes fetch nothing meanwhile
        (``_held_off``)."""
        for handler in list(self._handlers):
            handler.cancel()

    async def _pull_loop(self, lane: WorkLane, tier: str) -> None:
        """Pull one (lane, tier).

        Take slots (queueing in priority order when they are all busy), fetch what is
        there at once and start it. When the tier has nothing, give the slots back and
        long-poll for one job without a slot, then take a slot for it. An idle tier so
        holds no slot (bulk may borrow them all), a busy worker hoards no message, and a
        waiting high-priority tier gets the next slot that frees.
        """
        sub = None
        slots = self._slots[lane.name]
        clock = asyncio.get_running_loop()
        open_until = 0.0  # when the last pull request sent may still deliver until
        try:
            while not self._stopping.is_set():
                try:
                    if await self._held_off(lane, sub):
                        continue
                    if sub is None:
                        sub = await self.js.pull_subscribe_bind(
                            lane.consumer(tier), stream=subjects.STREAM_WORK
                        )
                    paced = self.rate_pacing.is_bound(lane.targets)
                    batch = 1 if paced else FETCH_BATCH
                    self.lending.top_up(lane.name, batch)
                    if slots.contended():
                        # Busy: queue for the next freed slot, highest priority first.
                        taken = await self._acquire(slots, tier, batch, sub)
                    else:
                        taken = slots.try_acquire(tier, batch)
                    if self._stopping.is_set():
                        slots.release(tier, taken)
                        break
                    if taken:
                        open_until = max(open_until, clock.time() + 0.1)
                    if taken and await self._fetch_into(sub, slots, lane, tier, taken, 0.1):
                        if paced:
                            # One permit question at a time for a rate-bound target: its
                            # answer (and the hold it sets) decides when to fetch again.
                            await self.rate_pacing.wait_answers(lane.targets)
                        continue
                    # Nothing for this tier now: wait for one job without holding a slot,
                    # so an idle tier never keeps slots another tier could use.
                    long_poll_s = self.settings.fleet.long_poll_s
                    open_until = max(open_until, clock.time() + long_poll_s)
                    for msg in await fetch_at_most(sub, 1, long_poll_s):
                        if await self._wait_for_slot(slots, tier):
                            self._start_job(msg, lane, tier)
                            if paced:
                                # As after _fetch_into: one permit question at a time.
                                await self.rate_pacing.wait_answers(lane.targets)
                        else:
                            # Every slot stays busy: hand it to another worker at once.
                            await self._hand_back(msg, subjects.target_of(msg.subject), "no-slot")
                except Exception:  # keep pulling through reconnects and leader changes
                    log.exception("pull loop for %s/%s failed; rebinding", lane.name, tier)
                    if sub is not None:
                        await self._last_sweep(sub, open_until)
                        with contextlib.suppress(Exception):
                            await sub.unsubscribe()
                    sub = None
                    await self._pause(1.0)
        finally:
            if sub is not None:
                await self._last_sweep(sub, open_until)

    async def _acquire(
        self,
        slots: TierSlots,
        tier: str,
        batch: int,
        sub: JetStreamContext.PullSubscription | None,
    ) -> int:
        """Queue for a slot, as long as it takes; meanwhile hand back, every
        ``SLOT_WAIT_S``, what late pull answers leave in the subscription's queue: they
        would wait behind the busy slots (a hanging target: minutes), past their ack wait."""
        waiting = asyncio.ensure_future(slots.acquire(tier, batch))
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=SLOT_WAIT_S)
                if done:
                    return waiting.result()
                if sub is not None:
                    await self._hand_back_queued(sub)
        except BaseException:
            waiting.cancel()  # TierSlots gives back a slot granted to a cancelled wait
            with contextlib.suppress(asyncio.CancelledError):
                if (got := await waiting) > 0:
                    slots.release(tier, got)  # taken as it was cancelled: not ours to keep
            raise

    async def _hand_back_queued(
        self, sub: JetStreamContext.PullSubscription, held: bool = False
    ) -> None:
        """Hand back what waits in the subscription's queue, delivered by a pull request
        answered after its fetch gave up (jetfleet/bounded_fetch.py), when no fetch is
        about to take it: not left to its ack wait. One at a time, so a cancel between
        two leaves the rest queued for the loop's last sweep. ``held``: the lane is held
        (``_held_off``), so each goes back as a held job would, with its paced delay."""
        while msgs := take_queued(sub, 1):
            [msg] = msgs
            target = subjects.target_of(msg.subject)
            with contextlib.suppress(Exception):
                if not held:
                    await self._hand_back(msg, target, "no-slot")
                else:
                    wait = self.gate.held_for(target)
                    delay = self._hand_back_delay(msg, target, wait)
                    await self._hand_back(msg, target, "held", delay)

    async def _last_sweep(self, sub: JetStreamContext.PullSubscription, open_until: float) -> None:
        """Before a subscription is left (the loop ends or rebinds): wait until the last
        pull request it sent has surely ended (at most ``fleet.long_poll_s``, within the
        drain's wait for the loops), then hand back what it delivered that no fetch took."""
        left = open_until - asyncio.get_running_loop().time()
        if left > 0:
            await asyncio.sleep(min(left, self.settings.fleet.long_poll_s) + PULL_END_MARGIN_S)
        await self._hand_back_queued(sub)

    async def _fetch_into(
        self,
        sub: JetStreamContext.PullSubscription,
        slots: TierSlots,
        lane: WorkLane,
        tier: str,
        taken: int,
        wait_s: float,
    ) -> bool:
        """Fetch up to ``taken`` jobs into slots already held; False if none came."""
        try:
            msgs = await fetch_at_most(sub, taken, wait_s)
        except BaseException:
            slots.release(tier, taken)  # a failed fetch must not leak slots
            raise
        slots.release(tier, taken - len(msgs))
        for msg in msgs:
            self._start_job(msg, lane, tier)
        return bool(msgs)

    async def _wait_for_slot(self, slots: TierSlots, tier: str) -> bool:
        """Queue for a slot (freed slots go to waiters in priority order), but only
        briefly: a worker whose slots stay busy must not sit on a message others could
        run."""
        waiting = asyncio.ensure_future(slots.acquire(tier, 1))
        done, _ = await asyncio.wait({waiting}, timeout=SLOT_WAIT_S)
        if done:
            return True
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting  # TierSlots gives the slot back if it was granted meanwhile
        return False

    async def _hand_back(
        self, msg: Msg, target: str, reason: str, delay: float | None = None
    ) -> None:
        """Give a job back unrun (no lease held, nothing spent), and count it: a target
        whose jobs keep coming back shows on ``/metrics``. On the job's last delivery
        the reason is noted for the dead letter the backstop will write."""
        self.hand_backs.inc(worker=self.worker_id, target=target, reason=reason)
        tracing.note("handed-back", reason)
        if (msg.metadata.num_delivered or 0) >= self.settings.fleet.max_deliver:
            job_id = _job_id_of(msg)
            if job_id:
                await note_last_hand_back(self.presence_writer, job_id, reason)
        await msg.nak(delay=delay)

    def _hand_back_delay(self, msg: Msg, target: str, wait: float) -> float:
        """How long a job handed back unrun (held here, its target refused to this
        worker) stays away: ``wait``, and at least its paced hand-back delay, which
        doubles with each delivery (jetfleet/worker/hand_back_pace.py). Every hand-back
        is a delivery, so a job held off for long must not use up ``max_deliver``
        before its max age; and a partitioned target's lane keeps delivering, so the
        churn of a held member's jobs dies down and the consumer moves on to the
        other members' jobs.
        """
        return max(wait, self.pace.growing_s(target, msg.metadata.num_delivered or 1))

    def _elsewhere_delay(self, msg: Msg, target: str) -> float:
        """How long a job refused to this worker alone (its quarantine) stays away: as
        long as a target-busy job, the same for every delivery while it has deliveries
        to spare, so another worker runs it soon. A delay growing with its deliveries
        kept jobs revoked by a quarantine away for minutes (issue 10). This worker
        holds the target meanwhile, so it refuses each job at most once a hold."""
        return self.pace.target_busy_s(target, msg.metadata.num_delivered or 1)

    def _rate_wait_delay(self, msg: Msg, target: str, wait: float) -> float:
        """How long a job handed back for want of a rate permit stays away: ``wait``, and
        at least a target-busy job's (hand_back_pace.py), the same for every delivery
        while it has deliveries to spare, so old jobs keep their share of the permits."""
        return max(wait, self.pace.target_busy_s(target, msg.metadata.num_delivered or 1))

    def _pin_owner_busy_delay(self, msg: Msg, target: str, retry_after: float) -> float:
        """How long a pinned job whose pin's worker runs but is busy stays away, past
        its patience: as a target-busy job, the same short wait for every delivery while
        it has deliveries to spare (so it is back soon when its owner frees a slot),
        then the paced cap (hand_back_pace.py), so it waits up to its max age without
        using up its deliveries. A wait doubling from the patience on kept jobs away
        half a minute after their owner was free again."""
        return max(retry_after, self.pace.target_busy_s(target, msg.metadata.num_delivered or 1))

    def _subnet_busy_wait(self, target: str, retry_after: float) -> float:
        """How long this worker leaves ``target`` alone after ``subnet-busy``: the
        refusal's wait doubled with each refusal in a row (a refusal within the hold,
        from the same fetched batch, is not another), up to SUBNET_BUSY_MAX_S and two
        lease TTLs (the owner's hold ends within one TTL of its last lease). Without it
        a refused worker fetched and handed back the target's jobs every 2 s, keeping
        them from the owner's pending window."""
        streak = self._subnet_busy.get(target, 0)
        if self.gate.held_for(target) <= 0:
            streak = self._subnet_busy[target] = streak + 1
        cap = max(retry_after, min(SUBNET_BUSY_MAX_S, 2 * self.settings.fleet.lease_ttl_s))
        return min(cap, retry_after * 2.0 ** max(0, streak - 1))

    def _growing_delay(self, msg: Msg) -> float:
        """MIN_REFUSAL_DELAY_S doubled with each delivery up to HAND_BACK_MAX_S, jittered."""
        deliveries = min(int(msg.metadata.num_delivered or 1), 16)
        grown = min(HAND_BACK_MAX_S, MIN_REFUSAL_DELAY_S * 2.0 ** (deliveries - 1))
        return grown * random.uniform(0.5, 1.0)

    async def _held_off(
        self, lane: WorkLane, sub: JetStreamContext.PullSubscription | None
    ) -> bool:
        """Whether the lane may not fetch now; then pauses (at most a second), after
        handing back what late pull answers left queued (``_hand_back_queued``)."""
        if self.claim is not None and not self.claim.live():
            # The identity's claim is not surely ours (renewals unconfirmed): fetch
            # nothing until a renewal lands, or the claim is given up (``quit``).
            self.stats["held:identity-unsure"] += 1
            if sub is not None:
                await self._hand_back_queued(sub)
            await self._pause(CLAIM_HOLD_S)
            return True
        # Backpressure: after a target-wide refusal we stop dequeuing that target until
        # the retry-after passes (never dequeue and sleep on a message). A partition is
        # shared, so it stops only when every member is held; a held member's jobs that
        # arrive meanwhile go straight back (``_process``) without a lease or a request.
        wait = min(self.gate.held_for(t) for t in lane.targets)
        self.lending.refresh(lane.name)
        if wait <= 0:
            return False
        if sub is not None:
            await self._hand_back_queued(sub, held=True)
        await self._pause(min(wait, 1.0))
        return True

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_job(self, msg: Msg, lane: WorkLane, tier: str) -> None:
        """Run a fetched delivery (its slot is held) in a task of its own."""
        self.rate_pacing.fetched(msg.reply or "", subjects.target_of(msg.subject))
        self._spawn(self._run_and_release(msg, lane, tier))  # the one place jobs start

    async def _run_and_release(self, msg: Msg, lane: WorkLane, tier: str) -> None:
        try:
            with attempt_spans.delivery_span(
                msg, self.worker_id, self.identity, self.version_tuple.id
            ):
                await self._process(msg, subjects.target_of(msg.subject))
        except _CrashedUntouchable as crash:
            # The same, but its lease was lost or its ack wait ran out first: the
            # delivery may be another worker's now, and a nak would deliver it again.
            log.error(
                "job on %s failed in worker %s after its lease was lost or its ack wait "
                "ran out; left to its ack wait",
                msg.subject,
                self.worker_id,
                exc_info=crash.__cause__,
            )
        except Exception:
            # A bug or a connection lost mid-job: say so, and give the job back rather
            # than leave it to the ack wait (a lease still held makes the next delivery
            # wait for its TTL; a nak after an ack is ignored).
            log.exception("job on %s failed in worker %s", msg.subject, self.worker_id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self.policy.delay_s(msg.metadata.num_delivered or 1))
        finally:
            self._slots[lane.name].release(tier)
            # Ended without asking for a lease (handed back, malformed, ...): answered.
            await self.rate_pacing.answered(msg.reply or "")

    # The one long core path of the worker. Every branch ends in exactly one of: ack,
    # term, nak (only while holding the live lease, or before taking one), or nothing
    # at all because the lease was lost.
    async def _process(self, msg: Msg, target: str) -> None:
        try:
            order = _order_decoder.decode(msg.data)
        except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
            log.error("undecodable work order on %s: %s", msg.subject, exc)
            await self._keep_malformed(msg, target, str(exc))
            return
        attempt_spans.order_read(order)
        objection = unrunnable(order, msg.subject)
        if objection is not None:
            # Another target's order (the sink would refuse its every report), or a key
            # the leaser refuses every lease for: it would be delivered again and again
            # and end nowhere. Not run at all: kept (with the sink's reason), then ended.
            why = objection[1]
            log.error("work order %s refused: %s", order.job.id, why)
            await self._keep_malformed(msg, target, why)
            return
        if target not in self.settings.targets:
            log.warning(
                "job %s is for %s, which this worker's settings do not declare",
                order.job.id,
                target,
            )
            await msg.nak(delay=UNKNOWN_TARGET_DELAY_S)
            return
        unsure = self._identity_unsure(msg, target)
        if unsure is not None:
            # Fetched before the claim stopped being sure (the lanes fetch nothing now):
            # no robots.txt, lease or permit with an identity that may be another's.
            await self._hand_back(msg, target, unsure.reason, unsure.delay_s)
            return
        if self._failed_here.offer_elsewhere(order.job.id, msg.metadata.num_delivered or 0):
            # It failed here last time: give another worker (and identity) the first
            # chance at the retry. If it keeps coming back, it runs here.
            self.stats["deferred-elsewhere"] += 1
            delay = RETRY_ELSEWHERE_S * random.uniform(0.5, 1.5)
            await self._hand_back(msg, target, "retry-elsewhere", delay)
            return
        wait = self.gate.admit(target)
        if (
            wait is not None
            and not self.settings.fleet.leases
            and self.gate.waiting_for_permit(target)
        ):
            # Without leases every delivery is an attempt: a job fetched while the
            # target's next permit is not free waits for it in place (``_first_permit``)
            # rather than spend an attempt going back.
            wait = None
        if wait is not None:
            # The target asked us to back off (maybe after this job was fetched), or a
            # probe is out, or its next permit is not free yet (the rest of a fetched
            # batch): do not call it yet. No lease is taken, so nothing is spent.
            opens_in = self.gate.opens_in(target)
            if opens_in > 0:
                # Its target's window is closed: away until it opens, like the job the
                # leaser refused outside-window, not once a paced hand-back.
                delay = opens_in + random.uniform(0.0, WINDOW_SPREAD_S)
            elif self.gate.waiting_for_permit(target):
                delay = self._rate_wait_delay(msg, target, wait)
            elif self.gate.only_here(target):
                delay = self._elsewhere_delay(msg, target)
            else:
                delay = self._hand_back_delay(msg, target, wait)
            await self._hand_back(msg, target, "held", delay)
            return
        verdict: Verdict | None = None
        try:
            verdict = await self._process_order(msg, order, target)
        finally:
            blocked = verdict is not None and verdict.kind == "blocked"
            self.gate.done(target, answered=target_answered(verdict), blocked=blocked)
            if verdict is not None and verdict.kind == "ok":
                self.holds.answered(target)

    async def _process_order(self, msg: Msg, order: WorkOrder, target: str) -> Verdict | None:
        """Lease, run, report and settle one job; its verdict (None if not leased)."""
        # The lease first, robots.txt after: a target the leaser refuses this worker
        # (outside its window, its breaker open, quarantined, another worker of the
        # subnet on it) gets no robots.txt request either.
        held = await self._take_lease(msg, order, target)
        if held is None:
            return None
        attempt = held.attempt or msg.metadata.num_delivered
        tracing.annotate({tracing.ATTEMPT: attempt, tracing.FENCE: held.fence})
        # Renewals run until just before the ack, nak or term: a report slowed by an
        # election must not outlive the lease, and no +WPI may follow a nak (it would
        # restart the ack wait and so override the nak's delay).
        keeper = asyncio.create_task(self._keep_lease(msg, order, held))
        try:
            try:
                ruled = await self._obey_robots(msg, order, target)
                if ruled is not None and ruled.kind == "unrun":
                    verdict, reply = ruled, None
                else:
                    verdict, reply = await self._run_and_report(msg, order, attempt, held, ruled)
            finally:
                await _stop(keeper)
        except asyncio.CancelledError:
            # Cancelled by a drain: someone else may take it now, and the attempt is
            # refunded, so rolling deploys do not use up jobs' attempt budgets.
            try:
                may_nak = await self._give_back(order, held, refund=True)
            except Exception:
                # The release failed (a connection lost): the cancel still stands, and
                # the nak only if the delivery is surely still ours.
                log.exception("job %s: its lease was not given back", order.job.id)
                if held.record is not None:
                    # As for an unanswered release: the record alone, asked again.
                    self._record_in_background(order.job.id, held.fence, held.record, tries=1)
                may_nak = held.may_nak_unanswered()
            if may_nak:
                with contextlib.suppress(Exception):
                    await msg.nak()
            raise
        except Exception as exc:
            _raise_untouchable_if_lost(exc, held)
            raise
        try:
            attempt_spans.verdict_noted(verdict)
            await self._end_leased(msg, order, target, held, verdict, reply)
        except Exception as exc:
            _raise_untouchable_if_lost(exc, held)
            raise
        return verdict

    async def _end_leased(
        self,
        msg: Msg,
        order: WorkOrder,
        target: str,
        held: Held,
        verdict: Verdict,
        reply: SinkReply | None,
    ) -> None:
        """Settle a leased delivery by its verdict: nothing (lost), nak, back off, hand
        back or ack/term."""
        attempt = held.attempt or msg.metadata.num_delivered
        if verdict.kind == "lost":
            self.stats["lease-lost"] += 1
            self._record_unsettled(order, held)
        elif verdict.kind == "retryable":
            if await self._give_back(order, held):
                self._failed_here.failed(order.job.id, msg.metadata.num_delivered or 0)
                await msg.nak(delay=self.policy.delay_s(attempt, verdict.delay_s))
        elif verdict.kind == "blocked":
            await self._back_off(msg, order, held, verdict)
        elif verdict.kind == "unrun":
            # No permit for its request: nothing was sent, so the attempt is refunded.
            if await self._refund_unrun(order, held):
                await self._hand_back(msg, target, verdict.reason, verdict.delay_s)
        else:
            await self._settle(msg, order, held, verdict, reply)

    async def _obey_robots(self, msg: Msg, order: WorkOrder, target: str) -> Verdict | None:
        """What the target's robots.txt already decides of this leased job: ``unrun``
        (no rules to go by yet: the lease goes back refunded and the job with it),
        ``permanent`` (``robots-disallowed``, not called), or None (go on)."""
        robots = await self._robots_answer(order, target)
        if isinstance(robots, RobotsNotYet):
            # No rules to go by yet (robots.txt unreachable, or no permit to fetch it):
            # nothing is sent, and the target is left alone until then.
            self.gate.hold(target, robots.wait_s)
            delay = self._hand_back_delay(msg, target, robots.wait_s)
            return Verdict(
                "unrun", reason=robots.reason, detail=robots.detail, delay_s=delay, called=False
            )
        if isinstance(robots, RobotsDisallowed):
            return Verdict("permanent", reason=robots.reason, detail=robots.detail, called=False)
        return None

    async def _robots_answer(
        self, order: WorkOrder, target: str
    ) -> RobotsAllowed | RobotsDisallowed | RobotsNotYet:
        """What the target's robots.txt says of this job's URL. Only a job that will send
        a request is asked about: not a ``noop`` nor an unknown handler, nor a URL off
        the target (each ends without a request anyway)."""
        if self._robots is None or not requests_target(order.job.handler):
            return RobotsAllowed()
        if job_outside_target(order.job.url, target, self.settings.targets[target]):
            return RobotsAllowed()
        return await self._robots.check(target, order.job.url)

    async def _run_and_report(
        self, msg: Msg, order: WorkOrder, attempt: int, held: Held, ruled: Verdict | None = None
    ) -> tuple[Verdict, SinkReply | None]:
        """Run the attempt (unless ``ruled`` already judged it without a call), publish
        its outcome, and report a final verdict to the sink."""
        started = time.monotonic()
        if ruled is not None:
            await self.rate_pacing.answered(msg.reply or "")  # it takes no permit
        verdict = ruled or await self._run(msg, order, attempt, held)
        if verdict.kind == "unrun" or (verdict.kind == "lost" and not verdict.called):
            return verdict, None  # not an attempt: nothing to publish or report
        duration = time.monotonic() - started
        if verdict.kind == "retryable" and attempt >= order.max_attempts:
            verdict = Verdict(
                "permanent",
                reason="attempts-exhausted",
                detail=f"last: {verdict.reason} {verdict.detail}".strip(),
                attempt_reason=verdict.reason,
                called=verdict.called,
            )
        versions = self._versions(order)
        held.record = await self._publish_outcome(
            order, attempt, verdict, duration, versions, held.fence
        )
        if verdict.kind not in ("ok", "permanent"):
            return verdict, None
        return verdict, await self._report(order, attempt, verdict, duration, versions, held)

    async def _take_lease(self, msg: Msg, order: WorkOrder, target: str) -> Held | None:
        """The lease for this delivery, or None after acking/nakking it. A rate-bound
        target's pull loop waits for the job's permit answer (``_run``), or for this
        one when no lease came of it."""
        held = None
        try:
            held = await self._ask_and_decide(msg, order, target)
            return held
        finally:
            if held is None:
                await self.rate_pacing.answered(msg.reply or "")

    async def _ask_and_decide(self, msg: Msg, order: WorkOrder, target: str) -> Held | None:
        if not self.settings.fleet.leases:
            return Held(fence=0, ttl_s=0.0, attempt=0)
        if await self._nobody_owns_pin(msg, order) or await self._nobody_in_region(msg, order):
            # The leaser would refuse it (wrong-identity, wrong-region), and no running
            # worker owns the identity or is of the region: straight back, towards the
            # backstop (no-eligible-worker).
            await self._hand_back(msg, target, "no-eligible-worker", 0.0)
            return None
        request = LeaseRequest(
            job_id=order.job.id,
            target=target,
            key=order.key,
            worker=self.worker_id,
            versions=self._versions(order),
            identity=self.identity,
            region=self.settings.worker.region,
            reply_subject=msg.reply or "",
            pin_identity=order.job.pin_identity,
            egress=self.settings.worker.egress,
            subnet=self.settings.worker.subnet,
            pin_region=order.job.pin_region,
            # This worker takes its permits itself, just before each request; false
            # also keeps a leaser from before that from taking a second one at grant.
            sends_request=False,
        )
        timer = AckTimer(self.settings.fleet.ack_wait_s)
        try:
            reply, asked_at = await self._ask_for_lease(msg, request, timer)
        except asyncio.CancelledError:
            # A drain ran out of time while the leaser did not answer: another worker
            # may ask for the job now, once a late grant to this delivery is undone.
            with contextlib.suppress(Exception):
                await self._refund_late_grant(request)
                await msg.nak()
            raise
        if isinstance(reply, LeaseAlreadyDone):
            self.stats["already-done"] += 1
            # The leaser stored the duplicate record (another job's commit holds the key)
            # before it answered. A lost ack costs no second request to the target.
            self.settles.send(msg, b"", timer)
            return None
        if isinstance(reply, LeaseRefusal):
            self.stats[f"refused:{reply.reason}"] += 1
            reason = reply.reason
            if reply.reason == "dead-lettered":
                await self._term(msg, "dead-lettered", timer)  # a term that was lost, sent again
                return None
            retry_after = max(MIN_REFUSAL_DELAY_S, reply.retry_after_s)
            if reply.reason in RATE_REFUSALS:
                # The permit says exactly when the next request may go: this worker stops
                # pulling the target until then (waiting longer would leave its rate
                # unused). A permit frees every 1 / rate, as a place under a cap frees
                # when a job ends, so the job waits like a target-busy one, the same for
                # every delivery, old or fresh: a wait growing with its deliveries left a
                # backlog of jobs refused a few times each away for tens of seconds
                # while the rate went unused (issue 9, I4), and the oldest jobs last.
                retry_after = max(MIN_RATE_WAIT_S, reply.retry_after_s)
                self.rate_pacing.rate_bound(target)
                self.gate.wait_for_permit(target, retry_after)
                delay = self._rate_wait_delay(msg, target, retry_after)
            elif reply.reason == "target-busy":
                # A target at its in-flight cap: a place frees whenever one of its jobs
                # ends, so the target is not held here (a hold would leave freed places
                # idle); this job stays away as long as any other waiting job, old or
                # fresh, so old ones get their share of the freed places.
                delay = self.pace.target_busy_s(target, msg.metadata.num_delivered or 1)
            elif reply.reason == AVOIDED:
                # About this job and this worker (the target refused the job here): the
                # target is not held, and the job goes back at once for the others,
                # paced like every unrun hand-back so it keeps deliveries to spare.
                delay = self._hand_back_delay(msg, target, MIN_REFUSAL_DELAY_S)
            elif reply.reason in TARGET_WIDE_REFUSALS:
                # The refusal concerns this worker's use of the target, not the job: this
                # worker stops pulling the target, and the job goes back at once for the
                # others (when the whole target is refused, nobody pulls it anyway).
                if reply.reason == "subnet-busy":
                    retry_after = self._subnet_busy_wait(target, retry_after)
                self.lending.held(target, reply.reason, retry_after)
                if reply.reason in WORKER_SCOPED_REFUSALS or (
                    reply.reason == "paused" and reply.pause_scope in WORKER_SCOPED_PAUSES
                ):
                    self.gate.hold(target, retry_after, only_here=True)
                    delay = self._elsewhere_delay(msg, target)
                else:
                    self.gate.hold(target, retry_after, opens_in_s=reply.opens_in_s)
                    delay = self._hand_back_delay(msg, target, MIN_REFUSAL_DELAY_S)
                if reply.opens_in_s > 0:
                    # Outside the target's activity window: the job stays away until it
                    # opens (jittered, so the backlog does not return at one instant),
                    # one delivery per closed spell however long, not one per ask.
                    delay = reply.opens_in_s + random.uniform(0.0, WINDOW_SPREAD_S)
            elif (
                reply.reason in PIN_REFUSALS and (msg.metadata.num_delivered or 0) > PINNED_PATIENCE
            ):
                # Past its patience, and a worker owning the identity or of the region
                # runs (_nobody_owns_pin, _nobody_in_region said so before the ask): it
                # is only busy, so the job waits for it, paced against its max age. At
                # one ask per HAND_BACK_MAX_S it used up max_deliver in minutes and
                # ended no-eligible-worker beside a worker that could run it.
                delay = self._pin_owner_busy_delay(msg, target, retry_after)
                reason = PIN_REFUSALS[reply.reason]
            else:
                # About this job (wrong-identity, held, leaser-error): the delay grows with
                # each delivery, to one lease request per HAND_BACK_MAX_S; a job pinned to
                # an identity nobody owns goes to the backstop after its patience
                # (_nobody_owns_pin).
                delay = max(retry_after, self._growing_delay(msg))
            await self._hand_back(msg, target, reason, delay)
            return None
        self._subnet_busy.pop(target, None)
        return Held(
            fence=reply.fence,
            ttl_s=reply.ttl_s,
            attempt=reply.attempt,
            asked_at=asked_at,
            timer=timer,
        )

    async def _refund_late_grant(self, request: LeaseRequest) -> None:
        """Undo a grant the leaser may still make to this delivery after we stop asking.

        A stalled leaser answers the asks it holds in turn when it resumes: the one that
        timed out creates the lease (an attempt counted), and this last one, for the same
        worker and reply subject, gets that same lease again. Released with a refund, it
        neither holds the next delivery off as ``held`` nor counts as an attempt that
        never ran. A leaser still silent after this ask leaves the late grant possible.
        """
        reply = await self.leases.grant(request)
        if isinstance(reply, LeaseGrant):
            await self.leases.release(request.job_id, reply.fence, refund=True)

    async def _nobody_owns_pin(self, msg: Msg, order: WorkOrder) -> bool:
        """Whether the job is pinned to an identity this worker lacks, has had its
        patience, and no running worker holds a claim on the identity (one busy elsewhere
        does, and its jobs wait for it)."""
        pin = order.job.pin_identity
        if not pin or pin == self.identity:
            return False
        if (msg.metadata.num_delivered or 0) <= PINNED_PATIENCE:
            return False
        return not await self.identities.owned(pin)

    async def _nobody_in_region(self, msg: Msg, order: WorkOrder) -> bool:
        """Whether the job is pinned to a region this worker is not in, has had its
        patience, and no running worker of that region announces itself
        (jetfleet/region_presence.py; one that is only busy does, and its jobs wait)."""
        pin = order.job.pin_region
        if not pin or pin == self.settings.worker.region:
            return False
        if (msg.metadata.num_delivered or 0) <= PINNED_PATIENCE:
            return False
        return not await self.regions.present(pin)

    async def _ask_for_lease(
        self, msg: Msg, request: LeaseRequest, timer: AckTimer
    ) -> tuple[LeaseReply, float]:
        """The leaser's answer for this delivery and when it was asked (monotonic).

        Busy, silent or absent, the leaser is asked again for this same delivery after a
        growing, jittered wait, while +WPI keeps the delivery ours. So a grant whose
        answer came too late is found again (the leaser's ``_grant_again``: same worker,
        same reply subject) and not counted twice; given back instead, it would hold the
        job's next delivery off as ``held`` and then count as an attempt that never ran.
        A drain waits for this like for a running job, and cancels it at its timeout.
        """
        backoff = Backoff()
        while True:
            asked_at = time.monotonic()
            reply = await self.leases.grant(request)
            self.lease_latency.observe(
                time.monotonic() - asked_at,
                worker=self.worker_id,
                target=request.target,
                op="grant",
                answer=_lease_answer(reply),
            )
            if reply is not None and not is_busy(reply):
                return reply, asked_at
            self.stats["leaser-busy" if reply is not None else "leaser-unreachable"] += 1
            with contextlib.suppress(Exception):  # reconnecting: the next ask tries again
                await _keep_delivery(msg, timer)
            await asyncio.sleep(backoff.next_s(reply.retry_after_s if reply is not None else 0.0))

    async def _run(self, msg: Msg, order: WorkOrder, attempt: int, held: Held) -> Verdict:
        judged = await self._judged_unsent(msg, order, attempt)
        sends = judged is None and requests_target(order.job.handler)
        # Without leases the permit is waited for in place, as long as the limiter says:
        # inside the handler that wait would eat the attempt's budget (and spend the
        # attempt, each delivery being one there), so it stays before the handler.
        at_ready = sends and bool(held.fence) and permits_when_ready(order.job.handler)
        unrun = await self._first_permit(msg, order, held) if sends and not at_ready else None
        if not at_ready:
            # A rate-bound lane fetches its next job once this one knows whether it sends
            # (a handler permitted when ready says so at ready, or when it ends).
            await self.rate_pacing.answered(msg.reply or "")
        if judged is not None:
            return judged
        if unrun is not None:
            return unrun
        not_now = self._lost_or_unsure(msg, order, held)
        if not_now is not None:
            await self.rate_pacing.answered(msg.reply or "")
            return not_now
        fn, _ = get_handler(order.job.handler)
        ready = self._permit_at_ready(msg, order, held) if at_ready else None
        held.running = handler = asyncio.create_task(self._attempt(order, attempt, fn, ready))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            return await handler
        except asyncio.CancelledError:
            if held.lost.is_set():
                # Someone else owns the job now: stop, keep nothing built for it.
                return Verdict("lost", reason="lease-lost")
            raise
        finally:
            held.running = None
            if at_ready:  # ended before its ready (a page that would not open), or after
                await self.rate_pacing.answered(msg.reply or "")

    def _permit_at_ready(self, msg: Msg, order: WorkOrder, held: Held) -> ReadyFn:
        """The ``HandlerContext.ready`` of a handler permitted when ready: takes the first
        request's permit (once), as ``_first_permit`` does before other handlers start.

        Raises (from the callback):
            NotSent: the request may not go now; carries the attempt's ``unrun`` (or
                ``lost``) verdict.
        """
        taken = False
        once = asyncio.Lock()  # two calls at once take one permit, not two
        # The job's span, as here: the handler runs ready in a task of the browser
        # driver's, whose context is the job that started the driver.
        job_context = otel_context.get_current()

        async def ready() -> None:
            nonlocal taken
            async with once:
                if taken:
                    return
                token = otel_context.attach(job_context)
                try:
                    unrun = await self._first_permit(msg, order, held)
                finally:
                    otel_context.detach(token)
                await self.rate_pacing.answered(msg.reply or "")
                # The lease or the identity may have gone while the permit was asked
                # for; the handler's cancel reaches a request already on its way late.
                not_now = unrun or self._lost_or_unsure(msg, order, held)
                if not_now is not None:
                    raise NotSent(not_now)
                taken = True

        return ready

    def _lost_or_unsure(self, msg: Msg, order: WorkOrder, held: Held) -> Verdict | None:
        """The verdict of a job whose lease went (``lost``) or whose identity may not be
        used now (``_identity_unsure``) while its lease or permit was asked for: the
        cancel at that moment missed a handler not started yet, or a request not sent
        yet. None: it may send."""
        if held.lost.is_set():
            return Verdict("lost", reason="lease-lost", called=False)
        return self._identity_unsure(msg, order.target)

    def _identity_unsure(self, msg: Msg, target: str) -> Verdict | None:
        """An ``unrun`` verdict if the identity may not be used now: its claim is lost
        (``identity-lost``) or not surely live by this worker's clock (renewals
        unconfirmed: ``identity-unsure``). Paced like any hand-back, so jobs a worker
        cut off from the claims bucket keeps meeting do not run out of deliveries."""
        if self.claim is None or self.claim.live():
            return None
        reason = "identity-lost" if self.claim.lost.is_set() else "identity-unsure"
        delay = self._hand_back_delay(msg, target, 0.0)
        return Verdict("unrun", reason=reason, delay_s=delay, called=False)

    async def _judged_unsent(self, msg: Msg, order: WorkOrder, attempt: int) -> Verdict | None:
        """The verdict of a job that ends without a request (expired, out of attempts,
        off its target, no such handler), or None: it may run. Judged before its permit
        is asked for, so no permit is spent on a request that will not be sent."""
        expired = await self._expired(msg, order)
        if expired is not None:
            return expired
        if attempt > order.max_attempts:
            # Granted again after a crash with no verdict recorded: do not run it again.
            return Verdict(
                "permanent",
                reason="attempts-exhausted",
                detail=f"attempt {attempt} of {order.max_attempts}",
                called=False,
            )
        outside = job_outside_target(
            order.job.url, order.target, self.settings.targets[order.target]
        )
        if outside is not None:
            # Admitted elsewhere, published straight to the work subject, or from before
            # a change of base_url: no request leaves for a site this target is not.
            return Verdict("permanent", reason=OUTSIDE_TARGET, detail=outside, called=False)
        try:
            get_handler(order.job.handler)
        except KeyError:
            return Verdict(
                "permanent",
                reason="unknown-handler",
                detail=f"no handler {order.job.handler!r} in this worker",
                called=False,
            )
        if order.job.handler == BROWSER_HANDLER and self.browser is None:
            # A worker of the fleet with a browser runs it: handed back unrun, unpermitted.
            return Verdict(
                "unrun",
                reason=NO_BROWSER,
                detail="worker.browser.enabled is false on this worker",
                delay_s=self._elsewhere_delay(msg, order.target),
                called=False,
            )
        return None

    async def _first_permit(self, msg: Msg, order: WorkOrder, held: Held) -> Verdict | None:
        """Take the permit of the attempt's first request, the last step before the
        handler runs, so the limiter's clock and the request's arrival at the target are
        milliseconds apart (taken at the lease grant, they were up to a quarter second
        apart under load, and the target's windows saw bursts the cap forbids: issue 9).
        None when taken (or ``lost``: the lease went meanwhile); otherwise an ``unrun``
        verdict: the lease is released with a refund and the job handed back for as long
        as the answer says, and this worker fetches no more of the target's jobs until
        then (the gate).

        Never waited for holding the lease: the jobs of a fetched batch ask together, and
        waiting, all of them would ask again together at the moment the next permit
        frees, one winning, the rest holding places, and a redirect hop's permit (for an
        attempt already under way) would wait behind them."""
        target = order.target
        if held.lost.is_set():
            return Verdict("lost", reason="lease-lost", called=False)
        # Without leases a hand-back is a delivery, and deliveries count as attempts
        # there: a job handed back for its permit would run out of attempts unsent. No
        # lease or place is held, so it waits here (its +WPI beats go on).
        leased = bool(held.fence)
        patience_s = self.settings.targets[target].max_retry_after_s
        reply = await self._await_permit(target, 0.0 if leased else patience_s, not leased)
        if reply is None:
            return None  # a loss meanwhile is caught just before the handler starts
        if isinstance(reply, PermitRefused):
            # The limiter cannot be asked: nothing goes to the target until it can.
            self.stats[f"refused:{reply.reason}"] += 1
            self.gate.hold(target, max(MIN_REFUSAL_DELAY_S, reply.retry_after_s))
            delay = self._hand_back_delay(msg, target, MIN_REFUSAL_DELAY_S)
            return Verdict(
                "unrun", reason=reply.reason, detail=reply.detail, delay_s=delay, called=False
            )
        reason = _rate_reason(reply)
        self.stats[f"refused:{reason}"] += 1
        # A permit frees every 1 / rate, as a place under a cap frees when a job ends,
        # so the job waits like a target-busy one, the same for every delivery, old or
        # fresh: a wait growing with its deliveries left a backlog of jobs refused a few
        # times each away for tens of seconds while the rate went unused (issue 9, I4).
        delay = self._rate_wait_delay(msg, target, max(MIN_RATE_WAIT_S, reply.retry_after_s))
        return Verdict("unrun", reason=reason, detail=reply.detail, delay_s=delay, called=False)

    async def _await_permit(
        self, target: str, patience_s: float, through_refusals: bool = False
    ) -> PermitWait | PermitRefused | None:
        """A permit for one request to ``target`` (None), waiting for it while each of
        the limiter's answers says wait no longer than ``patience_s``; else the answer
        that would have us wait longer, or the refusal. Each wait also holds the target
        in this worker (stop fetching its jobs until then) and marks it rate-bound.
        With ``through_refusals`` a refusal (no limiter to ask) is waited out the same
        way. Several waits in a row (another worker took the permit that freed) are
        bounded by an attempt's deadline for a hop; a drain ends any wait."""
        request = PermitRequest(
            target=target,
            worker=self.worker_id,
            identity=self.identity,
            egress=self.settings.worker.egress,
        )
        while True:
            reply = await self.permits.permit(request)
            if isinstance(reply, PermitAllowed):
                return None
            self.permit_waits.inc(
                worker=self.worker_id,
                target=target,
                answer="refused" if isinstance(reply, PermitRefused) else "wait",
            )
            wait = max(MIN_RATE_WAIT_S, reply.retry_after_s)
            if isinstance(reply, PermitRefused):
                if not through_refusals or wait > patience_s:
                    return reply
            else:
                self.rate_pacing.rate_bound(target)
                self.gate.wait_for_permit(target, wait)
                if wait > patience_s:
                    return reply
            await self._pause(wait)
            if self._stopping.is_set():
                return reply  # draining: the job goes back now, not after the wait

    async def _expired(self, msg: Msg, order: WorkOrder) -> Verdict | None:
        """A permanent ``expired`` verdict (not run) for a job past its target's max age,
        judged on the server's clock from when the server stored its work order."""
        max_age = self.settings.max_age_s(order.target)
        age = await self.clock.age_s(msg.metadata.timestamp)
        if age is None or age <= max_age:
            return None
        return Verdict(
            "permanent",
            reason="expired",
            detail=f"queued {age:.0f} s, more than the {max_age:g} s max age",
            called=False,
        )

    async def _attempt(
        self,
        order: WorkOrder,
        attempt: int,
        fn: HandlerFn,
        ready: ReadyFn | None = None,
    ) -> Verdict:
        with attempt_spans.handler_span(order, attempt):
            verdict = await self._attempt_untraced(order, attempt, fn, ready)
            return attempt_spans.verdict_noted(verdict)

    async def _attempt_untraced(
        self,
        order: WorkOrder,
        attempt: int,
        fn: HandlerFn,
        ready: ReadyFn | None = None,
    ) -> Verdict:
        assert self._session is not None
        target = self.settings.targets[order.target]
        ctx = HandlerContext(
            order=order,
            target=target,
            attempt=attempt,
            worker_id=self.worker_id,
            identity=self.identity,
            user_agent=target.user_agent or self.settings.fleet.user_agent,
            session=self._session,
            objects=self._objects,
            another_request=lambda url: self._another_request(order.target, url),
            ready=ready,
            browser=self.browser,
        )
        # The budget of every attempt (the order carries the target's when the job set
        # none): a handler that never returns must not hold its lease for ever.
        budget_s = order.timeout_s or target.timeout_s
        what = f"handler {order.job.handler} on job {order.job.id}"
        try:
            output = await self._deadline.run(fn(ctx), budget_s, what)
        except NotSent as exc:
            assert isinstance(exc.verdict, Verdict)
            return exc.verdict  # its first request never left: as if never started
        except PermanentFailure as exc:
            reason, cut = fit_reason(exc.reason)
            detail = "; ".join(filter(None, (exc.detail, cut)))
            return Verdict("permanent", reason=reason, detail=detail)
        except RetryLater as exc:
            delay, note = self._bound_wait(order.target, exc.delay_s)
            reason, cut = fit_reason(exc.reason)
            detail = "; ".join(filter(None, (exc.detail, note, cut)))
            return Verdict("retryable", reason=reason, detail=detail, delay_s=delay)
        except Blocked as exc:
            delay, note = self._bound_wait(order.target, exc.retry_after_s)
            detail = "; ".join(filter(None, (exc.detail, note)))
            return Verdict(
                "blocked",
                reason=exc.kind,
                detail=detail,
                delay_s=delay,
                status=exc.status,
                asked_s=delay,
            )
        except Exception as exc:  # a handler bug: retried, and logged as the crash it is
            log.exception("handler %s crashed on job %s", order.job.handler, order.job.id)
            return Verdict(
                "retryable", reason="handler-crashed", detail=f"{type(exc).__name__}: {exc}"
            )
        return self._ok_if_it_fits(order, output)

    async def _another_request(self, target: str, url: str) -> None:
        """Clear one more request of a running attempt (a redirect hop to ``url``): the
        target's robots.txt must allow it, and it takes a permit, waited for as long as
        the target's limit says (the attempt's deadline bounds it).

        Raises:
            PermanentFailure: robots.txt disallows ``url`` (``robots-disallowed``).
            RetryLater: robots.txt is not known now, or no permit can be had.
        """
        if self._robots is not None and self.settings.targets[target].obey_robots:
            rules = await self._robots.check(target, url)
            if isinstance(rules, RobotsDisallowed):
                raise PermanentFailure(rules.reason, detail=f"redirected to {url}: {rules.detail}")
            if isinstance(rules, RobotsNotYet):
                raise RetryLater(rules.reason, delay_s=rules.wait_s, detail=rules.detail)
        reply = await self._await_permit(target, HOP_PERMIT_PATIENCE_S)
        if isinstance(reply, PermitRefused):
            raise RetryLater(reply.reason, delay_s=reply.retry_after_s, detail=reply.detail)
        if reply is not None:
            # A hold (or a slow cap) longer than is worth waiting out holding the
            # lease: the attempt ends as a refunded hand-back, its budget unspent.
            raise Blocked("target-held", reply.retry_after_s, detail=reply.detail)

    def _ok_if_it_fits(self, order: WorkOrder, output: HandlerOutput) -> Verdict:
        """``ok``, unless the output cannot travel in one message: sent, it would fail
        inside the report and the job would be run again for nothing."""
        try:
            size = len(_encoder.encode(output))
        except (UnicodeEncodeError, TypeError) as exc:
            # A lone surrogate in page text, or a value JSON has no form for: every
            # attempt would return the same, and raised in the report it left the job
            # unsettled, run again until JetStream gave up on it.
            return Verdict(
                "permanent",
                reason=OUTPUT_UNENCODABLE,
                detail=f"the {order.job.handler} output cannot be written as JSON: {exc}"[:500],
            )
        if self._objects is None or self._objects.fits_message(size):
            return Verdict("ok", output=output)
        return Verdict(
            "permanent",
            reason=RESULT_TOO_LARGE,
            detail=f"the {order.job.handler} output is {size} bytes as JSON, more than a "
            f"result message carries ({self._objects.max_output_bytes}); a handler keeps "
            "large bytes with ctx.objects.put and returns the reference",
        )

    def _bound_wait(self, target: str, asked_s: float | None) -> tuple[float | None, str]:
        """A target's Retry-After, cut to its ``max_retry_after_s``, and a note when cut.

        Cut, the job still comes back in bounded time and this worker probes the target
        once per cap (one request, not a flood); the longer ask shows as a target hold.
        """
        if asked_s is None:
            return None, ""
        wait = BoundedWait(asked_s=asked_s, cap_s=self.settings.targets[target].max_retry_after_s)
        self.holds.record(target, wait)
        return wait.delay_s, wait.describe(target) if wait.over_cap else ""

    async def _keep_lease(self, msg: Msg, order: WorkOrder, held: Held) -> None:
        """Renew at ttl/3 and send +WPI in the same beat; if the lease is lost, mark it
        and cancel the handler if it still runs. Never dies of an error: a failed call
        counts as unanswered."""
        if not held.fence:
            interval = self.settings.fleet.ack_wait_s / 3
            while True:
                await asyncio.sleep(interval)
                raise_if_cancel_dropped()
                try:
                    await msg.in_progress()
                except Exception as exc:  # reconnecting: the next beat tries again
                    log.warning("in-progress for job %s failed: %s", order.job.id, exc)
        interval = held.ttl_s / 3
        # The server's TTL ran from no earlier than when the last renewal was sent. A
        # renewal is waited for no longer than the TTL has left: unanswered for a whole
        # TTL, the lease has expired by the server's clock, so it counts as lost then,
        # not a call timeout later (the ack wait, only a second longer, may not be). An
        # unanswered renewal is asked again soon (growing, jittered), not a beat later,
        # so a leaser's passing stall or busy moment does not cost the lease.
        renewed_at = held.asked_at
        retry = Backoff()
        wait_s = interval
        while True:
            await asyncio.sleep(max(0.0, min(wait_s, renewed_at + held.ttl_s - time.monotonic())))
            raise_if_cancel_dropped()
            asked_at = time.monotonic()
            renewed = await self._renew_within(msg, order, held, renewed_at + held.ttl_s - asked_at)
            if renewed:
                renewed_at, retry, wait_s = asked_at, Backoff(), interval
                continue
            if renewed is False or time.monotonic() - renewed_at >= held.ttl_s:
                held.lost.set()
                if held.running is not None:
                    held.running.cancel()
                return
            wait_s = min(interval, retry.next_s())

    async def _renew_within(
        self, msg: Msg, order: WorkOrder, held: Held, left_s: float
    ) -> bool | None:
        """Renew (and send +WPI) if answered within ``left_s``; None if unanswered."""
        if left_s <= 0:
            return None
        asked_at = time.monotonic()
        try:
            # Not asyncio.wait_for: on Python 3.11 it drops a cancel that lands as the
            # renewal is answered (CPython gh-86296), and this keeper, cancelled by
            # _stop, went on renewing forever: the job never settled, its lease live.
            async with asyncio.timeout(left_s):
                renewed = await self.leases.renew(order.job.id, held.fence)
        except Exception as exc:  # no answer in the time left, among others
            log.warning("renewing the lease of job %s failed: %r", order.job.id, exc)
            renewed = None
        # Unknown (no answer, or none in the time left) is the leaser's trouble, not a
        # lost lease: timed apart, timed out ones too, or a slow leaser would show as
        # lost leases and its worst round trips not at all.
        answer = "unanswered" if renewed is None else "granted" if renewed else "refused"
        self.lease_latency.observe(
            time.monotonic() - asked_at,
            worker=self.worker_id,
            target=order.target,
            op="renew",
            answer=answer,
        )
        if not renewed:
            return renewed
        try:
            await _keep_delivery(msg, held.timer)
        except Exception as exc:
            log.warning("renewing the lease of job %s failed: %r", order.job.id, exc)
            return None
        return renewed

    async def _give_back(
        self, order: WorkOrder, held: Held, refund: bool = False, avoid_reason: str = ""
    ) -> bool:
        """Release the lease before a nak; True only if the nak may follow.

        Released: yes, unless the keeper holds the lease lost (then the delivery may be
        superseded). Not ours any more: no. When the leaser cannot say, only if the
        lease is not known lost and the delivery's ack wait surely has not run out
        (``Held.may_nak_unanswered``): the next delivery is then refused as ``held``
        until the lease's TTL ends. Otherwise the job is left to its ack wait: a nak
        could land on a delivery JetStream already handed to another worker.
        """
        if not held.fence:
            return True
        released = await self.leases.release(
            order.job.id,
            held.fence,
            refund=refund,
            avoid_reason=avoid_reason,
            attempt=held.record,
        )
        if released is None:
            if held.record is not None:
                # Unanswered: the record may be lost with it. Asked again in the
                # background, the record alone (no refund or avoid entry decided late).
                self._record_in_background(order.job.id, held.fence, held.record, tries=1)
            return held.may_nak_unanswered()
        # Released although the keeper holds the lease lost (its renewals went unanswered
        # past the TTL, though the leaser had not let it go): its +WPI beats stopped too,
        # so JetStream may have handed the message out again, and a nak now would land
        # on that delivery. The job is left to its ack wait (seen in the I1 soak).
        return released and not held.lost.is_set()

    def _record_unsettled(self, order: WorkOrder, held: Held) -> None:
        """An attempt that ran but lost its lease (or that the sink refused to settle
        under it) ends with a release all the same, carrying its record: the leaser
        refuses it (``lease-lost``, or releases a lease still ours) and keeps the record
        in the job's history (if nobody was granted the job since), so the attempt is in
        its dead letter. Nothing is nakked: the delivery is someone else's, or its ack
        wait returns it. Sent in the background: it only records history, and must not
        hold the job's slot while the leaser does not answer."""
        if held.fence and held.record is not None:
            self._record_in_background(order.job.id, held.fence, held.record, tries=0)

    def _record_in_background(
        self, job_id: str, fence: int, record: AttemptRecord, tries: int
    ) -> None:
        """Start ``_send_record`` (``tries``: asks already made), unless too many are in
        flight: then the record is dropped, logged."""
        if len(self._records) >= RECORDS_IN_FLIGHT:
            log.warning(
                "record of job %s's attempt under fence %d not sent: %d history "
                "releases in flight already",
                job_id,
                fence,
                len(self._records),
            )
            return
        task = asyncio.create_task(self._send_record(job_id, fence, record, tries))
        self._records.add(task)
        task.add_done_callback(self._records.discard)

    async def _send_record(
        self, job_id: str, fence: int, record: AttemptRecord, tries: int
    ) -> None:
        """Release ``fence`` carrying ``record`` until the leaser answers, at most
        ``RECORD_TRIES`` asks in all. Any answer will do: released, or refused with the
        record kept or not (a repeat of one that landed finds its fence's record there).
        An ask that raises (the connection lost as it was sent) counts as unanswered: it
        is what sent this record to the background in the first place (a drain's release
        that raised), so giving up on it would drop the record at the first blip."""
        backoff = Backoff()
        error: Exception | None = None
        while tries < RECORD_TRIES:
            if tries:
                await asyncio.sleep(backoff.next_s())
            tries += 1
            try:
                answered = await self.leases.release(job_id, fence, attempt=record)
            except Exception as exc:
                error, answered = exc, None
            if answered is not None:
                return
        log.warning(
            "record of job %s's attempt under fence %d not sent: the leaser did not "
            "answer %d releases (its dead letter will miss it)%s",
            job_id,
            fence,
            RECORD_TRIES,
            f"; the last error: {error!r}" if error is not None else "",
        )

    async def _refund_unrun(self, order: WorkOrder, held: Held) -> bool:
        """Release the lease of a job that sent nothing, with a refund, asking again
        while the leaser does not answer (an unanswered release would leave the grant
        counted: a job refused its permit a few times while a leaser restarts would run
        out of attempts unsent). True if the nak may follow, as ``_give_back``."""
        if not held.fence:
            return True
        backoff = Backoff()
        unanswered = False
        while True:
            released = await self.leases.release(order.job.id, held.fence, refund=True)
            if released or (released is False and not unanswered):
                # Lost by the keeper's count: no nak, as in ``_give_back``.
                return released and not held.lost.is_set()
            # Unanswered, or gone after an unanswered ask (which may have released and
            # refunded it): whether the nak may follow depends on the delivery's ack
            # wait, as for any unanswered release.
            if released is False or not held.may_nak_unanswered():
                return held.may_nak_unanswered()
            unanswered = True
            await asyncio.sleep(backoff.next_s())

    async def _back_off(self, msg: Msg, order: WorkOrder, held: Held, verdict: Verdict) -> None:
        """The target refused us: stop pulling it until it said (or the policy says), and
        requeue the job without spending its attempt budget.

        What the target said is a floor, never the wait itself: a ``Retry-After: 0``
        (or a date already past) would otherwise have this worker call it again at once.
        The hold grows with the target's blocks in a row, the job's wait with its
        deliveries (hand_back_pace.py), so the target sees fewer and fewer requests
        and the job does not use up ``max_deliver`` while it could still run.
        """
        target = order.target
        asked = verdict.delay_s if verdict.delay_s is not None else self.policy.max_backoff_s
        first = max(self.settings.fleet.retry_base_s, MIN_REFUSAL_DELAY_S)
        streak = self.gate.block_streak(target) + 1
        hold = max(asked, self.pace.growing_s(target, streak, first))
        if verdict.reason == "rate-limited":
            # A slow-down answer is about the target, not this worker: hold it for the
            # whole fleet (the ratelimit service refuses its permits until then).
            hold = max(hold, await self._hold_fleet_wide(target, verdict))
        hold = min(hold, self.settings.targets[target].max_retry_after_s)
        self.gate.blocked(target, hold)
        self.stats[f"blocked:{verdict.reason}"] += 1
        if verdict.reason == "challenged":
            # The session that was challenged is dead: the job goes back, its cookies
            # do not (DESIGN I5).
            dropped = self.cookies.discard_for(self.settings.targets[target])
            log.info(
                "worker %s discarded %d cookie(s) of identity %s for %s after a challenge",
                self.worker_id,
                dropped,
                self.identity or "(none)",
                target,
            )
        delivered = msg.metadata.num_delivered or 1
        delay = max(hold, self.pace.growing_s(target, delivered, first))
        # Refused here (not for its load): the job moves on to another identity, and
        # the fleet-wide limits (quarantine rules, the target's hold) stop it trying
        # identity after identity.
        avoid = verdict.reason if verdict.reason in AVOID_BLOCKS else ""
        if await self._give_back(order, held, refund=True, avoid_reason=avoid):
            await msg.nak(delay=delay)

    async def _hold_fleet_wide(self, target: str, verdict: Verdict) -> float:
        """Ask the ratelimit service to hold ``target`` for everyone: for what its
        Retry-After said, else for the target's adaptive backoff. The hold in force
        (0 when the service could not be asked: this worker's own hold still stands)."""
        reply = await self.permits.hold(
            HoldRequest(
                target=target,
                status=verdict.status or 429,
                said_how_long=verdict.asked_s is not None,
                retry_after_s=verdict.asked_s or 0.0,
                worker=self.worker_id,
            )
        )
        if isinstance(reply, HoldPlaced):
            return reply.hold_s
        log.warning("could not hold %s for the fleet: %s %s", target, reply.reason, reply.detail)
        return 0.0

    async def _settle(
        self, msg: Msg, order: WorkOrder, held: Held, verdict: Verdict, reply: SinkReply | None
    ) -> None:
        if reply is None or reply.status == "error":
            # Give the job back now rather than leave it to the ack wait. No answer: the
            # lease was lost while the sink was asked again and again (the release below
            # then finds it gone and nothing is nakked), or the sink stayed busy or away
            # past worker.report_patience_s; not the job's fault, so the attempt is
            # refunded. An error may be this job's own (say, an
            # output the stream refuses), so it spends the attempt and the job ends
            # dead-lettered if it keeps failing. Either way the delay grows with each
            # delivery, and a commit that did happen is found by the next grant
            # (already-done).
            if reply is None:
                self.stats["sink-unanswered"] += 1
            else:
                self.stats["sink-error"] += 1
                log.warning("sink failed on job %s: %s", order.job.id, reply.detail)
            if await self._give_back(order, held, refund=reply is None):
                await msg.nak(delay=self.policy.delay_s(msg.metadata.num_delivered or 1))
            return
        self.stats[reply.status] += 1
        if reply.status in ("committed", "suppressed:duplicate-key"):
            # Suppressed: the sink stored the duplicate record before it answered. The sink
            # confirmed our fence: this is the live delivery. The lease is left to expire
            # by its TTL: the job is gone from the queue, so releasing it would only cost
            # the leaser a round trip per job (a partitioned target's in-flight place was
            # freed by the sink).
            with attempt_spans.settle_span(msg, "ack"):
                self.settles.send(msg, b"", held.timer)
        elif reply.status == "dead-lettered":
            await self._term(msg, verdict.reason, held.timer)
        else:
            # Fenced out or expired: another delivery owns the job; leave the message.
            log.info("sink answered %s for %s: %s", reply.status, order.job.id, reply.detail)
            self._record_unsettled(order, held)

    async def _report(
        self,
        order: WorkOrder,
        attempt: int,
        verdict: Verdict,
        duration: float,
        versions: Versions,
        held: Held,
    ) -> SinkReply | None:
        report: Success | Failure
        if verdict.kind == "ok":
            assert verdict.output is not None
            report = Success(
                order=order,
                worker=self.worker_id,
                attempt=attempt,
                duration_s=duration,
                output=verdict.output,
                versions=versions,
                identity=self.identity,
                fence=held.fence,
            )
        else:
            record = AttemptRecord(
                attempt=attempt,
                worker=self.worker_id,
                identity=self.identity,
                fence=held.fence,
                duration_s=duration,
                outcome=verdict.kind,
                reason=verdict.attempt_reason or verdict.reason,
            )
            report = Failure(
                order=order,
                worker=self.worker_id,
                reason=verdict.reason,
                detail=verdict.detail,
                history=[record],
                versions=versions,
                identity=self.identity,
                fence=held.fence,
            )
        return await self._send_report(order.target, order.job.id, _encoder.encode(report), held)

    async def _send_report(
        self, target: str, job_id: str, payload: bytes, held: Held
    ) -> SinkReply | None:
        """The sink's answer; None if the lease was lost while it was asked, or the sink
        gave none for ``worker.report_patience_s``.

        Busy, silent or absent, the sink gets the same report again after a growing,
        jittered wait while the lease is ours (the keeper renews it all along), so a sink
        outage does not make the target be asked twice; and a report the sink commits
        after we stopped waiting for it makes the next one ``suppressed`` under this job's
        own key, which settles the job. Past the patience the job is given back (the
        lease, the slot and the pending place are not kept for ever): it runs again, or
        its next grant finds the commit (``already-done``).
        """
        backoff = Backoff()
        give_up_at = time.monotonic() + self.settings.worker.report_patience_s
        while not held.lost.is_set():
            left_s = give_up_at - time.monotonic()
            if left_s <= 0:
                self.stats["sink-gave-up"] += 1
                log.warning(
                    "sink gave no answer for job %s in %g s; giving the job back",
                    job_id,
                    self.settings.worker.report_patience_s,
                )
                return None
            try:
                reply = await self._ask_sink(target, payload)
                if reply.status != "busy":
                    return reply
                self.stats["sink-busy"] += 1
                floor_s = reply.retry_after_s
            except (NoRespondersError, NatsTimeoutError) as exc:
                self.stats["sink-unreachable"] += 1
                if backoff.asks == 0:  # one line per report, not one per ask
                    log.warning(
                        "sink did not answer for job %s (%s); asking again until it does",
                        job_id,
                        type(exc).__name__,
                    )
                floor_s = 0.0
            # asyncio.timeout, not wait_for, which on 3.11 can drop a cancel (gh-86296).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left_s, backoff.next_s(floor_s))):
                    await held.lost.wait()
        return None

    async def _ask_sink(self, target: str, payload: bytes) -> SinkReply:
        """One report sent to the sink, and its answer (a CLIENT span of its own)."""
        subject = subjects.sink_report(target)
        with tracing.span(f"send {subject}", SpanKind.CLIENT, None, _sent(subject)):
            answer = await self.nc.request(
                subject, payload, timeout=SINK_TIMEOUT_S, headers=tracing.inject()
            )
            reply = _reply_decoder.decode(answer.data)
            tracing.note_reply(reply)
            return reply

    def _versions(self, order: WorkOrder) -> Versions:
        try:
            _, version = get_handler(order.job.handler)
        except KeyError:
            version = ""
        return with_handler(self.version_tuple, f"{order.job.handler}@{version}")

    async def _publish_outcome(
        self,
        order: WorkOrder,
        attempt: int,
        verdict: Verdict,
        duration: float,
        versions: Versions,
        fence: int,
    ) -> AttemptRecord:
        """Publish the attempt's outcome event on its target's subject (the job in the
        ``Jf-Job`` header); the attempt's record, which a release of the lease carries
        into the job's history."""
        kind = "retryable" if verdict.kind == "lost" else verdict.kind
        self.attempts.inc(
            worker=self.worker_id,
            identity=self.identity,
            target=order.target,
            version=versions.handler,
            tuple=versions.id,
            outcome=kind,
            reason=verdict.reason,
        )
        event = Outcome(
            job_id=order.job.id,
            target=order.target,
            worker=self.worker_id,
            attempt=attempt,
            kind=kind,  # type: ignore[arg-type]
            duration_s=duration,
            versions=versions,
            identity=self.identity,
            reason=verdict.reason,
            fence=fence,
            detail=verdict.detail[:500],
            subnet=self.settings.worker.subnet,
            called=verdict.called and requests_target(order.job.handler),
        )
        # One subject per target: a per-job subject costs the server an index entry
        # for as long as the stream keeps it (docs/scale.md#subject-state).
        subject = subjects.outcomes(order.target)
        headers = {JOB_HEADER: order.job.id}
        if kind == "ok":
            # Waiting for the stream's ack would cost every job a round trip; a success's
            # event is telemetry (its result is the record), sent in a batch.
            self.ok_outcomes.add(subject, order.job.id, _encoder.encode(event))
            return record_of(event)
        # A failure's event is evidence for the quarantine rules (they name its
        # sequence): stored, with the stream's ack, before the report or the release.
        try:
            # One event per grant (the fence), so a retried publish cannot store two.
            await publish_durably(
                self.js,
                subject,
                _encoder.encode(event),
                msg_id=f"out-{order.job.id}-{fence or attempt}",
                timeout_s=OUTCOME_TIMEOUT_S,
                headers=headers,
            )
        except SubmitError as exc:
            # The verdict still counts, and the job's history gets the attempt's record
            # from the release or the report; only the rules miss this event.
            log.warning("outcome of job %s not stored: %s", order.job.id, exc)
        return record_of(event)

    async def _keep_malformed(self, msg: Msg, target: str, error: str) -> None:
        """Have the sink keep an undecodable work order on jf.rejected (with its bytes),
        then terminate it: counted and inspectable, never silently gone. Terminated only
        once the sink said it is kept; without that answer it goes back for redelivery
        (and at worst ends at the backstop, which keeps it too)."""
        seq = msg.metadata.sequence.stream
        report = Malformed(
            worker=self.worker_id,
            subject=msg.subject,
            stream_seq=seq,
            error=error[:MAX_DECODE_ERROR_CHARS],
            raw=msg.data[: self._malformed_room()],
            raw_size=len(msg.data),
        )
        label = f"the work order at {msg.subject} seq {seq}"
        # No lease: nothing can take the delivery from us but its ack wait, after which
        # another worker reports it again (kept once: the record's message id).
        unleased = Held(fence=0, ttl_s=0.0, attempt=0)
        reply = await self._send_report(target, label, _encoder.encode(report), unleased)
        if reply is not None and reply.status == "kept:malformed-work-order":
            await self._term(msg, "malformed-work-order")
            return
        if reply is not None:
            log.warning("sink did not keep %s: %s %s", label, reply.status, reply.detail)
        await msg.nak(delay=self.policy.delay_s(msg.metadata.num_delivered or 1))

    def _malformed_room(self) -> int:
        """How many of an undecodable order's bytes its report carries: at most
        ``fleet.max_job_bytes``, and what fits the server's max_payload as base64."""
        room = (self.nc.max_payload - MALFORMED_ROOM_BYTES) * 3 // 4
        return max(0, min(self.settings.fleet.max_job_bytes, room))

    async def _term(self, msg: Msg, reason: str, timer: AckTimer | None = None) -> None:
        # nats-py's term() sends a bare +TERM; the reason needs the raw frame.
        with attempt_spans.settle_span(msg, "term"):
            tracing.note("terminated", reason)
            self.settles.send(msg, b"+TERM " + reason.encode()[:200], timer)


async def _keep_delivery(msg: Msg, timer: AckTimer | None) -> None:
    """Send ``+WPI`` (the delivery's ack wait restarts) and note when it was sent."""
    sent_at = time.monotonic()
    await msg.in_progress()
    if timer is not None:
        timer.restarted(sent_at)


class _CrashedUntouchable(JetfleetError):
    """A crash (its ``__cause__``) after the delivery's lease was lost or its ack wait
    ran out: the delivery may be another worker's now, so it is not naked."""


def _raise_untouchable_if_lost(crash: Exception, held: Held) -> None:
    """Re-raise ``crash`` as ``_CrashedUntouchable`` unless a nak may still follow it:
    leases off (every delivery stays this worker's until it ends), or the lease not known
    lost and the ack wait surely not run out (``Held.may_nak_unanswered``)."""
    if held.fence and not held.may_nak_unanswered():
        raise _CrashedUntouchable(str(crash)) from crash


def _sent(subject: str) -> dict[str, AttributeValue] | None:
    return tracing.messaging(subject, "send") if tracing.tracing_on() else None


def _job_id_of(msg: Msg) -> str:
    """The job id of a delivery ("" if its work order does not decode)."""
    try:
        return _order_decoder.decode(msg.data).job.id
    except (msgspec.MsgspecError, RecursionError):
        return ""


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` until it has stopped: a cancel dropped inside it (nats-py's
    requests on 3.11, jetfleet/task_stop.py) left the lease keeper renewing a committed
    job's lease, unacked, for ever."""
    await stop_task(task)


def _rate_reason(reply: PermitWait) -> str:
    """The hand-back reason of a permit that says wait."""
    return "target-held" if reply.limit == "hold" else "rate-limited"


def _lease_answer(reply: LeaseReply | None) -> str:
    """The ``answer`` label of a grant's round trip."""
    if reply is None:
        return "unanswered"
    if is_busy(reply):
        return "busy"
    return "refused" if isinstance(reply, LeaseRefusal) else "granted"


async def _while_unavailable(
    call: Callable[[], Awaitable[_T]], wait_s: float, warn: Callable[[Exception], None]
) -> _T:
    """``call()``, asked again with a growing pause while JetStream or the leaser does not
    answer (``is_unavailable``), for up to ``wait_s``; ``warn`` is told the first time.
    Any other error, or unavailability past ``wait_s``, is raised."""
    give_up_at = time.monotonic() + wait_s
    backoff = Backoff(0.2, 2.0)
    warned = False
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_unavailable(exc) or time.monotonic() >= give_up_at:
                raise
            if not warned:
                warned = True
                warn(exc)
        await asyncio.sleep(backoff.next_s())
