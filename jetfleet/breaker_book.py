"""The per-target circuit breakers' state in ``jf-control``, read and written here only.

Four keys per target (docs/quarantine.md#the-target-circuit-breaker):

- ``breaker.<target>``: the record (``BreakerRecord``), with no TTL: the breaker is open
  or half-open while it exists, until a probe or an operator closes it;
- ``breaker-cool.<target>``: the cooling, with the per-key TTL ``cool_s``: while it lives
  the target is open (no grant at all). Its expiry is the server's clock, never a host's;
- ``breaker-probe.<target>``: the one probe lease of a half-open breaker, made with a
  create (so of two leaser replicas only one makes it) and the lease's TTL, renewed with
  the lease: a probe whose worker died lapses with its lease, and another probe goes; one
  whose lease ended without a request (released, or judged unsent) is freed at once;
- ``breaker-fired.<target>``: the newest outcome event of an opening asked (whether it
  opened the breaker or found it open), or the newest stored when it was last closed, so
  a replay of that evidence (a quarantine replica restarting) does not open it again.

Every grant asks about its target, so the book follows the records with a KV watch
(``KeyWatch``) and reads only for a target whose record it has seen (or every time,
should the watch die).
"""

from __future__ import annotations

import contextlib
import logging

import msgspec
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.kv_watch import KeyWatch
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.schemas.breaker import BreakerProbe, BreakerRecord, BreakerView
from jetfleet.schemas.lease import QuarantineFired
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(BreakerRecord)
_probe_decoder = msgspec.json.Decoder(BreakerProbe)
_fired_decoder = msgspec.json.Decoder(QuarantineFired)
# The server's codes for a compare-and-set that lost (wrong last sequence).
_WRONG_LAST = (10071, 10164)


def key(prefix: str, target: str) -> str:
    """The ``jf-control`` key of one of a target's breaker keys (target names are plain
    key tokens)."""
    return f"{prefix}.{target}"


def target_of(name: str) -> str:
    """The target a breaker key names (the inverse of ``key``)."""
    return name.split(".", 1)[1]


