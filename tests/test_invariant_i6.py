"""I6, containment (DESIGN.md section 3; issue 10): a quarantine on one worker moves its
work to the others through the rate limiter, so the target sees no more than before.

Counted at the simulator (its arrivals and its per-client counts), never from jetfleet's
own metrics. Real servers: a fresh nats-server, the session's redis-server, and the
services and workers in this process (tests/stack.py).
"""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis
from jetfleet.schemas.lease import QuarantineRecord, QuarantineSet

from jetfleet.cli.quarantine_commands import send as send_quarantine
from jetfleet.simulator import SimulatorConfig, TargetSimulator, most_in_any_window
from tests.conftest import wait_for
from tests.queueing.helpers import committed, queue_settings
from tests.test_invariant_i4 import (
    capped_target,
    first_arrival,
    js_of,
    running,
    submit_pages,
    watch_until,
)

pytestmark = pytest.mark.timeout(150)

RATE = 6.0
BURST = 2
LATENCY_S = 0.3
QUARANTINE_AT_S = 6.0
AFTER_S = 8.0
CAPPED = "capped"


async def test_I6_a_quarantine_on_one_worker_does_not_raise_the_rate_the_target_sees(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    backlog = int(RATE * (QUARANTINE_AT_S + AFTER_S) * 1.5)  # still backlogged at the end
    async with TargetSimulator(SimulatorConfig(latency_s=LATENCY_S)) as site:
        settings = queue_settings(
            nats_url, redis_url, {CAPPED: capped_target(site, rate=RATE, burst=BURST)}, 4
        )
        async with running(settings, workers=3) as stack:
            quarantined = stack.workers[0].worker_id
            await submit_pages(stack, CAPPED, [f"/page/{n}" for n in range(backlog)], "i6")
            start = await first_arrival(site)
            await watch_until(start + QUARANTINE_AT_S)
            record = QuarantineRecord(
                scope="worker", name=quarantined, target=CAPPED, reason="i6: one worker"
            )
            quarantined_at = time.monotonic()
            reply = await send_quarantine(settings, QuarantineSet(record=record))
            assert reply.ok, reply
            # Requests it had sent before the revoke are still being answered; after
            # them it sends the target nothing.
            await watch_until(quarantined_at + LATENCY_S + 0.5)
            sent_by_quarantined = site.counts()["by_client"].get(quarantined, 0)
            await watch_until(quarantined_at + AFTER_S)
            arrivals = site.arrivals()
            by_client = site.counts()["by_client"]
            assert await committed(js_of(stack), CAPPED) < backlog, "the backlog ran out"

            # Its revoked jobs are not lost: the others commit the whole backlog.
            async def all_committed() -> bool:
                return await committed(js_of(stack), CAPPED) == backlog

            await wait_for(all_committed, 90, f"the {backlog} jobs committed")

    before = [a.at for a in arrivals if start + 1.0 <= a.at < quarantined_at]
    after = [a.at for a in arrivals if quarantined_at <= a.at < quarantined_at + AFTER_S]
    rate_before = len(before) / (quarantined_at - start - 1.0)
    rate_after = len(after) / AFTER_S
    most_after = most_in_any_window(after, 1.0)
    print(
        f"\nI6 cap {RATE:g}/s: {rate_before:.2f}/s before the quarantine of {quarantined} "
        f"(revoking {len(reply.revoked)}), {rate_after:.2f}/s after, largest 1 s window "
        f"after {most_after}; requests by worker {by_client}"
    )
    assert by_client.get(quarantined, 0) == sent_by_quarantined, (
        f"{quarantined} kept sending to {CAPPED} after its quarantine: {by_client}"
    )
    assert most_after <= RATE + BURST, f"{most_after} requests in 1 s after the quarantine"
    # Not raised (the rate limiter still spaces every request), and not lost either:
    # the other workers take up the quarantined worker's share of the cap.
    assert rate_after <= max(rate_before, RATE) + 0.5, (rate_before, rate_after)
    assert rate_after >= 0.8 * RATE, f"the other workers left the cap unused: {rate_after:.2f}/s"
