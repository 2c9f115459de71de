"""Leases in JetStream KV, judged by the server's clock.

Shared by the leaser (which grants, renews, releases and revokes) and the sink (which
checks a commit's fence). A lease is the key ``<job id>`` in ``jf-leases`` with a per-key
TTL; its fence is the revision of the grant. ``jf-fences`` keeps, per job, the
submission that claimed its id, the highest fence ever granted, the number of grants and
the seal (the job's one terminal decision, docs/commit.md#the-settle-rule). Every read
is answered by the stream leader (docs/commit.md#which-reads-may-be-stale).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.attempt_history import with_attempt
from jetfleet.avoid_list import with_entry
from jetfleet.js_errors import is_wrong_last_sequence
from jetfleet.js_publish import publish_js
from jetfleet.leader_reads import leader_bucket
from jetfleet.schemas.lease import AvoidEntry, JobLeaseHistory, LeaseRecord, Sealed
from jetfleet.schemas.report import AttemptRecord

# Compare-and-set attempts before a write gives up under contention.
_CAS_TRIES = 10
_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(LeaseRecord)
_history_decoder = msgspec.json.Decoder(JobLeaseHistory)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HistoryEntry:
    """A job's fence history as read, with the revision to compare-and-set against."""

    history: JobLeaseHistory | None
    revision: int


@dataclass(frozen=True)
class JobClaim:
    """A job id's claim as admission found or made it."""

    owner: int
    """The ``JF_SUBMIT`` sequence of the submission that owns the id (0: an earlier job
    from before claims)."""
    revision: int
    """The revision of the job's ``jf-fences`` entry as read or written."""
    routed: bool
    """The job has a work order already: marked routed, granted or sealed."""


@dataclass(frozen=True)
class LiveLease:
    """A lease as read from KV: its record, fence and current revision."""

    record: LeaseRecord
    fence: int
    revision: int


def ttl_whole_seconds(ttl_s: float) -> int:
    """JetStream's per-message TTL is whole seconds, at least 1 (nats-py would send "0")."""
    return max(1, math.ceil(ttl_s))


