"""The thin client: build jobs and publish them to ``jf.submit.<target>``.

It adds nothing a raw NATS publish would not get: paths, defaults and refusals are all
admission's (``jetfleet.admission``), applied by the scheduler to every submission.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from jetfleet import subjects, tracing
from jetfleet.admission import admit
from jetfleet.canonical import resolve_url as resolve_under
from jetfleet.publish import publish_durably_tracked
from jetfleet.schemas import Job, Rejection
from jetfleet.settings import Settings

_encoder = msgspec.json.Encoder()
IN_FLIGHT = 256


def new_job_id() -> str:
    """A fresh, unique job id."""
    return uuid.uuid4().hex


def resolve_url(settings: Settings, target: str, url_or_path: str) -> str:
    """The URL admission will give ``url_or_path`` on ``target`` (a full URL as given, a
    path resolved against the target's base_url), for callers that want it up front.

    Raises:
        ConfigError: if ``target`` is not declared.
    """
    return resolve_under(settings.target(target).base_url, url_or_path)


@dataclass(frozen=True)
class SubmitResult:
    """What happened to one submission: published (and maybe refused by admission)."""

    job_id: str
    published: bool
    rejection: Rejection | None = None
    duplicate: bool = False
    """The stream already had another submission with this job id (inside its duplicate
    window): this one was dropped. Use a new id to submit the work again. A retry of
    this call's own publish whose first answer was lost is not a duplicate: the stored
    submission is read back and compared with this one (same target, same bytes: it was
    published). That read needs the right to get a message of JF_SUBMIT (the
    ``client``, ``operator`` and ``gateway`` roles have it): without it, or when it
    fails, the stream's answer (duplicate) stands."""


async def submit_jobs(
    js: JetStreamContext,
    settings: Settings,
    target: str,
    jobs: Sequence[Job],
    progress: Callable[[int], None] | None = None,
) -> list[SubmitResult]:
    """Publish ``jobs`` to ``target``, many at once, each exactly once per job id.

    Every job is published, even one admission will refuse: the scheduler keeps the
    refusal on ``jf.rejected`` so it is counted and never lost. The refusal is also
    returned here so the caller can say at once what to fix.
    """
    return await submit_raw(
        js, settings, target, [_encoder.encode(j) for j in jobs], [j.id for j in jobs], progress
    )


async def submit_raw(
    js: JetStreamContext,
    settings: Settings,
    target: str,
    payloads: Sequence[bytes],
    job_ids: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    own_traces: bool = False,
) -> list[SubmitResult]:
    """Publish raw payloads to ``jf.submit.<target>`` (the bytes are not re-encoded).

    Each job's submit span is a child of the current span, or with ``own_traces`` the
    root of a trace of its own, linked to the current span (one job, one trace, however
    many a request brings)."""
    subject = subjects.submit(target)
    gate = asyncio.Semaphore(IN_FLIGHT)
    done = 0

    async def one(index: int, payload: bytes) -> SubmitResult:
        nonlocal done
        job_id = job_ids[index] if job_ids else new_job_id()
        verdict = admit(subject, payload, settings)
        async with gate:
            # The job's root span: each of its attempts is a child of it, siblings.
            parent, links = tracing.own_trace() if own_traces else (None, None)
            with tracing.span(
                f"send {subject}", SpanKind.PRODUCER, parent, _sent(subject, job_id), links
            ):
                # The job id as message id: a retried or repeated submission is one job.
                ack, unanswered = await publish_durably_tracked(
                    js, subject, payload, msg_id=f"sub-{job_id}", headers=tracing.inject()
                )
                duplicate = bool(ack.duplicate)
                if duplicate and unanswered:
                    # Maybe our own try whose answer was lost: then it was published.
                    duplicate = not await _stored_as(js, ack, subject, payload)
        done += 1
        if progress is not None:
            progress(done)
        rejection = verdict if isinstance(verdict, Rejection) else None
        return SubmitResult(
            job_id=job_id, published=not duplicate, rejection=rejection, duplicate=duplicate
        )

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads))))


STORED_READ_S = 1.0
"""How long the read-back of a possibly lost first try may take before the stream's own
answer (duplicate) stands: a role without the right to get a JF_SUBMIT message is
refused, and nats-py reports that only as a timeout."""


async def _stored_as(js: JetStreamContext, ack: PubAck, subject: str, payload: bytes) -> bool:
    """Whether the submission the stream holds under ``ack`` is this one: on ``subject``
    with exactly ``payload`` (the same job id with the same bytes on the same target is
    this submission, stored by a try of ours whose answer was lost, or an identical
    one: the same job either way). Unknown (the read refused, timed out, failed): False,
    the stream's own answer."""
    try:
        stored = await asyncio.wait_for(js.get_msg(ack.stream, ack.seq), STORED_READ_S)
    except Exception:  # best effort: any failure keeps the stream's answer
        return False
    return stored.subject == subject and stored.data == payload


def _sent(subject: str, job_id: str) -> dict[str, AttributeValue] | None:
    if not tracing.tracing_on():
        return None
    attributes = tracing.messaging(subject, "send")
    attributes.update({tracing.JOB_ID: job_id, tracing.TARGET: subjects.target_of(subject)})
    return attributes


def jobs_for(target: str, settings: Settings, urls: Iterable[str], **fields: object) -> list[Job]:
    """Jobs for ``urls`` (full URLs, or paths admission resolves under the target) with
    shared ``fields``, each with a fresh id.

    The URLs are kept as given, as a raw NATS client would send them: the scheduler's
    settings decide what a path means, not the submitter's. ``target`` and ``settings``
    change nothing in the jobs; they stay in the signature for existing callers.
    """
    return [msgspec.convert({"id": new_job_id(), "url": u, **fields}, Job) for u in urls]
