"""The pauses in force, in ``jf-control`` under ``pause.<scope>.<name>`` (docs/pause.md).

A record has no TTL when untimed, else the per-key TTL ``for_s``: it lapses by the
server's clock. Every grant asks about five scopes (the fleet, its target, the worker's
region, the worker, its identity), so the leaser follows the records with a KV watch
into memory; a watch does not see a per-key TTL expire, so each entry keeps the time the
server stored it and is judged in force against the server's now (``ServerClock``).

The work consumers a fleet or target pause covers are paused at the server until the
record's end (``pause_until``), so what the server holds back and what the leaser
refuses end at the same moment; ``consumer_pauses`` says which consumer is paused until
when, from the records alone (no clock), for the leaser and for topology declare.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.leader_reads import last_message
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.schemas.control import FLEET_NAME, PauseRecord, PauseScope, PauseView
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream
from jetfleet.work_lanes import LaneMap

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(PauseRecord)
_PLAIN = re.compile(r"[A-Za-z0-9_=-]{1,200}")
_SPELLED = "b32-"
LOAD_TIMEOUT_S = 10.0
# An untimed pause holds its consumers until this (the server takes any RFC 3339 time).
FAR_FUTURE = datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC)
_STREAM = f"KV_{subjects.BUCKET_CONTROL}"
# Scopes in the order a grant asks about them: the widest first, so a fleet or target
# pause (which holds the whole target for every worker) wins over a worker's.
SCOPES: tuple[PauseScope, ...] = ("fleet", "target", "region", "worker", "identity")


def pause_key(scope: PauseScope, name: str) -> str:
    """The ``jf-control`` key of a scope's pause. Names that are not plain key tokens
    (free-text worker ids, identities, regions) are spelled in base32, and so are plain
    names that start like a spelling: one key per name, or pausing worker ``a.b`` would
    pause a worker named ``b32-mexge`` too."""
    if scope == "fleet":
        return f"{subjects.PAUSE_PREFIX}.fleet.{FLEET_NAME}"
    token = (
        name
        if _PLAIN.fullmatch(name) and not name.startswith(_SPELLED)
        else _SPELLED + base64.b32encode(name.encode()).decode().rstrip("=").lower()
    )
    return f"{subjects.PAUSE_PREFIX}.{scope}.{token}"


def rfc3339(moment: datetime.datetime) -> str:
    """A UTC time as the NATS server reads it."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class PauseEntry:
    """A pause record with its revision and the server's time when it was stored."""

    record: PauseRecord
    revision: int
    stored: datetime.datetime

    @property
    def ends(self) -> datetime.datetime | None:
        """When it lapses by the server's clock (its per-key TTL); None: until resumed."""
        if self.record.for_s <= 0:
            return None
        return self.stored + datetime.timedelta(seconds=ttl_whole_seconds(self.record.for_s))

    def in_force(self, now: datetime.datetime | None) -> bool:
        """Whether it holds at the server's ``now`` (unknown: yes, fail closed)."""
        ends = self.ends
        return ends is None or now is None or now < ends

    def view(self, now: datetime.datetime | None) -> PauseView:
        """The entry as listed, with the seconds it has left at ``now``."""
        ends = self.ends
        left = 0.0 if ends is None or now is None else max(0.0, (ends - now).total_seconds())
        age = 0.0 if now is None else max(0.0, (now - self.stored).total_seconds())
        return PauseView(record=self.record, age_s=age, left_s=left, revision=self.revision)


def covers(record: PauseRecord, target: str, region: str, worker: str, identity: str) -> bool:
    """Whether a pause covers a lease (or an ask) of ``worker`` on ``target``."""
    held = {
        "fleet": FLEET_NAME,
        "target": target,
        "region": region,
        "worker": worker,
        "identity": identity,
    }[record.scope]
    return bool(held) and held == record.name


def consumer_pauses(
    settings: Settings, entries: Iterable[PauseEntry]
) -> dict[str, datetime.datetime]:
    """The work consumers the pauses hold at the server, each with the latest end of
    the pauses covering it. A fleet pause holds every work consumer; a target pause its
    own lane's (a partitioned target shares its consumers: the leaser refuses its grants
    instead). Region, worker and identity pauses hold no consumer."""
    lanes = LaneMap(settings)
    held: dict[str, datetime.datetime] = {}
    for entry in entries:
        record = entry.record
        if record.scope == "fleet":
            chosen = list(lanes.lanes)
        elif record.scope == "target" and record.name in settings.targets:
            lane = lanes.lane_of(record.name)
            chosen = [] if lane.shared else [lane]
        else:
            continue
        until = entry.ends or FAR_FUTURE
        for lane in chosen:
            for tier in subjects.TIERS:
                name = lane.consumer(tier)
                held[name] = max(held.get(name, until), until)
    return held


def _entry_of(data: bytes, revision: int, stored: datetime.datetime) -> PauseEntry | None:
    try:
        return PauseEntry(_decoder.decode(data), revision, stored)
    except msgspec.ValidationError as exc:  # written by hand, or by a newer version
        log.error("a pause record at revision %d cannot be read (%s): ignored", revision, exc)
        return None


async def read_pauses(js: JetStreamContext) -> list[PauseEntry]:
    """Every pause record stored now (lapsed ones included until the server drops them:
    judge each with ``in_force``), read from the bucket's stream."""
    found = []
    filter_ = f"$KV.{subjects.BUCKET_CONTROL}.{subjects.PAUSE_PREFIX}.>"
    try:
        async for msg in read_stream(js, _STREAM, filter_):
            if msg.data and not (msg.headers or {}).get("KV-Operation"):
                meta = msg.metadata
                entry = _entry_of(msg.data, meta.sequence.stream, meta.timestamp)
                if entry is not None:
                    found.append(entry)
    except BucketNotFoundError:
        return []
    return found