class LeaseStore:
    """Reads and writes leases and per-job fence history."""

    def __init__(self, js: JetStreamContext, leases: KeyValue, history: KeyValue) -> None:
        self.js = js
        self.leases = leases
        self.history = history

    @classmethod
    async def open(cls, js: JetStreamContext) -> LeaseStore:
        """Bind to the buckets (declared by the topology). Every read is a leader read:
        the fence and lease checks rest on them."""
        return cls(
            js,
            await leader_bucket(js, subjects.BUCKET_LEASES),
            await leader_bucket(js, subjects.BUCKET_FENCES),
        )

    async def live(self, job_id: str) -> LiveLease | None:
        """The job's live lease, or None when there is none (expired, released, revoked)."""
        try:
            entry = await self.leases.get(job_id)
        except KeyNotFoundError:  # KeyDeletedError is a subclass
            return None
        if not entry.value or entry.revision is None:
            return None
        record = _record_decoder.decode(entry.value)
        return LiveLease(record, record.fence or entry.revision, entry.revision)

    async def highest_fence(self, job_id: str) -> JobLeaseHistory:
        """The highest fence ever granted for the job (fence 0 when never granted)."""
        try:
            entry = await self.history.get(job_id)
        except KeyNotFoundError:
            return JobLeaseHistory(fence=0, grants=0)
        return _history_decoder.decode(entry.value) if entry.value else JobLeaseHistory(0, 0)

    async def create(self, record: LeaseRecord, ttl_s: float) -> int | None:
        """Create the lease if none is live; its revision (the fence), or None if held."""
        try:
            return await self.leases.create(
                record.job_id, _encoder.encode(record), msg_ttl=ttl_whole_seconds(ttl_s)
            )
        except KeyWrongLastSequenceError:
            return None

    async def read_history(self, job_id: str) -> HistoryEntry:
        """The job's fence history and its revision (0 when there is none), for
        ``record_grant``'s compare-and-set."""
        try:
            entry = await self.history.get(job_id)
        except KeyNotFoundError:
            return HistoryEntry(None, 0)
        old = _history_decoder.decode(entry.value) if entry.value else None
        return HistoryEntry(old, entry.revision or 0)

    async def claim(self, job_id: str, submit_seq: int) -> JobClaim:
        """Claim ``job_id`` for the submission at ``submit_seq`` (put-if-absent of the
        job's history). Its owner is ``submit_seq`` when the id is new or already this
        submission's (a scheduler re-admitting it after a restart), another submission
        (0: one from before claims) while an earlier job's history lives."""
        claim = JobLeaseHistory(fence=0, grants=0, submit_seq=submit_seq)
        for _ in range(_CAS_TRIES):
            revision = await self._write_history(job_id, claim, last=0)
            if revision:
                return JobClaim(submit_seq, revision, routed=False)
            read = await self.read_history(job_id)
            if read.history is not None:
                return JobClaim(read.history.submit_seq, read.revision, _routed(read.history))
            # Gone between the two (its age ran out): claim again.
        raise RuntimeError(f"could not claim job id {job_id}: too much contention")

    async def mark_routed(self, job_id: str, claim: JobClaim, work_seq: int) -> bool:
        """Note that the claim's job was routed as ``JF_WORK`` sequence ``work_seq``, so a
        redelivery of its submission after the work stream's duplicate window is not
        routed again. One compare-and-set on the claim as found; False if the entry moved
        since, which only a grant or a seal does (or a replica marking it first): each
        says as well that the job was routed."""
        routed = JobLeaseHistory(fence=0, grants=0, submit_seq=claim.owner, routed_seq=work_seq)
        return await self._write_history(job_id, routed, claim.revision) > 0

    async def record_grant(
        self, job_id: str, fence: int, read: HistoryEntry | None = None
    ) -> JobLeaseHistory:
        """Note ``fence`` as the job's highest and count the grant; the new history.

        A settled job gets no grant: its history comes back unchanged, with ``settled``
        set, and the caller must refuse. The compare-and-set is what makes this safe: a
        seal written after ``read`` moves the revision, so the write fails and the
        history is read again.

        A grant is counted once, whoever records it: the replica that made it, or one
        that found it again for the same delivery first (``fence`` already recorded, or
        superseded by a higher one, comes back unchanged).

        ``read`` is the history as read before the grant (saves a round trip); on a
        conflict the history is read again.
        """
        for _ in range(_CAS_TRIES):
            if read is None:
                read = await self.read_history(job_id)
            old, last = read.history, read.revision
            read = None
            if old is not None and (old.settled is not None or old.fence >= fence):
                return old
            new = (
                msgspec.structs.replace(old, fence=max(fence, old.fence), grants=old.grants + 1)
                if old
                else JobLeaseHistory(fence=fence, grants=1)
            )
            if await self._write_history(job_id, new, last):
                return new
        raise RuntimeError(f"could not record the grant of {job_id}: too much contention")

    async def seal(self, job_id: str, sealed: Sealed, read: HistoryEntry) -> bool:
        """Write ``sealed`` as the job's terminal decision if its history is still as
        ``read`` (no grant, refund or other seal since); False if it moved."""
        old = read.history or JobLeaseHistory(fence=0, grants=0)
        written = await self._write_history(
            job_id, msgspec.structs.replace(old, settled=sealed), read.revision
        )
        return written > 0

    async def _write_history(self, job_id: str, new: JobLeaseHistory, last: int) -> int:
        """Compare-and-set the history on revision ``last`` (0: create); the new revision,
        or 0 if it moved."""
        try:
            if last:
                return await self.history.update(job_id, _encoder.encode(new), last=last)
            return await self.history.create(job_id, _encoder.encode(new))
        except KeyWrongLastSequenceError:
            return 0

    async def amend(
        self,
        job_id: str,
        refund: bool = False,
        avoid: AvoidEntry | None = None,
        attempt: AttemptRecord | None = None,
        lost: bool = False,
    ) -> None:
        """After a release or a revoke, in one compare-and-set: take back one grant
        (``refund``), put ``avoid`` on the job's avoid list (its marker is the caller's)
        and add ``attempt`` to its attempts (``with_attempt``). The attempt of a live
        lease's release is kept if its fence is one the entry granted (above 0, at most
        its highest); that of a lost lease's (``lost``: the release was refused, so
        nothing proves the fence was this job's) only if its fence is the entry's
        highest, the newest holder's: fences are global, so any lower one could be
        another job's, sent to evict the real records. A settled job's entry is left as
        it is: it runs no more, and its letter is written from what the entry held.
        Given up, with the entry unchanged, under too much contention."""
        for _ in range(_CAS_TRIES):
            read = await self.read_history(job_id)
            old = read.history
            if old is None or old.settled is not None:
                return
            new = old
            if refund:
                new = msgspec.structs.replace(new, grants=max(0, new.grants - 1))
            if avoid is not None:
                new = msgspec.structs.replace(new, avoid=with_entry(new.avoid, avoid))
            if attempt is not None and _recordable(attempt.fence, old.fence, lost):
                # Clamped to the grants before this release's refund: the attempt it
                # ends was counted among them.
                attempts = with_attempt(new.attempts, attempt, old.grants)
                if attempts is not new.attempts:
                    new = msgspec.structs.replace(new, attempts=attempts)
            if new is old or await self._write_history(job_id, new, read.revision):
                return
        # Not silent: the refund (an attempt that never ran), the avoid entry or the
        # attempt's record is lost.
        log.warning(
            "job %s: gave up amending its ledger entry after %d compare-and-sets "
            "(refund %s, avoid %s, attempt %s): under contention, it stays as it was",
            job_id,
            _CAS_TRIES,
            refund,
            avoid.name if avoid is not None else "-",
            attempt.fence if attempt is not None else "-",
        )

    async def renew(self, job_id: str, fence: int, ttl_s: float) -> LeaseRecord | None:
        """Extend the lease if ``fence`` is still the live one (compare-and-set); its
        record, or None when it is not ours any more.

        nats-py's ``kv.update`` cannot carry a TTL, so the CAS is a publish with
        ``Nats-Expected-Last-Subject-Sequence`` and ``Nats-TTL``.
        """

        async def extend(live: LiveLease) -> LeaseRecord:
            record = msgspec.structs.replace(live.record, fence=fence)
            await publish_js(
                self.js,
                f"$KV.{subjects.BUCKET_LEASES}.{job_id}",
                _encoder.encode(record),
                {
                    "Nats-Expected-Last-Subject-Sequence": str(live.revision),
                    "Nats-TTL": str(ttl_whole_seconds(ttl_s)),
                },
            )
            return record

        return await self._while_ours(job_id, fence, extend)

    async def release(self, job_id: str, fence: int) -> LeaseRecord | None:
        """Delete the lease if ``fence`` is still the live one; its record, or None if it
        is not ours."""

        async def delete(live: LiveLease) -> LeaseRecord:
            await self.leases.delete(job_id, last=live.revision)
            return live.record

        return await self._while_ours(job_id, fence, delete)

    async def _while_ours(
        self, job_id: str, fence: int, write: Callable[[LiveLease], Awaitable[LeaseRecord]]
    ) -> LeaseRecord | None:
        """``write`` the live lease, compare-and-set on its revision, if ``fence`` holds
        it; None if not. A conflict with the same fence still live (its renewal, sent just
        before, landed first) is read and tried again, so a release or revoke racing the
        holder's renewal does not mistake it for a lost lease."""
        for _ in range(_CAS_TRIES):
            live = await self.live(job_id)
            if live is None or live.fence != fence:
                return None
            try:
                return await write(live)
            except APIError as exc:
                if not is_wrong_last_sequence(exc):
                    raise
        return None

    async def revoke(self, live: LiveLease) -> bool:
        """Take a live lease away (its holder's renewal and commit will then fail)."""
        return await self.release(live.record.job_id, live.fence) is not None

    async def all_live(self) -> list[LiveLease]:
        """Every live lease now: read from the bucket's stream, not ``kv.keys()``, which
        can return partial results under concurrent writes (nats.py issue 842)."""
        from jetfleet.stream_reader import read_stream

        found = []
        stream = f"KV_{subjects.BUCKET_LEASES}"
        async for msg in read_stream(self.js, stream, f"$KV.{subjects.BUCKET_LEASES}.>"):
            if not msg.data or (msg.headers or {}).get("KV-Operation"):
                continue  # a delete or purge marker
            record = _record_decoder.decode(msg.data)
            found.append(
                LiveLease(
                    record,
                    record.fence or msg.metadata.sequence.stream,
                    msg.metadata.sequence.stream,
                )
            )
        return found


def _routed(history: JobLeaseHistory) -> bool:
    """Whether the job has had a work order: marked routed, or granted (a refund leaves
    the fence), or sealed."""
    marked = history.routed_seq or history.fence or history.grants
    return bool(marked) or history.settled is not None


def _recordable(fence: int, highest: int, lost: bool) -> bool:
    """Whether an entry whose highest grant is ``highest`` keeps an attempt record of
    ``fence`` (``LeaseStore.amend``)."""
    return fence == highest if lost else 0 < fence <= highest
