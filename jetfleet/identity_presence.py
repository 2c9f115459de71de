"""Which worker owns an identity: exactly one live owner at a time, judged by the server.

A worker with an identity claims the key ``owned.<digest of identity>`` in the
``jf-workers`` bucket at start, put-if-absent with a per-key TTL (``worker.claim_ttl_s``)
judged by the server's clock. While it runs it renews the key every third of that TTL by
compare-and-set on the revision it last wrote (a claim that lapsed meanwhile is lost, not
taken again), and a renewal that fails is tried again within moments; when it drains it
deletes the key (again by compare-and-set), so a successor can claim it at once. The
worker counts on its claim only for ``SURE_SHARE`` of the TTL after the write that
renewed it was sent (``IdentityClaim.live``), and gives it up when it stays unrenewed
``GIVE_UP_TTLS`` TTLs past that. A worker that crashed stops
renewing, and the server removes its key when the TTL runs out. A second worker's claim
of a live key is refused with the owner's name and how long its claim lasts unrenewed
(docs/identities.md).

The same key tells workers without the identity that a job pinned to it has an owner to
wait for (``owned``), so a job pinned to one nobody owns can be ended
(``no-eligible-worker``). Readers cache each answer for ``CACHE_S``.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.backoff import Backoff
from jetfleet.errors import IdentityOwned, WrongRevision
from jetfleet.leader_reads import last_message, replica_bucket
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.presence_writer import DirectPresenceWriter, PresenceWriter
from jetfleet.server_clock import ServerClock
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)

CACHE_S = 5.0
# Answers kept at most; a reader asked about ever more identities must not grow without
# bound (stale answers are dropped first, then the oldest).
CACHE_MAX = 1024
# Claims tried when the key vanishes between a refused create and the read of its owner.
_CLAIM_TRIES = 5
SURE_SHARE = 2 / 3
"""The share of its TTL a claim is counted on after the write that made it was sent. The
rest is the margin for a server whose clock runs ahead of the one that stored the write
(a new stream leader after an election), which drops the key that much early: up to a
third of the TTL ahead, the worker stops using the identity before any server could."""
GIVE_UP_TTLS = 2
"""How many TTLs past ``valid_until`` a claim no renewal confirms is tried before the
worker gives it up (by then the server surely dropped the key; another worker may own the
identity)."""
RETRY_FIRST_S = 0.5
"""The first wait before a failed renewal is tried again (doubling, jittered)."""
MIN_RENEW_TIMEOUT_S = 0.1
"""The shortest a renewal waits for its answer."""


def owned_key(identity: str) -> str:
    """The bucket key saying ``identity`` is owned (identities may hold any character;
    keys may not)."""
    return "owned." + hashlib.sha256(identity.encode()).hexdigest()[:32]


def _subject(identity: str) -> str:
    return f"$KV.{subjects.BUCKET_WORKERS}.{owned_key(identity)}"


@dataclass
class IdentityClaim:
    """A claim this worker holds: what it wrote, and the revision that proves it."""

    identity: str
    worker_id: str
    ttl_s: int
    """The claim's TTL on the server, whole seconds."""
    revision: int
    token: str
    """Written with the claim, so a renewal whose answer was lost can be recognised as
    ours on the next read (a worker id alone could be another process's, misconfigured)."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when this worker must stop using the identity for good: another worker holds
    it, the claim lapsed, or no renewal was confirmed for ``GIVE_UP_TTLS`` TTLs past
    ``valid_until``."""
    valid_until: float = 0.0
    """Monotonic time before which the claim surely lives: when its last acknowledged
    write was sent, plus ``SURE_SHARE`` of its TTL (the server counts the whole TTL from
    a later moment; the rest is the margin for a server clock running ahead)."""

    def live(self) -> bool:
        """Whether the identity may be used now: the claim is not lost and surely still
        lives by this process's clock."""
        return not self.lost.is_set() and time.monotonic() < self.valid_until

    def confirmed(self, sent_at: float) -> None:
        """Count on the claim from a write sent at ``sent_at`` (monotonic) that landed."""
        self.valid_until = sent_at + self.ttl_s * SURE_SHARE

    @property
    def lapses_at(self) -> float:
        """Monotonic time at which the server drops an unrenewed claim, by a server clock
        that keeps time with this one (a clock running ahead drops it sooner, down to
        ``valid_until``)."""
        return self.valid_until + self.ttl_s * (1 - SURE_SHARE)

    @property
    def give_up_at(self) -> float:
        """Monotonic time at which a claim still unconfirmed is given up (``lost``)."""
        return self.valid_until + GIVE_UP_TTLS * self.ttl_s

    @property
    def payload(self) -> bytes:
        return f"{self.identity}\n{self.worker_id}\n{self.token}".encode()


