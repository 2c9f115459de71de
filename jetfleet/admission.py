"""Admission: turn submitted bytes into a work order, or a rejection that says why.

The one contract of every entry point: ``jetfleet submit``, the gateway and any NATS
client publishing to ``jf.submit.<target>`` get the same verdict for the same bytes,
because the scheduler applies everything here: the checks, the refusal reasons and the
defaults (a missing job id, a URL given as a path under the target, the target's attempt
budget and timeout). The CLI and gateway run the same function only to answer at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import datetime

import msgspec

from jetfleet import subjects
from jetfleet.canonical import canonical_url, idempotency_key, is_under, resolve_url
from jetfleet.schemas import Job, Rejection, WorkOrder
from jetfleet.schemas.job import MAX_URL_CHARS
from jetfleet.settings import Settings

BROWSER_HANDLER = "browser.page"
BUILTIN_HANDLERS = ("http.get", "noop", BROWSER_HANDLER)

_decoder = msgspec.json.Decoder(Job)
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder = msgspec.json.Encoder()
UNASSIGNED_ID = "unassigned"
"""The id a local check (no stored submission yet) gives a job that came without one."""
_JOB_FIELDS = frozenset(Job.__struct_fields__)
_Reject = Callable[..., Rejection]


def job_key(job: Job) -> str:
    """The idempotency key of ``job``: the one derivation admission and replay share."""
    return idempotency_key(
        job.handler,
        job.url,
        job.pin_identity,
        job.idempotency_key,
        job.args,
        job.store_body,
        pin_region=job.pin_region,
    )


def known_handlers(settings: Settings) -> tuple[str, ...]:
    """The handler names a job may ask for: the built-ins and ``fleet.handlers``."""
    return BUILTIN_HANDLERS + tuple(settings.fleet.handlers)


def submission_job_id(submit_seq: int, stored_at: datetime | None) -> str:
    """The id admission gives a job submitted without one: derived from where and when
    the stream stored it, so a redelivered submission keeps it (and is routed once),
    and a stream made again, restarting its sequences, does not repeat an old one."""
    if submit_seq < 1:
        return UNASSIGNED_ID
    stamp = stored_at.isoformat() if stored_at is not None else ""
    digest = hashlib.sha256(f"{submit_seq}@{stamp}".encode()).hexdigest()[:12]
    return f"sub{submit_seq}-{digest}"


def admit(
    subject: str,
    data: bytes,
    settings: Settings,
    submit_seq: int = 0,
    stored_at: datetime | None = None,
) -> WorkOrder | Rejection:
    """Validate a submission published on ``subject``.

    Args:
        subject: ``jf.submit.<target>``.
        data: the submitted bytes, a JSON ``Job``.
        settings: the fleet's settings (targets, handlers, limits).
        submit_seq: the submission's sequence in ``JF_SUBMIT`` (0 for a local check).
        stored_at: when the stream stored it; with ``submit_seq``, the id of a job
            submitted without one (``submission_job_id``).

    Returns:
        The work order to route, or the rejection to keep on ``jf.rejected.<target>``.
    """
    target = subjects.target_of(subject)

    def reject(reason: str, message: str, job_id: str = "") -> Rejection:
        return rejection(reason, message, subject, data, settings, submit_seq, job_id)

    if len(data) > settings.fleet.max_job_bytes:
        return reject(
            "oversized",
            f"payload is {len(data)} bytes; the limit is fleet.max_job_bytes = "
            f"{settings.fleet.max_job_bytes}: keep large inputs out of the job",
        )
    # One token of target: "jf.submit.demo.x" names no target, though "demo" is one.
    if target == subjects.UNPARSABLE_TARGET or subject.count(".") != 2:
        return reject(
            "invalid-subject",
            f"publish jobs to jf.submit.<target> (a target name: lowercase letters, digits, "
            f"'-' or '_', at most 64), not {subject!r}",
        )
    if target not in settings.targets:
        known = ", ".join(sorted(settings.targets)) or "none declared"
        return reject(
            "unknown-target",
            f"target {target!r} is not declared (known: {known}); add [targets.{target}]",
        )
    try:
        job, unknown = _decode_job(data, submission_job_id(submit_seq, stored_at))
    except msgspec.ValidationError as exc:
        return reject("invalid-job", f"job does not match the Job schema: {exc}")
    except msgspec.DecodeError as exc:
        return reject("invalid-json", f"payload is not valid JSON: {exc}")
    except RecursionError as exc:  # msgspec's nesting limit is not a MsgspecError
        return reject("invalid-json", f"payload is nested too deeply to read: {exc}")
    if unknown:
        return reject(
            "invalid-job",
            f"unknown job field(s) {', '.join(unknown)}: remove them or fix the spelling "
            f"(fields: {', '.join(sorted(_JOB_FIELDS))})",
            job.id,
        )
    return _check_job(job, target, settings, known_handlers(settings), reject)


def rejection(
    reason: str,
    message: str,
    subject: str,
    data: bytes,
    settings: Settings,
    submit_seq: int = 0,
    job_id: str = "",
) -> Rejection:
    """The rejection of the submission ``data`` on ``subject``, to keep on
    ``jf.rejected.<target>`` with ``reason`` and ``message`` (what to fix)."""
    limit = settings.fleet.max_job_bytes
    # An oversized payload is kept whole in JF_SUBMIT (submit_seq); copying all of it
    # here could exceed the server's max payload and wedge admission.
    return Rejection(
        reason=reason,
        message=message,
        subject=subject,
        raw=data[:limit],
        job_id=job_id,
        submit_seq=submit_seq,
        raw_size=len(data),
        raw_truncated=len(data) > limit,
    )


def _pins_clash(job: Job, settings: Settings) -> str:
    """Why no worker could ever run a job pinned to both an identity and a region, or ''.

    Only this can be judged at admission: a declared identity's region is in the
    settings, and an identity never leaves its region. Whether any worker of a region
    exists is not (workers are not declared centrally; they come and go), so a job
    pinned to a region nobody serves is admitted and ends at the backstop
    (``no-eligible-worker``, docs/leases.md)."""
    if not job.pin_identity or not job.pin_region:
        return ""
    declared = settings.identities.get(job.pin_identity)
    if declared is None or not declared.region or declared.region == job.pin_region:
        return ""
    return (
        f"pin_identity {job.pin_identity!r} is of region {declared.region!r} "
        f"(identities.{job.pin_identity}.region) and an identity never leaves its region, "
        f"so no worker of pin_region {job.pin_region!r} can own it: drop one of the pins "
        "or make them agree"
    )


def _decode_job(data: bytes, default_id: str) -> tuple[Job, list[str]]:
    """The job in ``data`` (with ``default_id`` when it has no ``id``), and the names of
    any fields it has that the schema does not.

    Raises:
        msgspec.DecodeError: not JSON.
        msgspec.ValidationError: JSON, but not a Job.
    """
    fields = _fields_decoder.decode(data)
    if "id" not in fields:
        fields["id"] = msgspec.Raw(_encoder.encode(default_id))
        data = _encoder.encode(fields)
    return _decoder.decode(data), sorted(set(fields) - _JOB_FIELDS)


def _check_job(
    job: Job, target: str, settings: Settings, handlers: tuple[str, ...], reject: _Reject
) -> WorkOrder | Rejection:
    config = settings.targets[target]
    given = job.url
    resolved = resolve_url(config.base_url, given)
    if resolved != given:
        job = msgspec.structs.replace(job, url=resolved)
    shown = repr(given) if resolved == given else f"{given!r} (resolved to {resolved!r})"
    if not job.url.lower().startswith(("http://", "https://")):
        return reject(
            "invalid-url",
            f"url {shown} must be an absolute http(s) URL or a path under the target",
            job.id,
        )
    if len(job.url) > MAX_URL_CHARS:
        return reject(
            "invalid-url", f"url {shown} is longer than {MAX_URL_CHARS} characters", job.id
        )
    try:
        canonical_url(job.url)
    except ValueError as exc:
        return reject("invalid-url", f"url {shown} cannot be parsed: {exc}", job.id)
    if not is_under(job.url, config.base_url):
        return reject(
            "url-outside-target",
            f"url {shown} is not under target {target!r} ({config.base_url}); "
            "submit it to the target that owns it",
            job.id,
        )
    if job.handler not in handlers:
        return reject(
            "unknown-handler",
            f"handler {job.handler!r} is not known (known: {', '.join(handlers)})",
            job.id,
        )
    clash = _pins_clash(job, settings)
    if clash:
        return reject("unsatisfiable-pin", clash, job.id)
    budget_s = job.timeout_s or config.timeout_s
    page_fault = _page_fault(job, budget_s)
    if page_fault:
        return reject("invalid-job", page_fault, job.id)
    attempts = min(job.max_attempts or config.max_attempts, config.max_attempts)
    return WorkOrder(
        job=job,
        target=target,
        key=job_key(job),
        max_attempts=attempts,
        timeout_s=budget_s,
    )


def _page_fault(job: Job, budget_s: float) -> str:
    """Why the job's ``page`` spec cannot work as asked ("" when it can): one on a
    handler that never reads it, or a ``wait_timeout_s`` longer than the attempt's
    budget (its wait would be cut every time, so a removed selector would be retried as
    a timeout to the last attempt, a page request each, never ``selector-removed``)."""
    page = job.page
    if page is None:
        return ""
    if job.handler != BROWSER_HANDLER:
        return (
            f"a page spec is for handler {BROWSER_HANDLER!r}; handler {job.handler!r} "
            "ignores it: remove page or set handler"
        )
    if page.wait_timeout_s >= budget_s:
        return (
            f"page.wait_timeout_s {page.wait_timeout_s:g} s is not shorter than the "
            f"attempt's budget ({budget_s:g} s, the job's timeout_s or the target's): "
            "lower it or raise timeout_s"
        )
    return ""
