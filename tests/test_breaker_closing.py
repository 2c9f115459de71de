"""What keeps a closed circuit breaker closed, and what decides a half-open one, against
real servers (docs/quarantine.md#the-target-circuit-breaker): refusals read again after
a close (a replica replaying the stream, or one still counting) open nothing; a probe
that sent no request, or an outcome of another worker, decides nothing; a probe handed
back unrun lets the next grant probe at once."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import LeaseGrant, LeaseRefusal, Outcome, Versions
from jetfleet.schemas.breaker import BreakerClose, BreakerOpen, BreakerRecord
from jetfleet.services.quarantine import QuarantineService
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.breaker_commands import send_breaker
from jetfleet.lease_client import LeaseClient
from jetfleet.settings import QuarantineRule, Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.leasing import ask, order_for
from tests.queueing.helpers import committed, submit_paths
from tests.stack import InProcessStack
from tests.test_breaker_service import (
    SHOP,
    K,
    alerts,
    breaker_settings,
    breakers,
    refuse,
    state,
)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """The breaker tests' settings: SHOP and NEWS, K = 3 identities in 600 s."""
    return breaker_settings(nats_url, redis_url, simulator)


async def open_by_hand(settings: Settings, cool_s: float = 1.0) -> None:
    record = BreakerRecord(target=SHOP, cool_s=cool_s, reason="test", opened_by="operator")
    assert (await send_breaker(settings, BreakerOpen(record=record))).ok


async def wait_state(settings: Settings, wanted: str, timeout_s: float = 10.0) -> None:
    async def reached() -> bool:
        return await state(settings) == wanted

    await wait_for(reached, timeout_s, f"the breaker of {SHOP} {wanted}")


async def counted(replica: QuarantineService, outcome: str, times: int) -> None:
    """Wait until ``replica`` counted ``outcome`` of SHOP's breaker ``times`` times."""

    async def reached() -> bool:
        return replica.breaker.fired.get(target=SHOP, outcome=outcome) >= times

    await wait_for(reached, 30.0, f"{times} breaker answer(s) {outcome}")
    assert replica.breaker.fired.get(target=SHOP, outcome=outcome) == times


def outcome(job_id: str, fence: int, worker: str, **fields: object) -> bytes:
    """An outcome event of SHOP as a worker publishes it."""
    event = Outcome(
        job_id=job_id,
        target=SHOP,
        worker=worker,
        attempt=1,
        kind="ok",
        duration_s=0.1,
        versions=Versions(jetfleet="0", handler="http.get@0"),
        fence=fence,
    )
    return msgspec.json.encode(msgspec.structs.replace(event, **fields))


