"""Serve ``jf.lease`` (grant, renew, release) and ``jf.quarantine`` (operator commands) in
the ``leaser`` queue group. Stateless: any number of replicas agree, because every
decision is a compare-and-set in JetStream KV judged by the server's clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from jetfleet.schemas.breaker import BreakerCommand, BreakerProbe, BreakerReply
from jetfleet.schemas.control import PauseCommand, PauseRecord, PauseReply
from jetfleet.schemas.lease import (
    LEASE_LOST,
    AvoidScope,
    LeaseCall,
    LeaseGrant,
    LeaseRecord,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseReply,
    LeaseRequest,
    QuarantineApprove,
    QuarantineCommand,
    QuarantineList,
    QuarantineRecord,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
    QuarantineScope,
    Sealed,
)
from jetfleet.schemas.presence import PresenceWrite
from jetfleet.schemas.report import AttemptRecord
from jetfleet.schemas.versions import VersionsCommand, VersionsReply
from jetfleet.services.leaser.avoid_check import AvoidList
from jetfleet.services.leaser.breaker_commands import BreakerCommands, breaker_objection
from jetfleet.services.leaser.call_checks import refuse_command, refuse_lease_call
from jetfleet.services.leaser.checks import (
    GrantContext,
    answer_settled,
    breaker_cooling,
    circuit_open,
    first_objection,
    free_taken,
    paused,
    quarantine_on,
    quarantined,
    taking_objection,
)
from jetfleet.services.leaser.command_audit import audited
from jetfleet.services.leaser.duplicate_records import recorded
from jetfleet.services.leaser.pause_commands import PauseCommands
from jetfleet.services.leaser.presence_writes import PRESENCE_REFUSALS, PresenceWrites
from jetfleet.services.leaser.proposal_answers import ProposalAnswers
from jetfleet.services.leaser.quarantine_book import BookEntry, QuarantineBook
from jetfleet.services.leaser.version_commands import (
    ApprovedVersions,
    VersionCommands,
    versions_objection,
)
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.auth.credentials import without_secrets
from jetfleet.breaker_book import BreakerBook
from jetfleet.lease_store import HistoryEntry, LeaseStore, LiveLease
from jetfleet.metrics import CounterFamily, HistogramFamily, MetricFamily
from jetfleet.pause_book import PauseBook, covers
from jetfleet.permit_client import PermitClient
from jetfleet.responder import Refusals, Responder, Route
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings
from jetfleet.subnet_holds import canonical_subnet
from jetfleet.target_places import TargetPlaces
from jetfleet.version_tuple import tuple_id

log = logging.getLogger(__name__)

_call_decoder = msgspec.json.Decoder(LeaseCall)
_command_decoder = msgspec.json.Decoder(QuarantineCommand)
# jf.quarantine-answer takes proposal answers only: whoever may publish there (the
# gateway) can set or release no quarantine.
_answer_decoder = msgspec.json.Decoder(QuarantineApprove | QuarantineReject)
_breaker_decoder = msgspec.json.Decoder(BreakerCommand)
_presence_decoder = msgspec.json.Decoder(PresenceWrite)
_pause_decoder = msgspec.json.Decoder(PauseCommand)
_versions_decoder = msgspec.json.Decoder(VersionsCommand)
_DELIVERY_PREFIX = f"$JS.ACK.{subjects.STREAM_WORK}."
"""A revoked lease's delivery is nak'ed only on a subject of this form: a work delivery's
own, and all the leaser's role may publish there (a request naming any other reply
subject, as a fuzzer's or a forger's, gets no nak, and no permission error)."""
QUARANTINE_PROPAGATION_S = 1.0
# Compare-and-set tries of one record before the command is answered failed (ask again).
PUT_TRIES = 10

LEASE_REFUSALS = Refusals[LeaseReply](
    malformed=lambda error: LeaseRefusal(
        reason="malformed-request", detail=f"not a lease call (schemas/lease.py): {error}"
    ),
    busy=lambda wait, why: LeaseRefusal(
        reason="busy", retry_after_s=wait, detail=f"{why}: ask again later"
    ),
    failed=lambda exc: LeaseRefusal(reason="leaser-error", retry_after_s=1.0, detail=str(exc)),
    too_large=lambda why: LeaseRefusal(
        reason="request-too-large", detail=f"{why} (fleet.max_request_bytes)"
    ),
)
# Busy, unavailable and failed answers carry retry_after_s: the command was not (or not
# wholly) applied and every command is idempotent, so the sender asks again (a rule's
# firing stays pending). Only malformed, too-large and the route's check are final.
FAILED_RETRY_AFTER_S = 1.0
QUARANTINE_REFUSALS = Refusals[QuarantineReply](
    malformed=lambda error: QuarantineReply(ok=False, detail=f"malformed command: {error}"),
    busy=lambda wait, why: QuarantineReply(
        ok=False, retry_after_s=wait, detail=f"{why}: send the command again in {wait:g} s"
    ),
    failed=lambda exc: QuarantineReply(
        ok=False, retry_after_s=FAILED_RETRY_AFTER_S, detail=str(exc)
    ),
    too_large=lambda why: QuarantineReply(ok=False, detail=f"{why} (fleet.max_request_bytes)"),
)
BREAKER_REFUSALS = Refusals[BreakerReply](
    malformed=lambda error: BreakerReply(ok=False, detail=f"malformed command: {error}"),
    busy=lambda wait, why: BreakerReply(
        ok=False, retry_after_s=wait, detail=f"{why}: send the command again in {wait:g} s"
    ),
    failed=lambda exc: BreakerReply(ok=False, retry_after_s=FAILED_RETRY_AFTER_S, detail=str(exc)),
    too_large=lambda why: BreakerReply(ok=False, detail=f"{why} (fleet.max_request_bytes)"),
)
VERSIONS_REFUSALS = Refusals[VersionsReply](
    malformed=lambda error: VersionsReply(ok=False, detail=f"malformed command: {error}"),
    busy=lambda wait, why: VersionsReply(
        ok=False, retry_after_s=wait, detail=f"{why}: send the command again in {wait:g} s"
    ),
    failed=lambda exc: VersionsReply(ok=False, retry_after_s=FAILED_RETRY_AFTER_S, detail=str(exc)),
    too_large=lambda why: VersionsReply(ok=False, detail=f"{why} (fleet.max_request_bytes)"),
)

PAUSE_REFUSALS = Refusals[PauseReply](
    malformed=lambda error: PauseReply(ok=False, detail=f"malformed command: {error}"),
    busy=lambda wait, why: PauseReply(
        ok=False, retry_after_s=wait, detail=f"{why}: send the command again in {wait:g} s"
    ),
    failed=lambda exc: PauseReply(ok=False, retry_after_s=FAILED_RETRY_AFTER_S, detail=str(exc)),
    too_large=lambda why: PauseReply(ok=False, detail=f"{why} (fleet.max_request_bytes)"),
)


class Leaser:
    """Grants leases after the ordered grant checks; revokes them on quarantine."""

    name = "leaser"

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.ttl_s = settings.fleet.lease_ttl_s
        self.responder = Responder(
            nc, self.name, subjects.QUEUE_LEASER, settings.fleet.service_concurrency
        )
        self.answers = CounterFamily(
            "jetfleet_lease_answers_total",
            "Grant answers by answer (granted, refused, already-done), reason, target, worker",
        )
        self.latency = HistogramFamily(
            "jetfleet_lease_handle_seconds",
            "Seconds the leaser took to answer a lease call, by op (grant, renew, release) "
            "and answer (granted, refused)",
        )
        self.metrics: list[MetricFamily] = [self.answers, self.latency, self.responder.refused]

    async def start(self) -> None:
        """Bind to the buckets and start answering."""
        self.store = await LeaseStore.open(self.js)
        self.places = TargetPlaces(self.settings)
        self.permits = PermitClient(self.nc)
        # Activity windows are judged by the server's time, never this host's.
        self.clock = ServerClock(self.nc)
        self.avoid = AvoidList(self.js, self.settings.fleet.avoid_s)
        if not await self.places.reachable():
            # Not fatal (Redis may come up later), but say it loudly: until then every
            # grant is refused (caps-unavailable).
            log.warning(
                "redis at %s does not answer: no lease is granted until it does "
                "(the in-flight caps cannot be checked)",
                without_secrets(self.settings.redis.url),
            )
        control = await self.js.key_value(subjects.BUCKET_CONTROL)
        self.quarantine = QuarantineBook(self.js, control)
        await self.quarantine.start()
        self.proposals = ProposalAnswers(self.settings, self.js, control, self.set_record)
        self.breakers = BreakerBook(self.js, control)
        self.breaker_commands = BreakerCommands(
            self.settings, self.js, self.breakers, self.revoke_target, self._spawn_task
        )
        await self.breakers.start()
        self.metrics.append(self.breaker_commands.changes)
        self.pauses = PauseBook(self.js, control)
        self.pause_commands = PauseCommands(
            self.settings, self.js, self.pauses, self.clock, self.revoke_paused, self._spawn_task
        )
        await self.pauses.start()
        # Pause state survives every restart: the records are in KV, and the consumers
        # they cover are paused at the server; a leaser starting sets any consumer that
        # disagrees (its last command died half-way, or a consumer was made since).
        await self.pause_commands.reconcile()
        self.versions = ApprovedVersions(self.settings, self.js, control, self._spawn_task)
        await self.versions.start()
        self.version_commands = VersionCommands(self.settings, self.js, control)
        limit = self.settings.fleet.max_request_bytes
        await self.responder.serve(
            Route(
                subjects.LEASE,
                _call_decoder,
                self.handle,
                LEASE_REFUSALS,
                max_bytes=limit,
                check=lambda _, call: refuse_lease_call(self.settings, call),
            )
        )
        await self.responder.serve(
            Route(
                subjects.QUARANTINE,
                _command_decoder,
                # The bounds check runs inside the audit, so a refused command is recorded.
                lambda command: audited(
                    self.js,
                    command,
                    lambda: self.command(command),
                    refuse_command(self.settings, command),
                ),
                QUARANTINE_REFUSALS,
                max_bytes=limit,
            )
        )
        await self.responder.serve(
            Route(
                subjects.QUARANTINE_ANSWER,
                _answer_decoder,
                lambda command: audited(
                    self.js,
                    command,
                    lambda: self.command(command),
                    refuse_command(self.settings, command),
                ),
                QUARANTINE_REFUSALS,
                max_bytes=limit,
            )
        )
        await self.responder.serve(
            Route(
                subjects.BREAKER,
                _breaker_decoder,
                lambda command: audited(
                    self.js, command, lambda: self.breaker_commands.command(command)
                ),
                BREAKER_REFUSALS,
                max_bytes=limit,
                check=lambda _, command: breaker_objection(self.settings, command),
            )
        )
        # Workers have no KV rights: their presence is written here (presence_writes.py).
        # No bound but the server's max_payload: a robots.txt record may be as large as
        # the one a worker could write itself.
        self.presence = PresenceWrites(self.settings, self.js)
        await self.responder.serve(
            Route(
                subjects.PRESENCE,
                _presence_decoder,
                self.presence.answer,
                PRESENCE_REFUSALS,
                check=self.presence.check,
            )
        )
        await self.responder.serve(
            Route(
                subjects.PAUSE,
                _pause_decoder,
                lambda command: audited(
                    self.js, command, lambda: self.pause_commands.command(command)
                ),
                PAUSE_REFUSALS,
                max_bytes=limit,
            )
        )
        await self.responder.serve(
            Route(
                subjects.VERSIONS,
                _versions_decoder,
                lambda command: audited(
                    self.js,
                    command,
                    lambda: self.version_commands.command(command),
                    versions_objection(command),
                ),
                VERSIONS_REFUSALS,
                max_bytes=limit,
            )
        )
        # Started means answering: make sure the server has the subscriptions.
        await self.nc.flush()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests and finish the ones in hand."""
        await self.responder.drain(timeout_s)
        await self.quarantine.stop()
        await self.breakers.stop()
        await self.pauses.stop()
        await self.versions.stop()
        await self.places.close()

    async def handle(self, call: LeaseRequest | LeaseRenew | LeaseRelease) -> LeaseReply:
        """Answer one lease call (timed into ``jetfleet_lease_handle_seconds``)."""
        started = time.perf_counter()
        reply = await self._handle(call)
        self.latency.observe(
            time.perf_counter() - started,
            op=_OPS[type(call)],
            answer="refused" if isinstance(reply, LeaseRefusal) else "granted",
        )
        return reply

    async def _handle(self, call: LeaseRequest | LeaseRenew | LeaseRelease) -> LeaseReply:
        if isinstance(call, LeaseRequest):
            reply = await recorded(self.js, call, await self.grant(call))
            self._count(call, reply)
            return reply
        if isinstance(call, LeaseRenew):
            record = await self.store.renew(call.job_id, call.fence, self.ttl_s)
            if record is not None and await self._revoked_on_renewal(record, call.fence):
                return LeaseRefusal(
                    reason=LEASE_LOST,
                    detail="revoked: the holder is quarantined on the target, or its "
                    "circuit breaker is open",
                )
            if record is not None:
                # Beside the answer: a renewal must not wait on Redis.
                self.responder.spawn(self._keep_place(record))
                if self.breakers.known(record.target):  # a probe keeps its probe
                    self.responder.spawn(
                        self.breakers.keep_probe(record.target, call.job_id, call.fence, self.ttl_s)
                    )
                return LeaseGrant(fence=call.fence, ttl_s=self.ttl_s)
            return LeaseRefusal(reason=LEASE_LOST, detail="the lease is gone or superseded")
        record = await self.store.release(call.job_id, call.fence)
        if record is not None:
            await self._free_lease(record)
            if self.breakers.known(record.target):
                # A probe handed back unrun (or unanswered) decides nothing: the next
                # grant probes at once, not after the lease's TTL.
                probe = BreakerProbe(job_id=call.job_id, worker=record.worker, fence=call.fence)
                await self.breakers.free_probe(record.target, probe)
            avoid = None
            if call.avoid_reason:
                # The target refused the job there: the holder goes on its avoid list
                # before the answer, so the nak that follows finds it.
                scope, name = _holder_scope(record)
                avoid = await self.avoid.entry(call.job_id, scope, name, call.avoid_reason)
            attempt = _released_attempt(call, record)
            if call.refund or avoid is not None:
                # The refund and avoid entry are the release's own: a failed write is
                # answered busy, as before records were carried.
                await self.store.amend(
                    call.job_id, refund=call.refund, avoid=avoid, attempt=attempt
                )
            elif attempt is not None:
                await self._record_attempt(call.job_id, attempt, lost=False)
            return LeaseGrant(fence=call.fence, ttl_s=0.0)
        attempt = _released_attempt(call, None)
        if attempt is not None:
            # A lost lease's attempt still ran: recorded for the job's history if its
            # fence is the entry's newest grant, then refused as any release of a lost
            # lease.
            await self._record_attempt(call.job_id, attempt, lost=True)
        return LeaseRefusal(reason=LEASE_LOST, detail="the lease is gone or superseded")

    async def _record_attempt(self, job_id: str, attempt: AttemptRecord, lost: bool) -> None:
        """Add a released attempt's record to the job's ledger entry, best effort: the
        lease is already deleted (or was lost), so a failed write must not turn the
        answer into ``busy`` (the worker's retry would find the lease gone and its job
        wait out its whole ack wait instead of its retry delay). Logged, not raised."""
        try:
            await self.store.amend(job_id, attempt=attempt, lost=lost)
        except Exception as exc:
            log.warning(
                "job %s: the record of its attempt under fence %d is not in its ledger "
                "entry (its dead letter will miss it): %s",
                job_id,
                attempt.fence,
                exc,
            )

    async def _revoked_on_renewal(self, record: LeaseRecord, fence: int) -> bool:
        """Revoke a lease whose holder is quarantined on its target, or whose target's
        breaker cools, when it is renewed: a grant that slipped past every check and
        sweep is then held at most a third of the TTL. From the watches' memory."""
        found = await quarantine_on(
            self.quarantine, record.target, record.worker, record.identity, _subnet_of(record)
        )
        live = LiveLease(record, fence, 0)
        if found is not None:
            scope, name, _ = found
            avoid = (scope, name) if scope != "egress" else _holder_scope(record)
            revoked = await self._revoke(live, lambda _: avoid)
        elif await breaker_cooling(self.breakers, record.target) is not None:
            # As the breaker's sweeps do: the attempt is given back.
            revoked = await self._revoke(live, None, refund=True)
        else:
            return False
        if revoked and self.breakers.known(record.target):
            # A half-open breaker's probe lease revoked decides nothing: the next grant
            # probes at once, not after the lease's TTL.
            probe = BreakerProbe(job_id=record.job_id, worker=record.worker, fence=fence)
            await self.breakers.free_probe(record.target, probe)
        return revoked

    async def _keep_place(self, record: LeaseRecord) -> None:
        """Extend a renewed job's in-flight place. A place found missing was freed when
        the job settled (a renewal that raced the commit) or lost with Redis's state; the
        job's seal tells which, and a running job gets its place back, or new grants
        would fill the cap again beside it."""
        subnet = _subnet_of(record)
        if subnet and not await self.places.keep_subnet(
            record.target, record.job_id, record.worker, subnet
        ):
            await self._restore_subnet(record, subnet)
        if await self.places.keep(record.target, record.job_id):
            return
        if not await self._still_running(record):
            return
        await self.places.keep(record.target, record.job_id, restore=True)

    async def _free_lease(self, record: LeaseRecord) -> None:
        """Free a released or revoked lease's place and its own subnet hold: the job may
        have been granted to another worker since, whose hold stays."""
        await self.places.free_lease(
            record.target, record.job_id, record.worker, _subnet_of(record)
        )

    async def _still_running(self, record: LeaseRecord) -> bool:
        """Whether a renewed job whose place (or hold) was found missing still runs."""
        # Freed by a release (the lease is gone) or a settle (the job is sealed; its
        # lease is left to expire): a place put back then would be a ghost for a TTL.
        read = await self.store.read_history(record.job_id)
        if read.history is not None and read.history.settled is not None:
            return False
        return await self.store.live(record.job_id) is not None

    async def _restore_subnet(self, record: LeaseRecord, subnet: str) -> None:
        """Take the subnet hold of a running job again (Redis lost it). Another worker
        of the subnet may have taken the target meanwhile: then both serve it until
        this lease ends, and a warning says so."""
        if not await self._still_running(record):
            return
        try:
            held = await self.places.hold_subnet(
                record.target, record.job_id, record.worker, subnet, restore=True
            )
        except Exception as exc:
            log.warning("could not restore %s's subnet hold: %s", record.job_id, exc)
            return
        if not isinstance(held, str):
            log.warning(
                "job %s of worker %s (subnet %s) lost its hold on %s and another worker of "
                "the subnet holds it now: both serve it until this lease ends",
                record.job_id,
                record.worker,
                subnet,
                record.target,
            )

    def _count(self, request: LeaseRequest, reply: LeaseReply) -> None:
        answer = {LeaseGrant: "granted", LeaseRefusal: "refused"}.get(type(reply), "already-done")
        reason = reply.reason if isinstance(reply, LeaseRefusal) else ""
        self.answers.inc(answer=answer, reason=reason, target=request.target, worker=request.worker)

    async def grant(self, request: LeaseRequest) -> LeaseReply:
        """Run the grant checks in order; grant if none objects and no lease is live."""
        # The history (grant count and seal) is read while the checks run: one round
        # trip less per grant.
        history = asyncio.create_task(self.store.read_history(request.job_id))
        # Read beside the checks too: a job whose lease is live takes no place (its
        # holder has it), whether it is this delivery asking again or not.
        live_now = asyncio.create_task(self.store.live(request.job_id))
        ctx = GrantContext(
            request,
            self.settings,
            self.js,
            self.quarantine,
            self.places,
            history,
            self.permits,
            clock=self.clock,
            avoid=self.avoid,
            breakers=self.breakers,
            pauses=self.pauses,
            versions=self.versions,
        )
        try:
            verdict = await first_objection(ctx)
            if verdict is not None:
                return verdict
            held = await self._held_already(request, await live_now)
            if held is not None:
                return held
            try:
                verdict = await taking_objection(ctx)
            except BaseException:
                # A check failed (or the ask was cancelled) after others took a place,
                # a subnet hold: they go now, not one lease TTL later.
                await _shielded(free_taken(ctx))
                raise
            if verdict is not None:
                return verdict
            record = LeaseRecord(
                job_id=request.job_id,
                target=request.target,
                key=request.key,
                version=tuple_id(request.versions),
                worker=request.worker,
                identity=request.identity,
                reply_subject=request.reply_subject,
                # As the subnet hold has it, so the renewals keep that hold.
                subnet=ctx.took_subnet[0] if ctx.took_subnet else request.subnet,
                region=request.region,
            )
            try:
                fence = await self.store.create(record, self.ttl_s)
            except BaseException:
                # No lease came of it: its new place and subnet hold go too.
                await _shielded(free_taken(ctx))
                raise
            if fence is None:
                # Granted by another ask meanwhile. Places are the job's, not the ask's:
                # the place this ask took may be the one the holder found and kept, so
                # it stays (a renewal keeps it, the settle frees it).
                held = await self._held_already(request, await self.store.live(request.job_id))
                if not isinstance(held, LeaseGrant):
                    # The holder's own hold stays; this ask's is nobody's.
                    ctx.took_place[0] = False
                    await free_taken(ctx)
                return held or LeaseRefusal(
                    reason="held", retry_after_s=self.ttl_s, detail="lease held by another ask"
                )
            late = await paused(ctx) or await quarantined(ctx) or await circuit_open(ctx)
            if late is not None:
                await free_taken(ctx)  # its probe too, if it took one: the next grant probes
                return await self._landed_late(request, fence, late)
            if ctx.probe[0]:  # the half-open breaker's probe: its outcome names this fence
                probe = BreakerProbe(job_id=request.job_id, worker=request.worker, fence=fence)
                await self.breakers.mark_probe(request.target, probe, ctx.probe[0], self.ttl_s)
            try:
                read: HistoryEntry | None = await history
            except Exception:  # the early read failed: record_grant reads it again
                read = None
            recorded = await self.store.record_grant(request.job_id, fence, read)
            if recorded.settled is not None:  # sealed since the checks read it
                if ctx.probe[0]:  # nothing is sent under it: the next grant probes
                    probe = BreakerProbe(job_id=request.job_id, worker=request.worker, fence=fence)
                    await self.breakers.free_probe(request.target, probe)
                return await self._nobodys(request, fence, recorded.settled)
        finally:
            if not live_now.done():
                live_now.cancel()
            live_now.add_done_callback(_ignore_outcome)
            if not history.done():
                history.cancel()
            # Not needed after a refusal; a failed read is retried by record_grant.
            history.add_done_callback(_ignore_outcome)
        return LeaseGrant(fence=fence, ttl_s=self.ttl_s, attempt=recorded.grants)

    async def _landed_late(
        self, request: LeaseRequest, fence: int, refusal: LeaseRefusal
    ) -> LeaseRefusal:
        """A lease made after a quarantine or a breaker's opening landed (the check ran
        before it, the taking checks and the create took long enough that both sweeps
        may have run already): take it back and refuse, before the grant is recorded, so
        it spends no attempt. Cheap: the checks answer from the watches' memory."""
        await self.store.release(request.job_id, fence)
        # The job's place; this ask's subnet hold went with free_taken.
        await self.places.free_lease(request.target, request.job_id, request.worker, "")
        log.warning(
            "took back the lease of %s just made for %s: %s",
            request.job_id,
            request.worker,
            refusal.detail,
        )
        return refusal

    async def _held_already(
        self, request: LeaseRequest, live: LiveLease | None
    ) -> LeaseReply | None:
        """None when no lease is live; else the live lease again if it is this very
        delivery's (``_grant_again``), or ``held``."""
        if live is None:
            return None
        again = await self._grant_again(request, live)
        if again is not None:
            return again
        return LeaseRefusal(
            reason="held", retry_after_s=self.ttl_s, detail=f"lease held by {live.record.worker}"
        )

    async def _grant_again(
        self, request: LeaseRequest, live: LiveLease | None
    ) -> LeaseReply | None:
        """The live lease again, renewed, if it was granted to this very delivery (same
        worker, same reply subject) whose answer was lost or late: asking again must not
        leave the job waiting out its own lease as ``held`` and spend an attempt.

        The replica that made the grant may not have recorded it yet (it is slow, or died
        after its create): the grant is recorded here, which counts it once whoever is
        first, so the attempt number includes it. Read instead, the count could miss this
        grant and let a job granted past its last attempt run once more."""
        if (
            live is None
            or not request.reply_subject
            or live.record.reply_subject != request.reply_subject
            or live.record.worker != request.worker
        ):
            return None
        if await self.store.renew(request.job_id, live.fence, self.ttl_s) is None:
            return None
        recorded = await self.store.record_grant(request.job_id, live.fence)
        if recorded.settled is not None:
            return await self._nobodys(request, live.fence, recorded.settled)
        return LeaseGrant(fence=live.fence, ttl_s=self.ttl_s, attempt=recorded.grants)

    async def _nobodys(self, request: LeaseRequest, fence: int, sealed: Sealed) -> LeaseReply:
        """A lease made for a job sealed meanwhile is nobody's: delete it, free its place,
        and answer from the seal."""
        await self.store.release(request.job_id, fence)
        await self.places.free(request.target, request.job_id)
        return await answer_settled(self.js, request, sealed)

    async def command(self, command: QuarantineCommand) -> QuarantineReply:
        """Apply a quarantine command (an operator's, or a rule's set)."""
        if isinstance(command, QuarantineList):
            return QuarantineReply(ok=True, records=await self.quarantine.all())
        if isinstance(command, QuarantineRelease):
            await self.quarantine.remove(command.scope, command.name, command.target)
            return QuarantineReply(ok=True)
        if isinstance(command, QuarantineApprove | QuarantineReject):
            return await self.proposals.answer(command)
        return await self.set_record(command.record)

    async def set_record(self, record: QuarantineRecord) -> QuarantineReply:
        """Store a quarantine record (unless a rule's would replace one that outlasts it),
        then revoke the scope's held leases on the target and requeue their jobs.

        The record is written by compare-and-set on the revision read: another command
        on the same scope landing in between makes this one read and decide again."""
        for _ in range(PUT_TRIES):
            current = await self.quarantine.entry(record.scope, record.name, record.target)
            if current is not None and await self._outlasts(current, record):
                kept = current.record
                return QuarantineReply(
                    ok=True,
                    records=[kept],
                    detail=f"kept the record in force (set by {kept.set_by or 'unknown'}, "
                    f"for_s {kept.for_s:g}): it outlasts the rule's, which does not "
                    "shorten it",
                )
            if await self.quarantine.put(record, current.revision if current else 0):
                break
        else:
            # Answered as failed, with a retry-after: the sender asks again.
            raise RuntimeError(
                f"the record of {record.scope} {record.name} on {record.target} kept "
                "changing while it was set: too much contention"
            )
        revoked = await self.revoke_scope(record.scope, record.name, record.target)
        log.warning(
            "quarantined %s %s on %s (%s); revoked %d lease(s)",
            record.scope,
            record.name,
            record.target,
            record.reason,
            len(revoked),
        )
        self._spawn_task(self._sweep_again(record))
        return QuarantineReply(ok=True, records=[record], revoked=revoked)

    async def _outlasts(self, current: BookEntry, record: QuarantineRecord) -> bool:
        """Whether a rule's ``record`` must keep ``current`` rather than replace it:
        ``current`` lasts at least as long from now, by the server's clock (its stored
        time plus its TTL). An operator's command always replaces.

        Kept only by how long it has left, not by who set it or its ``for_s``: a rule
        kept under a short record (an operator's ``--for 3``) would otherwise be lost
        when it expires, its fired marker claimed.
        """
        if not record.set_by.startswith("rule:"):
            return False
        if current.record.for_s <= 0:  # until released: nothing outlasts it
            return True
        if record.for_s <= 0:
            return False
        now = await self.clock.now()
        if now is None:
            # Raised: answered failed with a retry-after, so the rule asks again.
            raise RuntimeError("the NATS server's time cannot be read: cannot judge a record")
        left = current.left_s(now.timestamp())
        assert left is not None
        return left >= record.for_s

    async def _sweep_again(self, record: QuarantineRecord) -> None:
        # Other replicas learn of the quarantine through their KV watch within
        # milliseconds; a grant they made in that window is revoked by this second sweep.
        await asyncio.sleep(QUARANTINE_PROPAGATION_S)
        late = await self.revoke_scope(record.scope, record.name, record.target)
        if late:
            log.warning(
                "revoked %d lease(s) granted while the quarantine propagated: %s",
                len(late),
                ", ".join(late),
            )

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        self.responder.spawn(coro)

    async def revoke_scope(self, scope: QuarantineScope, name: str, target: str) -> list[str]:
        """Revoke the scope's live leases on ``target`` and requeue their jobs at once.

        The lease is deleted first (the holder's renewal and commit then fail), then the
        holder goes on the job's avoid list, then the delivery recorded in the lease is
        nakked, so JetStream redelivers it now rather than after the visibility timeout,
        and the redelivery finds the entry.
        """

        def holds(record: LeaseRecord) -> bool:
            holder = {"worker": record.worker, "identity": record.identity}.get(
                scope, record.subnet
            )
            return holder == name

        def avoid_as(record: LeaseRecord) -> tuple[AvoidScope, str]:
            # An egress record's subnet is no one to avoid on its own: the entry names
            # the holder (its identity, else its worker id).
            return (scope, name) if scope != "egress" else _holder_scope(record)

        return await self.revoke_where(target, holds, avoid_as)

    async def revoke_target(self, target: str) -> list[str]:
        """Revoke every live lease of ``target`` (its breaker opened); requeue the jobs.
        No avoid entry: the whole target is paused, for every identity alike. The attempt
        is refunded: the fleet paused the target, the job did nothing wrong."""
        return await self.revoke_where(target, lambda _: True, refund=True)

    async def revoke_paused(self, record: PauseRecord) -> list[str]:
        """Revoke every live lease ``record`` covers (a pause ``--now``) and requeue its
        job. No avoid entry, and the attempt is refunded: the fleet paused it, the job did
        nothing wrong."""
        revoked = []
        for live in await self.store.all_live():
            held = live.record
            if not covers(record, held.target, held.region, held.worker, held.identity):
                continue
            if await self._revoke(live, None, refund=True):
                revoked.append(held.job_id)
        return revoked

    async def revoke_where(
        self,
        target: str,
        holds: Callable[[LeaseRecord], bool],
        avoid_as: Callable[[LeaseRecord], tuple[AvoidScope, str]] | None = None,
        refund: bool = False,
    ) -> list[str]:
        """Revoke the live leases on ``target`` whose record ``holds`` accepts, as
        ``revoke_scope`` says (with ``avoid_as`` naming whom each job avoids, and the
        attempt given back with ``refund``); the revoked job ids."""
        revoked = []
        for live in await self.store.all_live():
            record = live.record
            if record.target != target or not holds(record):
                continue
            if await self._revoke(live, avoid_as, refund):
                revoked.append(record.job_id)
        return revoked

    async def _revoke(
        self,
        live: LiveLease,
        avoid_as: Callable[[LeaseRecord], tuple[AvoidScope, str]] | None,
        refund: bool = False,
    ) -> bool:
        """Revoke one live lease and requeue its job (``revoke_scope`` says how, and
        ``refund`` gives its attempt back); whether it was revoked. A sealed job's lease
        (committed or dead-lettered: after the settle the lease is left to expire) is
        left alone: its job goes nowhere."""
        record = live.record
        read = await self.store.read_history(record.job_id)
        if read.history is not None and read.history.settled is not None:
            return False
        if not await self.store.revoke(live):
            return False
        await self._free_lease(record)
        avoid = None
        if avoid_as is not None:
            who, whom = avoid_as(record)
            avoid = await self.avoid.entry(record.job_id, who, whom, "quarantined")
        if refund or avoid is not None:
            await self.store.amend(record.job_id, refund=refund, avoid=avoid)
        if record.reply_subject.startswith(_DELIVERY_PREFIX):
            await self.nc.publish(record.reply_subject, b"-NAK")
        return True


