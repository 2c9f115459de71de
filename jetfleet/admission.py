"""Admission: turn submitted bytes into a work order, or a rejection that says why.

Pure logic shared by the scheduler (the authority) and by the CLI and gateway, which use
it to answer a bad submission at once.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from jetfleet import subjects
from jetfleet.canonical import canonical_url, idempotency_key, is_under
from jetfleet.schemas import Job, Rejection, WorkOrder
from jetfleet.settings import Settings

BUILTIN_HANDLERS = ("http.get", "noop")

_decoder = msgspec.json.Decoder(Job)
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_JOB_FIELDS = frozenset(Job.__struct_fields__)
_Reject = Callable[..., Rejection]


def job_key(job: Job) -> str:
    """The idempotency key of ``job``: the one derivation admission and replay share."""
    return idempotency_key(
        job.handler, job.url, job.pin_identity, job.idempotency_key, job.args, job.store_body
    )


def known_handlers(settings: Settings) -> tuple[str, ...]:
    """The handler names a job may ask for: the built-ins and ``fleet.handlers``."""
    return BUILTIN_HANDLERS + tuple(settings.fleet.handlers)


def admit(
    subject: str, data: bytes, settings: Settings, submit_seq: int = 0
) -> WorkOrder | Rejection:
    """Validate a submission published on ``subject``.

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
    if target == subjects.UNPARSABLE_TARGET:
        return reject("invalid-subject", f"publish jobs to jf.submit.<target>, not {subject!r}")
    if target not in settings.targets:
        known = ", ".join(sorted(settings.targets)) or "none declared"
        return reject(
            "unknown-target",
            f"target {target!r} is not declared (known: {known}); add [targets.{target}]",
        )
    try:
        job = _decoder.decode(data)
        unknown = sorted(set(_fields_decoder.decode(data)) - _JOB_FIELDS)
    except msgspec.ValidationError as exc:
        return reject("invalid-job", f"job does not match the Job schema: {exc}")
    except msgspec.DecodeError as exc:
        return reject("invalid-json", f"payload is not valid JSON: {exc}")
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


def _check_job(
    job: Job, target: str, settings: Settings, handlers: tuple[str, ...], reject: _Reject
) -> WorkOrder | Rejection:
    config = settings.targets[target]
    if not job.url.lower().startswith(("http://", "https://")):
        return reject("invalid-url", f"url {job.url!r} must be an absolute http(s) URL", job.id)
    try:
        canonical_url(job.url)
    except ValueError as exc:
        return reject("invalid-url", f"url {job.url!r} cannot be parsed: {exc}", job.id)
    if not is_under(job.url, config.base_url):
        return reject(
            "url-outside-target",
            f"url {job.url!r} is not under target {target!r} ({config.base_url}); "
            "submit it to the target that owns it",
            job.id,
        )
    if job.handler not in handlers:
        return reject(
            "unknown-handler",
            f"handler {job.handler!r} is not known (known: {', '.join(handlers)})",
            job.id,
        )
    attempts = min(job.max_attempts or config.max_attempts, config.max_attempts)
    return WorkOrder(
        job=job,
        target=target,
        key=job_key(job),
        max_attempts=attempts,
        timeout_s=job.timeout_s or config.timeout_s,
    )
