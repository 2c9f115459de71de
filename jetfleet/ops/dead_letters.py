"""Dead letters: list, inspect, replay and purge what the sink keeps on ``jf.dlq.<target>``.

A dead letter's id is its sequence in ``JF_DLQ``: stable, unique, and what
``jetfleet dlq show|replay ID`` take. A replay is a new submission of the original job
under a new id derived from the old one and the letter's id, so it runs with a fresh
attempt budget but keeps the idempotency key: replaying work that is already done does
nothing. A purge records how many letters it removed, per target, in ``jf-control``, so
conservation (submitted = queued + leased + committed + dead + rejected) still adds up.
See docs/dead-letters.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.admission import admit, job_key
from jetfleet.errors import JetfleetError
from jetfleet.publish import publish_durably
from jetfleet.schemas import DeadLetter, Job, Rejection
from jetfleet.settings import Settings
from jetfleet.stream_reader import count_messages, read_stream

log = logging.getLogger(__name__)

REPLAY_HEADER = "Jf-Replay-Of"
"""Header on a replayed submission (in ``JF_SUBMIT``): the id of the dead letter it replays."""
PURGED_KEY_PREFIX = "purged.dlq"
"""``jf-control`` keys ``purged.dlq.<target>`` count the dead letters purged per target."""
ALL_DEAD_LETTERS = f"{subjects.PREFIX}.dlq.>"
_CAS_TRIES = 50
_ORIGINAL_ID_CHARS = 100  # + ".r" + a sequence number stays within the 128 a JobId allows

_letter_decoder = msgspec.json.Decoder(DeadLetter)
_encoder = msgspec.json.Encoder()


class DeadLetterEntry(msgspec.Struct, frozen=True):
    """One dead letter as stored: where it is and what it holds."""

    id: int
    """Its sequence in ``JF_DLQ``."""
    target: str
    letter: DeadLetter
    time: datetime | None = None
    """When the stream stored it (the server's clock)."""


# --- reading ---------------------------------------------------------------------------


def reason_matches(reason: str, wanted: str) -> bool:
    """Whether a letter's ``reason`` is ``wanted``, or has it as the part before ``':'``.

    Args:
        reason: The dead letter's reason, e.g. ``http-404`` or ``blocked:challenged``.
        wanted: What the operator asked for, e.g. ``http-404`` or ``blocked``.
    """
    return reason == wanted or reason.split(":", 1)[0] == wanted


def _entry(seq: int, subject: str, data: bytes, time: datetime | None) -> DeadLetterEntry:
    letter = _letter_decoder.decode(data)
    target = subjects.target_of(subject)
    if target == subjects.UNPARSABLE_TARGET:
        target = letter.order.target
    return DeadLetterEntry(id=seq, target=target, letter=letter, time=time)


async def list_dead_letters(
    js: JetStreamContext, target: str | None = None, reason: str | None = None, from_seq: int = 0
) -> list[DeadLetterEntry]:
    """The dead letters kept now, oldest first.

    Args:
        js: A JetStream context.
        target: Only this target's letters (``jf.dlq.<target>``); None for all.
        reason: Only letters with this reason, or with it before a ``':'``.
        from_seq: Only letters at this ``JF_DLQ`` sequence or later (0: all).

    Returns:
        The matching letters. A message that does not decode as a ``DeadLetter`` is
        logged and left out, never hidden silently.
    """
    filter_ = subjects.dlq(target) if target else ALL_DEAD_LETTERS
    entries: list[DeadLetterEntry] = []
    async for msg in read_stream(js, subjects.STREAM_DLQ, filter_, from_seq=from_seq):
        seq = msg.metadata.sequence.stream
        try:
            entry = _entry(seq, msg.subject, msg.data, msg.metadata.timestamp)
        except msgspec.MsgspecError as exc:
            log.warning("dead letter %d on %s does not decode: %s", seq, msg.subject, exc)
            continue
        if reason is None or reason_matches(entry.letter.reason, reason):
            entries.append(entry)
    return entries


async def get_dead_letter(js: JetStreamContext, id: int) -> DeadLetterEntry:
    """The dead letter with sequence ``id`` in ``JF_DLQ``.

    Raises:
        JetfleetError: when there is no such letter (purged, expired or never written),
            or it does not decode.
    """
    if id < 1:
        raise JetfleetError(f"dead letter ids are positive stream sequences, not {id}")
    try:
        raw = await js.get_msg(subjects.STREAM_DLQ, seq=id)
    except NotFoundError:
        raise JetfleetError(
            f"no dead letter {id} in {subjects.STREAM_DLQ} (purged, expired, or never "
            "written): `jetfleet dlq list` shows the ids kept now"
        ) from None
    try:
        return _entry(id, raw.subject or "", raw.data or b"", raw.time)
    except msgspec.MsgspecError as exc:
        raise JetfleetError(
            f"message {id} in {subjects.STREAM_DLQ} is not a dead letter: {exc}"
        ) from exc


# --- replay ----------------------------------------------------------------------------


def replay_job_id(original_id: str, letter_id: int) -> str:
    """The id a replay of dead letter ``letter_id`` runs under: new, and the same every
    time, so a repeated replay of one letter is one submission (the submit stream
    drops the repeat inside its duplicate window)."""
    # A cut that ends in "." would make "..", which a job id may not hold.
    return f"{original_id[:_ORIGINAL_ID_CHARS].rstrip('.')}.r{letter_id}"


def replay_copy(entry: DeadLetterEntry) -> Job:
    """The job a replay of ``entry`` submits: the original under a new id, with the key.

    Raises:
        JetfleetError: when the copy would not get the letter's idempotency key (the
            derivation changed since the letter was written). An explicit key is hashed
            at admission, so no field can carry the old key over; replaying under another
            key could repeat a side effect, so it is refused.
    """
    order = entry.letter.order
    job = msgspec.structs.replace(order.job, id=replay_job_id(order.job.id, entry.id))
    key = job_key(job)
    if key != order.key:
        raise JetfleetError(
            f"dead letter {entry.id}: a replay of job {order.job.id} would get idempotency "
            f"key {key}, not the original {order.key} (the key derivation changed since it "
            "was dead-lettered); refusing, as work done under the old key could run twice"
        )
    return job


async def replay(
    js: JetStreamContext,
    settings: Settings,
    entries: Sequence[DeadLetterEntry],
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Submit each letter's original job again, through admission like any submission.

    Each copy gets a new id (``replay_job_id``), hence a fresh attempt budget, and keeps
    the original idempotency key, so the leaser answers ``already-done`` (no request to
    the target, no second result) if the work has been committed meanwhile. The
    submission carries the header ``Jf-Replay-Of: <letter id>``. Every letter is checked
    before any is published, so a refusal leaves nothing half replayed.

    Args:
        js: A JetStream context.
        settings: The fleet's settings (admission checks the copies against them).
        entries: The dead letters to replay.
        progress: Called with how many are published so far, after each one.

    Returns:
        The new job ids, in the order of ``entries``.

    Raises:
        JetfleetError: when a copy would lose its key or admission would refuse it now
            (e.g. the target is no longer declared).
    """
    planned: list[tuple[DeadLetterEntry, Job, bytes]] = []
    for entry in entries:
        job = replay_copy(entry)
        payload = _encoder.encode(job)
        verdict = admit(subjects.submit(entry.target), payload, settings)
        if isinstance(verdict, Rejection):
            raise JetfleetError(
                f"dead letter {entry.id}: admission would refuse the replay: "
                f"{verdict.reason}: {verdict.message}"
            )
        planned.append((entry, job, payload))
    new_ids: list[str] = []
    for entry, job, payload in planned:
        # The same message id as client.submit_raw: one job id is one submission.
        ack = await publish_durably(
            js,
            subjects.submit(entry.target),
            payload,
            msg_id=f"sub-{job.id}",
            headers={REPLAY_HEADER: str(entry.id)},
        )
        if ack.duplicate:
            log.info(
                "dead letter %d was already replayed as %s: not submitted again", entry.id, job.id
            )
        new_ids.append(job.id)
        if progress is not None:
            progress(len(new_ids))
    return new_ids


# --- purge -----------------------------------------------------------------------------


def purged_key(target: str) -> str:
    """The ``jf-control`` key counting ``target``'s purged dead letters."""
    return f"{PURGED_KEY_PREFIX}.{target}"


async def _control(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(subjects.BUCKET_CONTROL)
    except BucketNotFoundError:
        raise JetfleetError(
            f"KV bucket {subjects.BUCKET_CONTROL} does not exist: `jetfleet topology show` "
            "creates what is missing"
        ) from None


async def _purge_subject(js: JetStreamContext, subject: str) -> int:
    # nats-py's purge_stream sends this same request but returns only "success"; the
    # server's "purged" count is what makes the recorded total exact even when letters
    # arrive or expire while we purge.
    request = json.dumps({"filter": subject}).encode()
    try:
        response = await js._api_request(
            f"{js._prefix}.STREAM.PURGE.{subjects.STREAM_DLQ}", request, timeout=10.0
        )
    except NotFoundError:
        return 0  # no JF_DLQ: nothing to purge
    return int(response.get("purged", 0))


async def record_purged(js: JetStreamContext, target: str, count: int) -> int:
    """Add ``count`` to ``target``'s purged counter (compare-and-set, retried on conflict).

    ``purge`` calls this; it is public for tools that remove dead letters another way.

    Returns:
        The new total for ``target``.

    Raises:
        JetfleetError: when the counter stayed contended through every try.
    """
    kv = await _control(js)
    key = purged_key(target)
    for _ in range(_CAS_TRIES):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # create() also takes a deleted key
            try:
                await kv.create(key, str(count).encode())
                return count
            except KeyWrongLastSequenceError:
                continue  # someone created it first
        total = int(entry.value or b"0") + count
        try:
            await kv.update(key, str(total).encode(), last=entry.revision)
            return total
        except KeyWrongLastSequenceError:
            continue
    raise JetfleetError(
        f"could not record {count} purged dead letter(s) of {target} in "
        f"{subjects.BUCKET_CONTROL} after {_CAS_TRIES} tries (key {key} kept changing)"
    )


async def dead_letter_total(js: JetStreamContext, target: str | None = None) -> int:
    """How many dead letters there are now (only ``target``'s when given), without listing
    subjects: each letter has its own, and the server lists at most 100,000."""
    if target is not None:
        return await count_messages(js, subjects.STREAM_DLQ, subjects.dlq(target))
    try:
        info = await js.stream_info(subjects.STREAM_DLQ)
    except NotFoundError:
        return 0
    return info.state.messages


async def _oldest_letter_subject(js: JetStreamContext) -> str | None:
    """The subject of the oldest message in ``JF_DLQ``, or None when there is none."""
    try:
        msg = await js.get_msg(subjects.STREAM_DLQ, seq=1, subject=ALL_DEAD_LETTERS, next=True)
    except NotFoundError:
        return None
    return msg.subject or ""


def _letter_target(subject: str) -> str | None:
    """The target of a job's dead letter subject ``jf.dlq.<target>.<job id>``, or None
    for a subject no job's letter has (no job id part, or no usable target token)."""
    target = subjects.target_of(subject)
    if target == subjects.UNPARSABLE_TARGET or subject.count(".") < 3:
        return None
    return target


async def purge(
    js: JetStreamContext,
    target: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Remove the dead letters of ``target`` (or of every target) and record how many.

    Each target's subject is purged on its own, and the count the server reports as
    removed is added to ``purged.dlq.<target>`` in ``jf-control``. A process that dies
    between the two loses that one count: the window is one KV round trip.

    Without a target, a message on a subject no job's letter has (``jf.dlq.<target>``
    with no job id, or an unusable target token: anyone may publish there) is removed
    too, but not recorded, since status never counted it as dead. ``progress`` is called
    with how many are removed so far, after each subject.

    Returns:
        How many messages were removed.

    Raises:
        JetfleetError: when the oldest message stays in place through two purges.
    """
    if target is not None:
        return await _purge_target(js, target)
    # Target by target, oldest letter first: one round trip each, never a subject list.
    removed = 0
    stalled: str | None = None
    while (subject := await _oldest_letter_subject(js)) is not None:
        name = _letter_target(subject)
        n = await _purge_target(js, name) if name else await _purge_stray(js, subject)
        if n == 0 and subject == stalled:
            raise JetfleetError(
                f"purge removed nothing on {subject} twice while it stayed the oldest "
                f"message in {subjects.STREAM_DLQ}; stopping rather than looping"
            )
        stalled = subject if n == 0 else None
        removed += n
        if progress is not None:
            progress(removed)
    return removed


async def _purge_stray(js: JetStreamContext, subject: str) -> int:
    n = await _purge_subject(js, subject)
    log.warning(
        "purged %d message(s) on %s: no job's dead letter (jf.dlq.<target>.<job id>), "
        "so not recorded as purged",
        n,
        subject,
    )
    return n


async def _purge_target(js: JetStreamContext, name: str) -> int:
    n = await _purge_subject(js, subjects.dlq(name))
    if n:
        await record_purged(js, name, n)
        log.info("purged %d dead letter(s) of %s", n, name)
    return n


async def purged_counts(js: JetStreamContext, targets: Iterable[str]) -> dict[str, int]:
    """How many dead letters have been purged, per target (0 for a target never purged).

    Args:
        js: A JetStream context.
        targets: The targets to report, e.g. ``settings.targets``.
    """
    kv = await _control(js)
    # Status asks for every declared target: read only the keys that exist (the targets
    # ever purged, usually few), found with one request, not one read per target.
    prefix = f"$KV.{subjects.BUCKET_CONTROL}.{PURGED_KEY_PREFIX}."
    info = await js.stream_info(f"KV_{subjects.BUCKET_CONTROL}", subjects_filter=prefix + ">")
    ever = {subject.removeprefix(prefix) for subject in (info.state.subjects or {})}

    async def one(name: str) -> tuple[str, int]:
        if name not in ever:
            return name, 0
        try:
            entry = await kv.get(purged_key(name))
        except (KeyNotFoundError, KeyDeletedError):
            return name, 0
        return name, int(entry.value or b"0")

    return dict(await asyncio.gather(*(one(name) for name in targets)))


__all__ = [
    "REPLAY_HEADER",
    "DeadLetterEntry",
    "dead_letter_total",
    "get_dead_letter",
    "list_dead_letters",
    "purge",
    "purged_counts",
    "purged_key",
    "reason_matches",
    "record_purged",
    "replay",
    "replay_copy",
    "replay_job_id",
]
