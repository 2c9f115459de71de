"""The ``avoided`` grant check: a job is not granted to a worker or identity on its
avoid list (jetfleet/avoid_list.py) while another live identity could take it.

The list comes with the job's history, which every grant reads anyway, so the check
costs no round trip unless an entry names the asker. Then the entry's marker is read
(it holds while the marker lives: a per-key TTL of ``fleet.avoid_s``, the NATS server's
clock), and the live identity claims (``jf-workers``), at most once per
``OWNERS_CACHE_S``: if no other live identity is off the list, the entry is waived and
the asker gets the job, since a job must not wait for someone who is not there.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from jetfleet.schemas.lease import AvoidEntry, AvoidScope, LeaseRefusal, LeaseRequest
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.avoid_list import marker_key, naming
from jetfleet.identity_presence import IdentityPresence
from jetfleet.leader_reads import last_message
from jetfleet.lease_store import HistoryEntry, ttl_whole_seconds

log = logging.getLogger(__name__)

AVOIDED = "avoided"
# How long a listing of the live identity claims is used (they change when workers
# start, drain or crash: seconds matter little against an entry's minutes).
OWNERS_CACHE_S = 2.0
_encoder = msgspec.json.Encoder()


class AvoidList:
    """Puts entries' markers and judges grants against a job's list."""

    def __init__(self, js: JetStreamContext, avoid_s: float) -> None:
        self.js = js
        self.avoid_s = avoid_s
        self._presence = IdentityPresence(js)
        self._owners: tuple[float, list[tuple[str, str]]] | None = None
        self._listing = asyncio.Lock()

    async def entry(
        self, job_id: str, scope: AvoidScope, name: str, reason: str
    ) -> AvoidEntry | None:
        """A new entry for ``name`` on the job's list, its marker put (TTL
        ``fleet.avoid_s``); the caller writes it to the job's history. None when the list
        is off (``fleet.avoid_s = 0``), ``name`` is empty, or the marker cannot be put
        (logged: the job then may go back to ``name``, whose quarantine or the target's
        hold still keeps it polite)."""
        if self.avoid_s <= 0 or not name:
            return None
        entry = AvoidEntry(scope=scope, name=name, reason=reason)
        subject = f"$KV.{subjects.BUCKET_CONTROL}.{marker_key(job_id, entry)}"
        try:
            # A publish, not kv.create: the same name again must restart its TTL.
            await self.js.publish(
                subject, _encoder.encode(entry), msg_ttl=ttl_whole_seconds(self.avoid_s)
            )
        except Exception as exc:
            log.warning("job %s: %s %s not put on its avoid list: %s", job_id, scope, name, exc)
            return None
        return entry

    async def objection(
        self, request: LeaseRequest, history: asyncio.Future[HistoryEntry]
    ) -> LeaseRefusal | None:
        """``refused: avoided`` (retry at once: it is about the job, not the target)
        when an entry in force names the asker and another live identity could take
        the job; else None."""
        if self.avoid_s <= 0 or request.pin_identity or request.pin_region:
            # Pinned, the job runs on its identity (or in its region) or on nobody: the
            # live identities elsewhere could not take it, and the claims do not say
            # which region each is in, so a region pin waives the list too.
            return None
        try:
            read = await history
        except Exception:  # unknown here; the job may run on the asker
            return None
        if read.history is None or not read.history.avoid:
            return None
        entries = read.history.avoid
        hits = await self._holding(
            request.job_id, naming(entries, request.worker, request.identity)
        )
        if not hits or not await self._someone_else(request, entries):
            return None
        hit = hits[0]
        return LeaseRefusal(
            reason=AVOIDED,
            retry_after_s=0.0,
            detail=f"job {request.job_id} avoids {hit.scope} {hit.name} on {request.target} "
            f"for up to fleet.avoid_s ({self.avoid_s:g} s): {hit.reason or 'no reason given'}",
        )

    async def _holding(self, job_id: str, entries: list[AvoidEntry]) -> list[AvoidEntry]:
        """Those of ``entries`` whose marker lives. Unreadable: they hold (the job
        waits, at most ``fleet.avoid_s``, rather than go back where it was refused)."""

        async def holds(entry: AvoidEntry) -> bool:
            subject = f"$KV.{subjects.BUCKET_CONTROL}.{marker_key(job_id, entry)}"
            try:
                msg = await last_message(self.js, f"KV_{subjects.BUCKET_CONTROL}", subject)
            except Exception as exc:
                log.warning("cannot read an avoid marker of job %s (%s): it holds", job_id, exc)
                return True
            return (
                msg is not None and bool(msg.data) and not (msg.headers or {}).get("KV-Operation")
            )

        found = await asyncio.gather(*(holds(e) for e in entries))
        return [e for e, live in zip(entries, found, strict=True) if live]

    async def _someone_else(self, request: LeaseRequest, entries: list[AvoidEntry]) -> bool:
        """Whether a live identity claim other than the asker's is named by no entry in
        force. Unreadable: yes (the job waits, at most ``fleet.avoid_s``)."""
        try:
            owners = await self._live_owners()
        except Exception as exc:
            log.warning("cannot list the live identities (%s): avoid entries stand", exc)
            return True
        for identity, worker in owners:
            if worker == request.worker or identity == request.identity:
                continue
            if not await self._holding(request.job_id, naming(entries, worker, identity)):
                return True
        return False

    async def _live_owners(self) -> list[tuple[str, str]]:
        async with self._listing:  # one listing at a time; the others use it
            if self._owners is None or time.monotonic() - self._owners[0] >= OWNERS_CACHE_S:
                self._owners = (time.monotonic(), await self._presence.owners())
            return self._owners[1]
