"""Per-target limits changed at run time (``jetfleet target set|unset``, docs/cli.md).

A change is one ``TargetLimits`` record, key ``<target>`` in ``jf-targets``, merged with
the one already there (a field not given keeps its value). Every ratelimit replica
follows the bucket with a KV watch (services/ratelimit/target_limits.py), so the change
applies to every permit within about a second; workers keep no limits of their own
(each request asks for a permit, and the leaser takes none), so nothing restarts.
Removing the record puts the config file's values back.
"""

from __future__ import annotations

import getpass
import math
import re
import socket
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

from jetfleet import subjects
from jetfleet.errors import JetfleetError
from jetfleet.schemas.names import MAX_NAME_CHARS
from jetfleet.schemas.targets import TargetLimits
from jetfleet.settings import MIN_RATE, Settings

_decoder = msgspec.json.Decoder(TargetLimits)
_encoder = msgspec.json.Encoder()
_CAS_TRIES = 10
MAX_REASON_CHARS = 256  # schemas/job.py ShortText

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?:/\s*([smh]))?\s*$")
PER_SECOND = {"s": 1.0, "m": 60.0, "h": 3600.0}
RATE_FORMS = "requests per second (0.5), or N/s, N/m or N/h (5/s, 300/m, 18000/h)"


@dataclass(frozen=True)
class LimitChange:
    """What ``jetfleet target set`` asks for: None leaves a field as it is."""

    rate: float | None = None
    burst: int | None = None
    daily: int | None = None
    reason: str = ""
    set_by: str = ""


def parse_rate(text: str) -> float:
    """Requests per second from ``5/s``, ``300/m``, ``18000/h`` or a bare ``0.5``.

    Raises:
        JetfleetError: not one of those forms, or not a finite rate above 0.
    """
    match = _RATE_RE.match(text)
    if match is None:
        raise JetfleetError(f"--rate {text!r} is not a rate: give {RATE_FORMS}")
    rate = float(match.group(1)) / PER_SECOND[match.group(2) or "s"]
    if not (MIN_RATE <= rate <= 1e9 and math.isfinite(rate)):
        raise JetfleetError(
            f"--rate {text!r} must be from one a day (1/86400 per second) to 1e9/s: "
            f"give {RATE_FORMS}"
        )
    return rate


def parse_whole(text: str, option: str, minimum: int, meaning: str) -> int:
    """A whole number of at least ``minimum`` (``option`` names it in the error).

    Raises:
        JetfleetError: not a whole number, or below ``minimum``.
    """
    try:
        value = int(text.strip())
    except ValueError:
        raise JetfleetError(f"{option} {text!r} is not a whole number: give {meaning}") from None
    if value < minimum:
        raise JetfleetError(f"{option} {value} is below {minimum}: give {meaning}")
    return value


def operator_name() -> str:
    """Who is setting a limit, as ``user@host`` (what ``set_by`` records by default)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:MAX_NAME_CHARS]


def merged(old: TargetLimits | None, change: LimitChange) -> TargetLimits:
    """``old`` with what ``change`` gives; who and why are always the latest change's."""
    base = old or TargetLimits()
    return TargetLimits(
        rate=change.rate if change.rate is not None else base.rate,
        burst=change.burst if change.burst is not None else base.burst,
        daily=change.daily if change.daily is not None else base.daily,
        set_by=change.set_by,
        reason=change.reason,
    )


async def set_limits(
    js: JetStreamContext, settings: Settings, target: str, change: LimitChange
) -> TargetLimits:
    """Write ``target``'s run-time limits, merged with those already set.

    A compare-and-set on the entry's revision, so two operators changing different fields
    at once both keep their change.

    Returns:
        The record now in force.

    Raises:
        ConfigError: ``target`` is not declared.
        JetfleetError: nothing to change, or the entry kept changing under us.
    """
    settings.target(target)
    if change.rate is None and change.burst is None and change.daily is None:
        raise JetfleetError("nothing to set: give --rate, --burst or --daily (or --clear)")
    _validate_numbers(change)
    _validate_text(change)
    kv = await js.key_value(subjects.BUCKET_TARGETS)
    for _ in range(_CAS_TRIES):
        try:
            entry = await kv.get(target)
        except (KeyNotFoundError, KeyDeletedError):
            record = merged(None, change)
            try:
                await kv.create(target, _encoder.encode(record))
                return record
            except KeyWrongLastSequenceError:
                continue
        record = merged(_stored(target, entry.value), change)
        try:
            await kv.update(target, _encoder.encode(record), last=entry.revision)
            return record
        except KeyWrongLastSequenceError:
            continue
    raise JetfleetError(
        f"could not set {target}'s limits after {_CAS_TRIES} tries: the "
        f"{subjects.BUCKET_TARGETS} entry kept changing; try again"
    )


async def clear_limits(js: JetStreamContext, settings: Settings, target: str) -> bool:
    """Remove ``target``'s run-time limits, so the config file applies again.

    Returns:
        Whether there were any.

    Raises:
        ConfigError: ``target`` is not declared.
    """
    settings.target(target)
    kv = await js.key_value(subjects.BUCKET_TARGETS)
    try:
        await kv.get(target)
    except (KeyNotFoundError, KeyDeletedError):
        return False
    await kv.delete(target)
    return True


def _stored(target: str, value: bytes | None) -> TargetLimits | None:
    if not value:
        return None
    try:
        return _decoder.decode(value)
    except msgspec.MsgspecError as exc:
        # Merging with it would keep junk or drop it silently: the operator decides.
        raise JetfleetError(
            f"the {subjects.BUCKET_TARGETS} entry of {target} is not a TargetLimits record "
            f"({exc}); the ratelimit service ignores it. Remove it with "
            f"`jetfleet target unset {target}`, then set again"
        ) from None


def _validate_numbers(change: LimitChange) -> None:
    # The CLI parses with these bounds already; a caller of this function may not have,
    # and a record the ratelimit service cannot decode is ignored there (logged only).
    if change.rate is not None and not (change.rate > 0 and math.isfinite(change.rate)):
        raise JetfleetError(f"rate {change.rate!r} must be above 0 and finite: {RATE_FORMS}")
    for name, value, minimum in (("burst", change.burst, 1), ("daily", change.daily, 0)):
        if value is not None and (isinstance(value, bool) or value < minimum):
            raise JetfleetError(f"{name} {value!r} must be a whole number >= {minimum}")


def _validate_text(change: LimitChange) -> None:
    # The record's own bounds (schemas/targets.py), checked here so the error says which
    # option to fix rather than naming a field of the wire type.
    if len(change.reason) > MAX_REASON_CHARS:
        raise JetfleetError(f"--reason must be at most {MAX_REASON_CHARS} characters")
    if len(change.set_by) > MAX_NAME_CHARS or any(
        ord(c) < 32 or ord(c) == 127 for c in change.set_by
    ):
        raise JetfleetError(
            f"--set-by must be at most {MAX_NAME_CHARS} characters with no control characters"
        )
