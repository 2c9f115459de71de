"""The leaser's side of the approved version set (docs/versions.md): the grant check's
book of approved tuple ids (a KV watch), the sightings it records, and the commands on
``jf.versions`` (list, approve, revoke, guard).

Approvals live in ``jf-control`` under ``version-approved.<id>`` with no TTL; a revoke
deletes the approval with a compare-and-set on its revision, so of two replicas (or two
quarantine replicas' guards asking at once) only one withdraws a tuple, and only it
writes the withdrawal and alerts: the other answers ``not approved``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from jetfleet.schemas.lease import LeaseRefusal, LeaseRequest
from jetfleet.schemas.report import Versions
from jetfleet.schemas.versions import (
    VersionAlert,
    VersionApproval,
    VersionsApprove,
    VersionsCommand,
    VersionsGuard,
    VersionSighting,
    VersionsReply,
    VersionsRevoke,
    VersionWithdrawal,
)
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.kv_watch import KeyWatch
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.settings import Settings
from jetfleet.version_records import stored_ids, version_view
from jetfleet.version_tuple import tuple_id

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_sighting_decoder = msgspec.json.Decoder(VersionSighting)
_approval_decoder = msgspec.json.Decoder(VersionApproval)
# A tuple not approved: approvals are rare operator acts, so ask again at this pace.
VERSION_RETRY_S = 30.0
# Sightings: kept a day by the server (per-key TTL), written again by a replica at most
# this often per tuple, never on every grant.
SEEN_TTL_S = 86400.0
SEEN_EVERY_S = 300.0
MAX_REMEMBERED = 10_000
GUARD_BY = "rollout-guard"
TUPLE_ID_RE = re.compile(r"^[0-9a-f]{12}$")


def approved_key(tid: str) -> str:
    """The ``jf-control`` key of a tuple's approval."""
    return f"{subjects.VERSION_APPROVED_PREFIX}.{tid}"