def _subnet_of(record: LeaseRecord) -> str:
    """The subnet the record's holder holds its target for ('' if none or unreadable)."""
    if not record.subnet:
        return ""
    try:
        return canonical_subnet(record.subnet)
    except ValueError:
        return ""


def _released_attempt(call: LeaseRelease, record: LeaseRecord | None) -> AttemptRecord | None:
    """The attempt record a release carries, as the job's ledger entry keeps it: under
    the release's fence, and, when the lease was live, with the holder the leaser
    granted it to (its ``record``), not whoever the record names."""
    attempt = call.attempt
    if attempt is None:
        return None
    if record is None:
        return msgspec.structs.replace(attempt, fence=call.fence)
    return msgspec.structs.replace(
        attempt, fence=call.fence, worker=record.worker, identity=record.identity
    )


def _holder_scope(record: LeaseRecord) -> tuple[AvoidScope, str]:
    """What of a lease's holder an avoid entry names: its identity, or its worker id
    when it has none (a worker without an identity is still someone to move off)."""
    if record.identity:
        return "identity", record.identity
    return "worker", record.worker


_OPS: dict[type, str] = {LeaseRequest: "grant", LeaseRenew: "renew", LeaseRelease: "release"}


async def _shielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile (the caller's
    cancellation still propagates after it)."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


def _ignore_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as lost