class BreakerBook:
    """Reads and writes the breakers' keys; follows the records with a watch."""

    def __init__(self, js: JetStreamContext, control: KeyValue) -> None:
        self.js = js
        self.control = control
        self.watch = KeyWatch(control, f"{subjects.BREAKER_PREFIX}.>", "breaker")

    async def start(self) -> None:
        """Load the breakers in force and follow changes."""
        await self.watch.start()

    async def stop(self) -> None:
        """Stop following changes."""
        await self.watch.stop()

    def known(self, target: str) -> bool:
        """Whether ``target`` may have a breaker (its record was seen). A dead watch, or
        one never started, answers yes for every target: the book fails closed."""
        if not self.watch.following():
            return True
        return key(subjects.BREAKER_PREFIX, target) in self.watch.keys

    async def _read(self, name: str) -> tuple[bytes | None, int]:
        """A key's value (None: none, or deleted) and its revision (a tombstone's, or 0),
        the revision a compare-and-set over it names."""
        try:
            entry = await self.control.get(name)
        except KeyNotFoundError as exc:
            gone = getattr(exc, "entry", None)
            return None, (gone.revision or 0) if gone is not None else 0
        return (entry.value or None), entry.revision or 0

    async def _write(
        self, name: str, value: bytes, last: int | None = None, ttl_s: float = 0.0
    ) -> int:
        """Write a key (if its revision is still ``last``, when given; with a per-key
        TTL when ``ttl_s`` is set); its new revision. Raises KeyWrongLastSequenceError."""
        headers = None
        if last is not None:
            headers = {js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(last)}
        ttl = ttl_whole_seconds(ttl_s) if ttl_s > 0 else None
        try:
            ack = await self.js.publish(
                f"$KV.{subjects.BUCKET_CONTROL}.{name}", value, headers=headers, msg_ttl=ttl
            )
        except APIError as err:
            if err.err_code in _WRONG_LAST:
                raise KeyWrongLastSequenceError from err
            raise
        return int(ack.seq)

    async def record(self, target: str) -> tuple[BreakerRecord | None, int]:
        """The target's breaker record (None: closed) and the revision a write over it
        names (a deleted record's tombstone's, or 0)."""
        value, revision = await self._read(key(subjects.BREAKER_PREFIX, target))
        if value is None:
            # Not forgotten by the watch: a miss may be a lagging replica's read, and a
            # record has no TTL, so only a delete the watch sees (or our close) ends it.
            return None, revision
        return _record_decoder.decode(value), revision

    async def cooling(self, target: str) -> bool:
        """Whether the target's cooling still lives (by the server's per-key TTL)."""
        value, _ = await self._read(key(subjects.BREAKER_COOL_PREFIX, target))
        return value is not None

    async def probe(self, target: str) -> tuple[BreakerProbe, int] | None:
        """The target's probe in flight and its revision, or None."""
        value, revision = await self._read(key(subjects.BREAKER_PROBE_PREFIX, target))
        return (_probe_decoder.decode(value), revision) if value is not None else None

    async def open(self, record: BreakerRecord, last: int) -> bool:
        """Open (or re-open) ``record.target`` for ``record.cool_s``, if its record's
        revision is still ``last`` (0: there is none); False if another writer was first.

        The cooling is written first: a leaser dying between the two writes leaves a
        cooling without a record (nothing refused), never a record without its cooling
        (a probe at once)."""
        target = record.target
        payload = _encoder.encode(record)
        await self._write(key(subjects.BREAKER_COOL_PREFIX, target), payload, ttl_s=record.cool_s)
        try:
            await self._write(key(subjects.BREAKER_PREFIX, target), payload, last=last)
        except KeyWrongLastSequenceError:
            return False
        self.watch.keys.add(key(subjects.BREAKER_PREFIX, target))
        # A probe refused, or one in flight when an operator opened it again: gone.
        await self.control.delete(key(subjects.BREAKER_PROBE_PREFIX, target))
        return True

    async def close(self, target: str, last: int) -> bool:
        """Close the target's breaker if its record's revision is still ``last``."""
        try:
            await self.control.delete(key(subjects.BREAKER_PREFIX, target), last=last)
        except KeyWrongLastSequenceError:
            return False
        for prefix in (subjects.BREAKER_COOL_PREFIX, subjects.BREAKER_PROBE_PREFIX):
            await self.control.delete(key(prefix, target))
        self.watch.keys.discard(key(subjects.BREAKER_PREFIX, target))
        return True

    async def take_probe(self, target: str, job_id: str, worker: str, ttl_s: float) -> int | None:
        """Make this job the target's one probe (a create: one replica wins); its
        revision, or None when another job is the probe. The same job asking again from
        the same worker (its answer lost) keeps its probe."""
        name = key(subjects.BREAKER_PROBE_PREFIX, target)
        value, revision = await self._read(name)
        if value is not None:
            held = _probe_decoder.decode(value)
            return revision if (held.job_id, held.worker) == (job_id, worker) else None
        payload = _encoder.encode(BreakerProbe(job_id=job_id, worker=worker))
        try:
            return await self._write(name, payload, last=revision, ttl_s=ttl_s)
        except KeyWrongLastSequenceError:
            return None

    async def mark_probe(self, target: str, probe: BreakerProbe, last: int, ttl_s: float) -> None:
        """Name the probe's lease fence once granted, so its outcome is known by it."""
        name = key(subjects.BREAKER_PROBE_PREFIX, target)
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._write(name, _encoder.encode(probe), last=last, ttl_s=ttl_s)

    async def free_probe(self, target: str, probe: BreakerProbe) -> None:
        """Free the target's probe if it is still ``probe`` (its job, worker and fence):
        its lease ended without a request, so the next grant may probe at once."""
        found = await self.probe(target)
        if found is not None and found[0] == probe:
            await self.free_probe_at(target, found[1])

    async def free_probe_at(self, target: str, revision: int) -> None:
        """Free the target's probe if its revision is still ``revision`` (the one an ask
        took and led to no lease); a probe taken since is another job's, and stays."""
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.control.delete(key(subjects.BREAKER_PROBE_PREFIX, target), last=revision)

    async def keep_probe(self, target: str, job_id: str, fence: int, ttl_s: float) -> None:
        """A renewed lease that is the target's probe keeps its probe as long."""
        found = await self.probe(target)
        if found is None or (found[0].job_id, found[0].fence) != (job_id, fence):
            return
        with contextlib.suppress(KeyWrongLastSequenceError):
            name = key(subjects.BREAKER_PROBE_PREFIX, target)
            await self._write(name, _encoder.encode(found[0]), last=found[1], ttl_s=ttl_s)

    async def claim_fired(
        self, target: str, first_seq: int, last_seq: int, ttl_s: float
    ) -> int | None:
        """Move the target's fired marker to ``last_seq``, the newest event of an
        opening; or the marker's seq if it already covers ``first_seq`` (that evidence
        opened the breaker before). A compare-and-set, so it only moves forward."""
        name = key(subjects.BREAKER_FIRED_PREFIX, target)
        for _ in range(5):
            value, revision = await self._read(name)
            if value is not None:
                seq = _fired_decoder.decode(value).seq
                if seq >= first_seq:
                    return seq
            try:
                await self._write(
                    name, _encoder.encode(QuarantineFired(seq=last_seq)), revision, ttl_s
                )
            except KeyWrongLastSequenceError:
                continue
            return None
        raise RuntimeError(f"the breaker marker {name} kept changing")

    async def hold_fired_at(self, target: str, seq: int, ttl_s: float) -> None:
        """Move the target's fired marker to ``seq`` unless it is there or further: no
        opening whose evidence starts at or before ``seq`` opens the breaker again."""
        await self.claim_fired(target, seq, seq, ttl_s)

    async def views(self) -> list[BreakerView]:
        """Every breaker open or half-open, with its state now."""
        views = []
        for target in sorted(await self.targets()):
            record, _ = await self.record(target)
            if record is not None:
                views.append(await self.view(record))
        return views

    async def view(self, record: BreakerRecord) -> BreakerView:
        """A record with its state now (open, probing or half-open)."""
        if await self.cooling(record.target):
            return BreakerView(record=record, state="open")
        probe = await self.probe(record.target)
        if probe is not None:
            return BreakerView(record=record, state="probing", probe=probe[0])
        return BreakerView(record=record, state="half-open")

    async def targets(self) -> list[str]:
        """The targets with a breaker record, read from the bucket's stream (not the
        watch, and not ``kv.keys()``, which may miss keys under concurrent writes)."""
        found = []
        stream = f"KV_{subjects.BUCKET_CONTROL}"
        filter_ = f"$KV.{subjects.BUCKET_CONTROL}.{subjects.BREAKER_PREFIX}.>"
        async for msg in read_stream(self.js, stream, filter_):
            if msg.data and not (msg.headers or {}).get("KV-Operation"):
                found.append(msg.subject.rsplit(".", 1)[1])
        return found
