"""A worker's ``ok`` outcome events, sent in batches, one target's to a message.

An ``ok`` event is telemetry (its result is the record): the quarantine service's
rollout guard and breaker probes, the gateway's chart and ``jetfleet doctor`` count it.
Sent one a message, each cost a publish, a store in ``JF_OUTCOMES`` and a delivery to
every reader (the quarantine service and each gateway): the quarantine service and the
gateway alone took 1.3 s of the fleet's 15.6 s of CPU for 8,000 noop jobs, and batched
the noop path ran 15 % more jobs/s (docs/benchmarks.md). Held for at most
``BATCH_WAIT_S`` and sent as one message of up to ``MAX_BATCH_EVENTS`` (an
``OutcomeBatch``: jetfleet/outcome_events.py), the same events cost one of each per
batch. A batch of one is sent as a plain event.

What it costs: an ``ok`` event reaches its readers up to ``BATCH_WAIT_S`` later, and a
worker killed outright loses the events it held (a core publish could always be lost:
the connection's buffer dies with the process too). A drain sends them first.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

from jetfleet.outcome_events import BATCH_HEADER, JOB_HEADER, MAX_BATCH_EVENTS, OK_HOLD_S

log = logging.getLogger(__name__)

BATCH_WAIT_S = OK_HOLD_S
"""How long the first event of a batch waits for others: far below the quarantine
rules' and the breaker's windows (seconds to minutes) and the chart's buckets
(docs/versions.md says what it does to a fast canary's first verdict)."""


class OkOutcomeBatches:
    """Collects ``ok`` events per subject and publishes each subject's as one message."""

    def __init__(self, nc: Client, wait_s: float = BATCH_WAIT_S) -> None:
        self.nc = nc
        self.wait_s = wait_s
        self.batches_sent = 0
        """Messages published (tests and benchmarks read it)."""
        self._held: dict[str, list[tuple[str, bytes]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def add(self, subject: str, job_id: str, event: bytes) -> None:
        """Hold the encoded ``ok`` event of ``job_id`` for ``subject``; returns at once."""
        held = self._held.setdefault(subject, [])
        held.append((job_id, event))
        if len(held) >= MAX_BATCH_EVENTS:
            self._send(subject)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._send_all)

    async def drain(self) -> None:
        """Send every event held, and wait until each is handed to the connection."""
        self._send_all()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def _send_all(self) -> None:
        self._timer = None
        for subject in list(self._held):
            self._send(subject)

    def _send(self, subject: str) -> None:
        held = self._held.pop(subject, [])
        if not held:
            return
        if len(held) == 1:
            job_id, payload = held[0]
            headers = {JOB_HEADER: job_id}
        else:
            # An OutcomeBatch, its events encoded once already.
            payload = b'{"events":[' + b",".join(event for _, event in held) + b"]}"
            headers = {BATCH_HEADER: str(len(held))}
        task = asyncio.create_task(self._publish(subject, payload, headers, len(held)))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(self, subject: str, payload: bytes, headers: dict[str, str], n: int) -> None:
        try:
            await self.nc.publish(subject, payload, headers=headers)
        except Exception as exc:  # closed or reconnecting with a full buffer
            log.warning("%d ok outcome event(s) on %s not sent: %s", n, subject, exc)
            return
        self.batches_sent += 1