class ApprovedVersions:
    """Which tuple ids are approved, followed with a KV watch; records sightings."""

    def __init__(
        self,
        settings: Settings,
        js: JetStreamContext,
        control: KeyValue,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.settings = settings
        self.js = js
        self.control = control
        self.spawn = spawn
        self.watch = KeyWatch(control, f"{subjects.VERSION_APPROVED_PREFIX}.>", "version")
        # Under ``when-set`` the gate is set once any tuple was approved, not only while
        # one is: revoking the last approved tuple must not let every tuple (the revoked
        # one first) be granted again. A withdrawal on record says a tuple was approved
        # (it outlives restarts); an approval this replica's watch saw says so at once
        # (the withdrawal is written just after the approval's delete).
        self.withdrawn = KeyWatch(
            control, f"{subjects.VERSION_WITHDRAWN_PREFIX}.>", "version withdrawal"
        )
        self._approval_seen = False
        self._seen_at: dict[str, float] = {}

    async def start(self) -> None:
        """Load the approved set and follow changes."""

        def seen(_: str) -> None:
            self._approval_seen = True

        self.watch.on_new = seen
        await self.withdrawn.start()
        await self.watch.start()
        self._approval_seen = self._approval_seen or bool(self.watch.keys)

    async def stop(self) -> None:
        """Stop following changes."""
        await self.watch.stop()
        await self.withdrawn.stop()

    async def objection(self, request: LeaseRequest) -> LeaseRefusal | None:
        """``version-not-approved`` for a tuple outside the approved set, as
        ``versions.gate`` says; None otherwise. Records the tuple as seen."""
        gate = self.settings.versions.gate
        if gate == "off":
            return None
        tid = tuple_id(request.versions)
        self._sighted(tid, request.versions, request.worker)
        if await self._approved(tid, need_any=gate == "when-set"):
            return None
        return LeaseRefusal(
            reason="version-not-approved",
            retry_after_s=VERSION_RETRY_S,
            detail=f"version tuple {tid} of worker {request.worker} is not in the approved "
            f"set (versions.gate = {gate}): approve it with `jetfleet versions approve {tid}`"
            ", or see why it was withdrawn with `jetfleet versions list`",
        )

    async def _approved(self, tid: str, need_any: bool) -> bool:
        """Whether ``tid`` is approved; with ``need_any``, also true while no tuple was
        ever approved (none is, and none was withdrawn)."""
        if self.watch.following() and self.withdrawn.following():
            keys = self.watch.keys
            if approved_key(tid) in keys:
                return True
            never = not keys and not self._approval_seen and not self.withdrawn.keys
            return need_any and never
        # A watch died: read, failing closed on the approval, open on an empty record.
        try:
            await self.control.get(approved_key(tid))
            return True
        except KeyNotFoundError:
            pass
        if not need_any or self._approval_seen:
            return False
        # From the stream, not ``kv.keys()``: its ``filters`` match substrings, not
        # subject wildcards (``version-approved.>`` matched no key, so this answered
        # "none approved" and let every tuple through), and it may return partial results.
        for prefix in (subjects.VERSION_APPROVED_PREFIX, subjects.VERSION_WITHDRAWN_PREFIX):
            if await stored_ids(self.js, prefix):
                return False
        return True

    def _sighted(self, tid: str, versions: Versions, worker: str) -> None:
        now = time.monotonic()
        if now - self._seen_at.get(tid, -SEEN_EVERY_S) < SEEN_EVERY_S:
            return
        if len(self._seen_at) >= MAX_REMEMBERED:
            self._seen_at.clear()  # workers sending ever new tuples cost memory, not KV
        self._seen_at[tid] = now
        bare = msgspec.structs.replace(versions, handler="", id=tid)
        self.spawn(self._write_sighting(tid, VersionSighting(versions=bare, worker=worker)))

    async def _write_sighting(self, tid: str, sighting: VersionSighting) -> None:
        subject = f"$KV.{subjects.BUCKET_CONTROL}.{subjects.VERSION_SEEN_PREFIX}.{tid}"
        try:
            await self.js.publish(
                subject, _encoder.encode(sighting), msg_ttl=ttl_whole_seconds(SEEN_TTL_S)
            )
        except Exception as exc:  # a sighting is for operators' eyes; the grant goes on
            self._seen_at.pop(tid, None)
            log.warning("could not record version tuple %s as seen: %r", tid, exc)


def _approval_of(data: bytes) -> VersionApproval | None:
    try:
        return _approval_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # written by hand: withdrawn all the same


def versions_objection(command: VersionsCommand) -> VersionsReply | None:
    """What is wrong with a versions command its type admits, with what to fix; or None."""
    if not isinstance(command, VersionsApprove):
        return None
    if command.versions is None and not TUPLE_ID_RE.match(command.id):
        return VersionsReply(
            ok=False,
            detail=f"approve names no tuple: give a tuple id (12 hex digits, from "
            f"`jetfleet versions list`), not {command.id[:64]!r}, or the tuple itself",
        )
    return None


class VersionCommands:
    """Applies ``jf.versions`` commands for one leaser replica."""

    def __init__(self, settings: Settings, js: JetStreamContext, control: KeyValue) -> None:
        self.settings = settings
        self.js = js
        self.control = control

    async def command(self, command: VersionsCommand) -> VersionsReply:
        """Apply one versions command."""
        if isinstance(command, VersionsApprove):
            return await self._approve(command)
        if isinstance(command, VersionsRevoke):
            return await self._revoke(command)
        if isinstance(command, VersionsGuard):
            return await self._guard(command.on, command.by, command.why)
        view = await version_view(self.js, self.settings.versions.gate)
        return VersionsReply(ok=True, view=view)

    async def _approve(self, command: VersionsApprove) -> VersionsReply:
        versions = command.versions
        if versions is None:
            versions = await self._seen(command.id)
            if versions is None:
                return VersionsReply(
                    ok=False,
                    detail=f"no leaser saw tuple {command.id!r} in the last "
                    f"{SEEN_TTL_S / 3600:g} h: approve it with `jetfleet versions approve "
                    "--current` on a machine that runs it, or start one of its workers",
                )
        tid = tuple_id(versions)
        if command.id and command.id != tid:
            return VersionsReply(
                ok=False, detail=f"the tuple sent has id {tid}, not {command.id}: nothing done"
            )
        bare = msgspec.structs.replace(versions, handler="", id=tid)
        record = VersionApproval(versions=bare, by=command.by, why=command.why)
        try:
            # Put-if-absent: an approval's stored time orders the approved set (the
            # earliest is the rollout guard's incumbent), so approving an approved tuple
            # again must not make it the newest, to be judged (and withdrawn) against
            # the canary approved after it.
            await self.control.create(approved_key(tid), _encoder.encode(record))
        except KeyWrongLastSequenceError:
            return VersionsReply(ok=True, detail=f"already approved: version tuple {tid}")
        await self._forget_withdrawal(tid)
        log.warning("version tuple %s approved by %s: %s", tid, command.by, command.why)
        return VersionsReply(ok=True, detail=f"approved: version tuple {tid}")

    async def _seen(self, tid: str) -> Versions | None:
        try:
            entry = await self.control.get(f"{subjects.VERSION_SEEN_PREFIX}.{tid}")
        except KeyNotFoundError:
            return None
        try:
            return _sighting_decoder.decode(entry.value or b"").versions
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _forget_withdrawal(self, tid: str) -> None:
        with contextlib.suppress(KeyNotFoundError):
            await self.control.delete(f"{subjects.VERSION_WITHDRAWN_PREFIX}.{tid}")

    async def _revoke(self, command: VersionsRevoke) -> VersionsReply:
        tid = command.id
        try:
            entry = await self.control.get(approved_key(tid))
        except KeyNotFoundError:
            return VersionsReply(ok=True, detail=f"not approved: version tuple {tid}")
        try:
            await self.control.delete(approved_key(tid), last=entry.revision)
        except KeyWrongLastSequenceError:
            return VersionsReply(ok=True, detail=f"kept: another replica changed {tid} first")
        approval = _approval_of(entry.value or b"")
        withdrawal = VersionWithdrawal(
            versions=approval.versions if approval else None,
            by=command.by,
            why=command.why,
            figures=command.figures,
        )
        await self.control.put(
            f"{subjects.VERSION_WITHDRAWN_PREFIX}.{tid}", _encoder.encode(withdrawal)
        )
        log.warning("version tuple %s withdrawn by %s: %s", tid, command.by, command.why)
        await self._alert(tid, withdrawal)
        return VersionsReply(ok=True, detail=f"withdrawn: version tuple {tid}")

    async def _alert(self, tid: str, withdrawal: VersionWithdrawal) -> None:
        alert = VersionAlert(
            id=tid, by=withdrawal.by, why=withdrawal.why, figures=withdrawal.figures
        )
        try:
            await self.js.publish(subjects.VERSIONS_ALERT, _encoder.encode(alert))
        except Exception as exc:  # the withdrawal is made; an alert lost is logged
            log.error("the withdrawal alert of version tuple %s was not stored: %r", tid, exc)

    async def _guard(self, on: bool, by: str, why: str) -> VersionsReply:
        await self.control.put(subjects.VERSION_GUARD_KEY, b"on" if on else b"off")
        state = "on" if on else "off"
        log.warning("rollout guard turned %s by %s: %s", state, by, why)
        return VersionsReply(ok=True, detail=f"rollout guard {state}")