async def test_a_replay_after_a_close_does_not_reopen_from_refusals_met_while_open(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    for n in range(K):
        await refuse(nc, f"a{n}", f"id-{n}")
    await wait_state(settings, "open", 30.0)
    # Requests in flight when it opened come back refused too, from K more identities:
    # the live replica meets K again and is answered kept.
    for n in range(K):
        await refuse(nc, f"late{n}", f"id-late-{n}")
    await counted(replica, "kept", 1)
    assert (await send_breaker(settings, BreakerClose(target=SHOP, reason="checked"))).ok
    assert await breakers(settings) == []

    second = await services.add_quarantine()  # a restart: it replays the window
    await counted(second, "already-fired", 2)  # the opening's evidence, and the kept one's
    assert await breakers(settings) == []
    assert [a.change for a in await alerts(nc)] == ["opened", "closed"]


async def test_refusals_stored_before_a_close_open_nothing_and_newer_ones_count_on(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await open_by_hand(settings, cool_s=600.0)
    # K-1 identities refused while it is open: not yet K, so nothing is asked.
    for n in range(K - 1):
        await refuse(nc, f"open{n}", f"id-open-{n}")
    # The close's horizon is the newest event stored, whether the replica read it yet.
    assert (await send_breaker(settings, BreakerClose(target=SHOP, reason="checked"))).ok
    # One more identity after the close makes K with the two before it: those came
    # before the close, so the breaker stays closed and only the new refusal counts on.
    await refuse(nc, "after0", "id-after-0")
    await counted(replica, "already-fired", 1)
    assert await breakers(settings) == []
    for n in range(1, K):
        await refuse(nc, f"after{n}", f"id-after-{n}")
    await wait_state(settings, "open", 30.0)
    (view,) = await breakers(settings)
    assert view.record.identities == [f"id-after-{n}" for n in range(K)]


async def test_the_fired_marker_outlives_the_longest_window_a_restart_reads(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    # A rule's window longer than the breaker's: a restarted replica reads back that far.
    rule = QuarantineRule(
        scope="identity", on="blocked", count=99, window_s=7200.0, action="cool", for_s=60.0
    )
    quarantine = msgspec.structs.replace(settings.quarantine, rules=(rule,))
    longer = msgspec.structs.replace(settings, quarantine=quarantine)
    assert longer.quarantine.longest_window_s == 7200.0
    assert services.leaser is not None
    await services.leaser.drain(5.0)
    services.settings = longer
    await services.start_leaser()
    for n in range(K):
        await refuse(nc, f"m{n}", f"id-{n}")
    await services.add_quarantine()
    await wait_state(settings, "open", 30.0)
    stored = await nc.jetstream().get_last_msg(
        f"KV_{subjects.BUCKET_CONTROL}",
        f"$KV.{subjects.BUCKET_CONTROL}.{subjects.BREAKER_FIRED_PREFIX}.{SHOP}",
    )
    assert (stored.headers or {}).get("Nats-TTL") == "7260"


async def test_a_probe_that_sent_no_request_decides_nothing_and_the_next_one_goes(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await open_by_hand(settings)
    await wait_state(settings, "half-open")
    await services.add_worker("w-p", identity="id-p")
    # A noop job sends nothing to the target: its ok says nothing of the site.
    js = nc.jetstream()
    await submit_paths(js, settings, SHOP, ["/page/0"], "unsent", handler="noop")

    await counted(replica, "probe-inconclusive", 1)

    # The outcome is published before the report reaches the sink: wait for the commit.
    async def settled() -> bool:
        return await committed(js, SHOP) == 1

    await wait_for(settled, 20, "the noop probe job committed")
    # Still half-open, its probe freed as the job ended: the next job probes, is
    # answered, and closes it.
    assert await state(settings) == "half-open"
    await submit_paths(js, settings, SHOP, ["/page/1"], "sent")
    await wait_state(settings, "closed", 30.0)
    # Counted once the leaser has answered the close, a moment after the record went.
    await counted(replica, "probe-closed", 1)


async def test_an_uncalled_outcome_naming_the_probe_keeps_the_breaker(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await open_by_hand(settings)
    await wait_state(settings, "half-open")
    client = LeaseClient(nc)
    reasons = ("expired", "attempts-exhausted", "outside-target", "robots-disallowed")
    for n, reason in enumerate(reasons):
        order = order_for(settings, f"/page/{n}", target=SHOP)
        probe = await client.grant(ask(order, worker="w-a", identity="id-a"))
        assert isinstance(probe, LeaseGrant), probe  # the one before it freed the probe
        job = order.job.id
        # Another worker's outcome naming the probe's job and fence is no verdict.
        forged = outcome(job, probe.fence, "w-forger", kind="ok")
        await nc.jetstream().publish(subjects.outcome(SHOP, job), forged)
        # As the worker publishes a probe job it judged without a request.
        unsent = outcome(job, probe.fence, "w-a", kind="permanent", reason=reason, called=False)
        await nc.jetstream().publish(subjects.outcome(SHOP, job), unsent)
        await counted(replica, "probe-inconclusive", n + 1)
        assert await state(settings) == "half-open"
    assert replica.breaker.fired.get(target=SHOP, outcome="probe-closed") == 0
    assert [a.change for a in await alerts(nc)] == ["opened"]


async def test_a_probe_whose_last_attempt_timed_out_decides_nothing(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    # Its last attempt's timeout (or 5xx) made final: the site said nothing of whether it
    # still refuses the fleet, though a request was sent.
    replica = await services.add_quarantine()
    await open_by_hand(settings)
    await wait_state(settings, "half-open")
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1", target=SHOP)
    probe = await client.grant(ask(order, worker="w-a", identity="id-a"))
    assert isinstance(probe, LeaseGrant), probe
    job = order.job.id
    final = outcome(job, probe.fence, "w-a", kind="permanent", reason="attempts-exhausted")
    await nc.jetstream().publish(subjects.outcome(SHOP, job), final)
    await counted(replica, "probe-inconclusive", 1)
    assert await state(settings) == "half-open"
    # The job settled: its probe is freed for the next grant at once.
    again = order_for(settings, "/page/2", target=SHOP)
    reply = await client.grant(ask(again, worker="w-b", identity="id-b"))
    assert isinstance(reply, LeaseGrant), reply
    assert replica.breaker.fired.get(target=SHOP, outcome="probe-closed") == 0


async def test_a_probe_handed_back_unrun_lets_the_next_grant_probe_at_once(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    await open_by_hand(settings)
    await wait_state(settings, "half-open")
    client = LeaseClient(nc)
    first, second = (order_for(settings, f"/page/{n}", target=SHOP) for n in (1, 2))
    probe = await client.grant(ask(first, worker="w-a", identity="id-a"))
    assert isinstance(probe, LeaseGrant), probe
    other = await client.grant(ask(second, worker="w-b", identity="id-b"))
    assert isinstance(other, LeaseRefusal) and other.reason == "circuit-probing", other
    assert await client.release(first.job.id, probe.fence, refund=True)
    # At once, not after the first probe's lease TTL.
    assert await state(settings) == "half-open"
    reply = await client.grant(ask(second, worker="w-b", identity="id-b"))
    assert isinstance(reply, LeaseGrant), reply