@dataclass(frozen=True)
class ClaimHolder:
    """Who holds a claim, as read from the server."""

    worker_id: str
    token: str
    revision: int
    left_s: float | None
    """How long the claim lasts if its owner does not renew it (None: unknown)."""
    ttl_s: int


class IdentityPresence:
    """Claim, renew and release this worker's identity; ask whether anyone owns another.

    Reads go to the bucket directly; writes go through ``writer`` (a worker's asks the
    leaser on ``jf.presence``; by default this connection writes itself)."""

    def __init__(
        self,
        js: JetStreamContext,
        clock: ServerClock | None = None,
        writer: PresenceWriter | None = None,
    ) -> None:
        self.js = js
        self.clock = clock
        self.writer: PresenceWriter = writer or DirectPresenceWriter(js)
        self._answers: dict[str, tuple[bool, float]] = {}
        self._kv: KeyValue = replica_bucket(js, subjects.BUCKET_WORKERS)

    async def claim(self, identity: str, worker_id: str, ttl_s: float) -> IdentityClaim:
        """Claim ``identity`` for ``worker_id`` if no live worker holds it.

        Raises:
            IdentityOwned: another worker's claim is live; the message names it and how
                long its claim lasts unrenewed.
        """
        claim = IdentityClaim(
            identity, worker_id, ttl_whole_seconds(ttl_s), 0, secrets.token_hex(8)
        )
        for _ in range(_CLAIM_TRIES):
            sent_at = time.monotonic()
            try:
                claim.revision = await self.writer.create(
                    subjects.BUCKET_WORKERS, owned_key(identity), claim.payload, claim.ttl_s
                )
                claim.confirmed(sent_at)
                log.info("worker %s claimed identity %s", worker_id, identity)
                return claim
            except WrongRevision:
                # (Also when the holder's claim lapsed between the refused create and the
                # writer's read of the key.)
                holder = await self.holder(identity)
            except Exception:
                # The answer may be lost though the claim landed (a timeout, a 503 in an
                # election): left unadopted, it would refuse this very worker's restart
                # until it lapsed.
                holder = await self.holder(identity)
                if holder is None or holder.token != claim.token:
                    raise
                claim.revision = holder.revision
                claim.confirmed(sent_at)  # written after it was sent
                log.info("worker %s claimed identity %s", worker_id, identity)
                return claim
            if holder is not None:
                raise IdentityOwned(_refusal(identity, holder))
            # Gone between the two (its TTL ran out): claim again.
        raise IdentityOwned(f"identity {identity!r} could not be claimed: too much contention")

    async def keep(
        self, claim: IdentityClaim, on_unconfirmed: Callable[[], object] | None = None
    ) -> None:
        """Renew ``claim`` every third of its TTL until cancelled, or until it is lost
        (then ``claim.lost`` is set and this returns): another worker holds the identity,
        the claim lapsed unrenewed (another worker may have held it meanwhile and left
        the identity's state newer than this one's), or no renewal was confirmed for
        ``GIVE_UP_TTLS`` TTLs past ``valid_until`` (the server cannot be reached, or the
        bucket's stream is gone). Never dies of any other error: a failed renewal is
        tried again after a short, doubling wait, and each renewal waits for its answer
        at most half the time ``valid_until`` has left, so one lost answer leaves time
        for another try before the claim stops being sure.

        ``on_unconfirmed`` is called each time ``valid_until`` passes unrenewed (the
        worker stops using the identity until a renewal lands again)."""
        beat_s = claim.ttl_s / 3
        retry = Backoff(RETRY_FIRST_S, beat_s)
        failing = unconfirmed = False
        next_at = time.monotonic() + beat_s
        while True:
            # Awake for the next renewal, and at once when the claim stops being sure.
            deadline = claim.give_up_at if unconfirmed else claim.valid_until
            await asyncio.sleep(max(0.0, min(next_at, deadline) - time.monotonic()))
            now = time.monotonic()
            if now >= claim.give_up_at:
                log.error(
                    "no renewal of the claim of worker %s on identity %s was confirmed "
                    "for %.0f s: it gives the identity up (another worker may own it now)",
                    claim.worker_id,
                    claim.identity,
                    now - claim.valid_until + claim.ttl_s * SURE_SHARE,
                )
                claim.lost.set()
                return
            if now >= claim.valid_until and not unconfirmed:
                unconfirmed = True
                log.warning(
                    "the claim on identity %s went unrenewed past the time it surely "
                    "lives: the worker stops using it until a renewal lands (it gives it "
                    "up in %.0f s)",
                    claim.identity,
                    claim.give_up_at - now,
                )
                if on_unconfirmed is not None:
                    on_unconfirmed()
            if now < next_at:
                continue
            try:
                ours = await self._renew(claim)
            except Exception as exc:
                # A closed connection, a timeout during an election, no responders: if
                # this task died, the claim would lapse while the worker still used the
                # identity. CancelledError is not an Exception, so drain still stops it.
                failing = _warn_once(failing, claim, exc)
                wait_s = retry.next_s()
                now = time.monotonic()
                if claim.live():
                    wait_s = min(wait_s, (claim.valid_until - now) / 2)
                else:
                    # Unsure: the server most likely keeps the key for the rest of its
                    # TTL, so a renewal landing then keeps the claim. A full beat's wait
                    # would fall past that (the window is a third of the TTL, the beat
                    # too): try often enough to land inside it.
                    wait_s = min(wait_s, max(RETRY_FIRST_S, (claim.lapses_at - now) / 3))
                next_at = now + wait_s
                continue
            if not ours:
                claim.lost.set()
                return
            if not claim.live():
                # An earlier renewal landed though its answer was lost: adopted, but when
                # it was written is not known, so renew on its revision at once.
                next_at = time.monotonic()
                continue
            if failing or unconfirmed:
                log.info("renewing the claim on identity %s works again", claim.identity)
            failing = unconfirmed = False
            retry = Backoff(RETRY_FIRST_S, beat_s)
            next_at = time.monotonic() + beat_s

    async def _renew(self, claim: IdentityClaim) -> bool:
        """Renew ``claim`` once; False if it is lost. Raises whatever kept the server from
        answering (a renewal to try again)."""
        sent_at = time.monotonic()
        # While the claim is sure, its answer is waited for at most half the time left,
        # so a retry still fits; after that, until it is given up.
        deadline = claim.valid_until if sent_at < claim.valid_until else claim.give_up_at
        timeout_s = max(MIN_RENEW_TIMEOUT_S, min(claim.ttl_s / 6, (deadline - sent_at) / 2))
        try:
            revision = await self.writer.update(
                subjects.BUCKET_WORKERS,
                owned_key(claim.identity),
                claim.payload,
                last=claim.revision,
                ttl_s=claim.ttl_s,
                timeout_s=timeout_s,
            )
        except WrongRevision:
            refused = True
        else:
            refused = False
            claim.revision = revision
            claim.confirmed(sent_at)
        # Outside the except clause: an error reading the holder (a timeout, a 503) is
        # retried like any other.
        return await self._still_ours(claim) if refused else True

    async def release(self, claim: IdentityClaim) -> None:
        """Delete the claim if it is still ours, so a successor may claim the identity at
        once. Never raises: a claim not released lapses by its TTL. Tried after a loss
        too: a claim counted lost because renewing it died may still be ours, and the
        compare-and-set and the token spare a rival's."""
        try:
            for _ in range(2):
                try:
                    await self.writer.delete(
                        subjects.BUCKET_WORKERS, owned_key(claim.identity), last=claim.revision
                    )
                    log.info("worker %s released identity %s", claim.worker_id, claim.identity)
                    return
                except WrongRevision:
                    # A renewal whose answer was lost moved the revision: ours still?
                    holder = await self.holder(claim.identity)
                    if holder is None or holder.token != claim.token:
                        return
                    claim.revision = holder.revision
        except Exception as exc:
            log.warning(
                "releasing identity %s failed (%r); it is free again within %d s",
                claim.identity,
                exc,
                claim.ttl_s,
            )

    async def holder(self, identity: str) -> ClaimHolder | None:
        """Who holds ``identity`` now, as the stream's leader has it; None if nobody."""
        stream = f"KV_{subjects.BUCKET_WORKERS}"
        msg = await last_message(self.js, stream, _subject(identity))
        headers = msg.headers if msg is not None else None
        if msg is None or not msg.data or (headers or {}).get("KV-Operation"):
            return None  # never claimed, or released (a delete marker)
        lines = msg.data.decode(errors="replace").split("\n")
        ttl_s = int((headers or {}).get("Nats-TTL", "0").rstrip("s") or 0)
        left_s = None
        now = await self.clock.now() if self.clock is not None else None
        if now is not None and msg.time is not None and ttl_s:
            stored = msg.time.astimezone(datetime.UTC)
            left_s = max(0.0, ttl_s - (now - stored).total_seconds())
        return ClaimHolder(
            worker_id=lines[1] if len(lines) > 1 else "",
            token=lines[2] if len(lines) > 2 else "",
            revision=msg.seq or 0,
            left_s=left_s,
            ttl_s=ttl_s,
        )

    async def owners(self) -> list[tuple[str, str]]:
        """Every live claim now, as (identity, worker id): read from the bucket's stream
        (one reader, not a read per identity). A claim lapsed by its TTL is gone from it.

        Raises:
            Exception: the stream cannot be read (the caller decides what that means).
        """
        found = []
        stream = f"KV_{subjects.BUCKET_WORKERS}"
        async for msg in read_stream(self.js, stream, f"$KV.{subjects.BUCKET_WORKERS}.owned.>"):
            if not msg.data or (msg.headers or {}).get("KV-Operation"):
                continue  # released (a delete marker)
            identity, _, rest = msg.data.decode(errors="replace").partition("\n")
            found.append((identity, rest.partition("\n")[0]))
        return found

    async def _still_ours(self, claim: IdentityClaim) -> bool:
        """After a renewal was refused: whether the claim is still ours. It is when the
        key holds our token (an earlier renewal landed though its answer was lost). A
        claim that lapsed is not taken again: another worker may have claimed, used and
        released the identity meanwhile, and its session state is newer than ours."""
        holder = await self.holder(claim.identity)
        if holder is not None and holder.token == claim.token:
            # (valid_until stays: when the adopted write was sent is not known; the
            # next renewal on its revision moves it on.)
            claim.revision = holder.revision
            return True
        if holder is None:
            log.error(
                "the claim of worker %s on identity %s lapsed unrenewed; it stops using it",
                claim.worker_id,
                claim.identity,
            )
        else:
            log.error(
                "worker %s lost identity %s to worker %s; it stops using it",
                claim.worker_id,
                claim.identity,
                holder.worker_id,
            )
        return False

    async def owned(self, identity: str) -> bool:
        """Whether some running worker holds ``identity`` (its claim lives). When it
        cannot be read, the answer is yes: a pinned job then waits rather than ends."""
        cached = self._answers.get(identity)
        if cached is not None and time.monotonic() - cached[1] < CACHE_S:
            return cached[0]
        try:
            entry = await self._kv.get(owned_key(identity))
            answer = bool(entry.value)
        except KeyNotFoundError:  # KeyDeletedError is a subclass: released, or lapsed
            answer = False
        except Exception as exc:  # an outage must not end anybody's jobs
            log.warning("cannot tell whether identity %s is owned (%s)", identity, exc)
            return True
        self._remember(identity, answer)
        return answer

    def _remember(self, identity: str, answer: bool) -> None:
        """Cache ``answer``, keeping at most ``CACHE_MAX`` answers."""
        now = time.monotonic()
        if len(self._answers) >= CACHE_MAX and identity not in self._answers:
            for stale in [k for k, (_, at) in self._answers.items() if now - at >= CACHE_S]:
                del self._answers[stale]
            while len(self._answers) >= CACHE_MAX:  # dicts keep insertion order
                del self._answers[next(iter(self._answers))]
        self._answers.pop(identity, None)  # re-inserted last: the order is by age
        self._answers[identity] = (answer, now)


def _refusal(identity: str, holder: ClaimHolder) -> str:
    owner = holder.worker_id or "(unnamed)"
    if holder.left_s is not None:
        lasts = f"its claim lasts {holder.left_s:.0f} s more unless renewed"
    else:
        lasts = f"its claim lasts up to {holder.ttl_s} s more unless renewed"
    return (
        f"identity {identity!r} is owned by worker {owner!r} ({lasts}; a live owner renews "
        f"it every {holder.ttl_s / 3:g} s): an identity has one live owner. Drain worker "
        f"{owner!r} first (its claim is released at once), wait for the claim of a "
        "worker that crashed to lapse, or start this worker with another identity"
    )


def _warn_once(failing: bool, claim: IdentityClaim, exc: Exception) -> bool:
    """Log the first failure of a streak; True (now failing)."""
    if not failing:
        log.warning("renewing the claim on identity %s failed (%r); retrying", claim.identity, exc)
    return True