class PauseBook:
    """Writes pause records, and keeps those in force in memory through a KV watch."""

    def __init__(self, js: JetStreamContext, control: KeyValue) -> None:
        self.js = js
        self.control = control
        self.entries: dict[str, PauseEntry] = {}
        self._revisions: dict[str, int] = {}
        """The newest revision applied per key (a put or a delete), so a watch event
        older than a write this replica applied itself changes nothing."""
        self.on_change: Callable[[str, PauseEntry | None], None] | None = None
        """Called with each change the watch brings after it loaded that this replica
        did not apply itself (another replica's command)."""
        self._writing: set[str] = set()
        """Keys this replica is writing: their change is its own, whichever of the
        watch and the write applies it first."""
        self._watching: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the pauses stored and follow changes."""
        watcher = await self.control.watch(f"{subjects.PAUSE_PREFIX}.>")
        loaded = asyncio.get_running_loop().create_future()
        self._watching = asyncio.create_task(self._follow(watcher, loaded))
        await asyncio.wait_for(loaded, LOAD_TIMEOUT_S)

    async def stop(self) -> None:
        """Stop following changes."""
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    def following(self) -> bool:
        """Whether the watch is alive (else every ask reads the records from KV)."""
        return self._watching is not None and not self._watching.done()

    def apply(self, key: str, entry: PauseEntry | None, revision: int) -> bool:
        """Apply a put (``entry``) or a delete at ``revision`` unless a newer change of
        the key was applied; whether it changed anything."""
        if revision <= self._revisions.get(key, 0):
            return False
        self._revisions[key] = revision
        if entry is None:
            self.entries.pop(key, None)
        else:
            self.entries[key] = entry
        return True

    async def _follow(self, watcher: Any, loaded: asyncio.Future[None]) -> None:
        async for change in watcher:
            if change is None:  # the end of what was stored when we started
                if not loaded.done():
                    loaded.set_result(None)
                continue
            entry = None
            if change.operation not in ("DEL", "PURGE") and change.value:
                entry = _entry_of(change.value, change.revision, change.created)
            applied = self.apply(change.key, entry, change.revision or 0)
            own = change.key in self._writing
            if applied and not own and loaded.done() and self.on_change is not None:
                self.on_change(change.key, entry)

    async def put(self, record: PauseRecord) -> PauseEntry:
        """Store a pause (replacing one of the same scope) and apply it here."""
        key = pause_key(record.scope, record.name)
        ttl = ttl_whole_seconds(record.for_s) if record.for_s > 0 else None
        subject = f"$KV.{subjects.BUCKET_CONTROL}.{key}"
        self._writing.add(key)
        try:
            await self.js.publish(subject, _encoder.encode(record), msg_ttl=ttl)
            # The server's stored time is the record's start: read it back, so the
            # consumers' pause_until is exactly the TTL's end.
            msg = await last_message(self.js, _STREAM, subject)
            if msg is None or msg.seq is None or msg.time is None or not msg.data:
                raise RuntimeError(f"the pause record {key} was not found after it was written")
            entry = PauseEntry(_decoder.decode(msg.data), msg.seq, msg.time)
            self.apply(key, entry, msg.seq)
        finally:
            self._writing.discard(key)
        return entry

    async def remove(self, scope: PauseScope, name: str) -> PauseEntry | None:
        """End a scope's pause (a delete marker) and apply it here; the entry it ended,
        or None when none was stored."""
        key = pause_key(scope, name)
        found = await self.stored(key)
        if found is None:
            return None
        self._writing.add(key)
        try:
            ack = await self.js.publish(
                f"$KV.{subjects.BUCKET_CONTROL}.{key}", b"", headers={"KV-Operation": "DEL"}
            )
            self.apply(key, None, int(ack.seq))
        finally:
            self._writing.discard(key)
        return found

    async def stored(self, key: str) -> PauseEntry | None:
        """The record under ``key`` as the stream's leader has it (None: none)."""
        msg = await last_message(self.js, _STREAM, f"$KV.{subjects.BUCKET_CONTROL}.{key}")
        if msg is None or not msg.data or (msg.headers or {}).get("KV-Operation"):
            return None
        assert msg.seq is not None and msg.time is not None
        return _entry_of(msg.data, msg.seq, msg.time)

    async def covering(
        self,
        target: str,
        region: str,
        worker: str,
        identity: str,
        now: datetime.datetime | None,
    ) -> PauseEntry | None:
        """The widest pause in force covering an ask of ``worker`` on ``target``, or
        None. From memory while the watch lives; read from KV should it die."""
        names = (FLEET_NAME, target, region, worker, identity)
        for scope, name in zip(SCOPES, names, strict=True):
            if not name:
                continue
            key = pause_key(scope, name)
            entry = self.entries.get(key) if self.following() else await self.stored(key)
            if entry is not None and entry.in_force(now):
                return entry
            if entry is not None and now is not None:
                # Lapsed by its TTL (which the watch does not see): forgotten, so the
                # grants skip the book again once no pause is in force.
                self.entries.pop(key, None)
        return None

    def in_force(self, now: datetime.datetime | None) -> list[PauseEntry]:
        """The pauses in force at the server's ``now``, as this replica knows them."""
        return [e for e in self.entries.values() if e.in_force(now)]
