"""The worker takes each request's rate permit itself, just before the request (issue 9):
a job refused its permit was never sent, so it keeps its attempt; and a fleet in the
middle of an upgrade pays exactly one permit per request, whichever side is older.

Real servers: a fresh nats-server, the tests' redis-server, the target simulator, and
the ratelimit service, scheduler, leaser, sink and workers in this process."""

from __future__ import annotations

import asyncio

import msgspec
from jetfleet.schemas import HandlerOutput, LeaseGrant, LeaseRefusal

from jetfleet.lease_client import LeaseClient
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.worker.builtin import http_get
from jetfleet.worker.handlers import HandlerContext, handler
from tests.conftest import wait_for
from tests.leasing import ask, order_for
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack


async def test_a_job_refused_its_permit_again_and_again_keeps_its_one_attempt(
    nats_url: str, redis_url: str
) -> None:
    jobs = 12
    async with TargetSimulator(SimulatorConfig()) as site:
        # 4 requests/s for 32 slots: most permits asked for are refused, and each job
        # may be attempted once. A refusal that spent the attempt would end the job
        # dead (attempts-exhausted) on its next grant, never sent.
        slow = target(site.base_url, rate=4.0, burst=1, max_attempts=1)
        settings = queue_settings(nats_url, redis_url, {"slow": slow}, concurrency=16)
        stack = InProcessStack(settings)
        await stack.start(workers=2)
        try:
            js = stack.connections[0].jetstream()
            paths = [f"/page/{n}" for n in range(jobs)]
            await submit_paths(js, settings, "slow", paths, "once", handler="http.get")

            async def all_committed() -> bool:
                return await committed(js, "slow") == jobs

            await wait_for(all_committed, 60, f"the {jobs} jobs committed")
            assert await dead(js, "slow") == 0
            refusals = sum(w.stats["refused:rate-limited"] for w in stack.workers)
            assert refusals >= 1, "no permit was refused: the test proved nothing"
            assert site.counts()["by_path_kind"] == {"page": jobs}
        finally:
            await stack.stop()


async def test_a_grant_takes_a_permit_only_for_a_worker_from_before_the_move(
    nats_url: str, redis_url: str
) -> None:
    async with TargetSimulator(SimulatorConfig()) as site:
        # Room for one request now and the next in 100 s (a fresh limiter state allows
        # no burst).
        settings = queue_settings(
            nats_url, redis_url, {"demo": target(site.base_url, rate=0.01, burst=1)}, 1
        )
        stack = InProcessStack(settings)
        await stack.start(workers=0)
        try:
            leases = LeaseClient(stack.connections[0])
            # An older worker leaves the permit to the grant: the first takes it...
            older = ask(order_for(settings, "/page/1"), sends_request=True)
            assert isinstance(await leases.grant(older), LeaseGrant)
            # ...so the next older worker's grant is refused for the rate.
            spent = await leases.grant(ask(order_for(settings, "/page/2"), sends_request=True))
            assert isinstance(spent, LeaseRefusal) and spent.reason == "rate-limited", spent
            # A current worker takes its own permit just before the request: its grant
            # takes none (an older leaser would not either, for sends_request false).
            current = ask(order_for(settings, "/page/3"))
            assert not current.sends_request
            assert isinstance(await leases.grant(current), LeaseGrant)
        finally:
            await stack.stop()


async def test_without_leases_a_job_waits_for_its_permit_and_keeps_its_one_attempt(
    nats_url: str, redis_url: str
) -> None:
    jobs = 8
    async with TargetSimulator(SimulatorConfig()) as site:
        # fleet.leases = false (a benchmark baseline): every delivery counts as an
        # attempt, so a job handed back for its permit would end attempts-exhausted
        # unsent; it waits for the permit instead, and the cap still holds.
        slow = target(site.base_url, rate=2.0, burst=1, max_attempts=1)
        settings = queue_settings(nats_url, redis_url, {"slow": slow}, 8, leases=False)
        stack = InProcessStack(settings)
        await stack.start(workers=2)
        try:
            js = stack.connections[0].jetstream()
            paths = [f"/page/{n}" for n in range(jobs)]
            await submit_paths(js, settings, "slow", paths, "bare", handler="http.get")

            async def all_committed() -> bool:
                return await committed(js, "slow") == jobs

            await wait_for(all_committed, 60, f"the {jobs} jobs committed")
            assert await dead(js, "slow") == 0
            assert site.counts()["by_path_kind"] == {"page": jobs}
            assert site.max_in_any_window(1.0) <= 2.0 + 1, site.counts()["windows"]
        finally:
            await stack.stop()


SLOW_SETUP_HANDLER = "test.slow-setup"
SETUP_RATE = 2.0


@handler(SLOW_SETUP_HANDLER, permit_when_ready=True)
async def slow_setup_get(ctx: HandlerContext) -> HandlerOutput:
    """``http.get`` after a setup as slow as a browser page opening under load: 1.8 s for
    the first of each four jobs down to 0 s for the fourth, so requests sent at the end
    of their setup, with permits taken before it, would all leave at once."""
    n = int(ctx.order.job.url.rsplit("/", 1)[1])
    await asyncio.sleep(1.8 - 0.6 * (n % 4))
    assert ctx.ready is not None, "the worker gave a permit_when_ready handler no ready"
    await ctx.ready()
    return await http_get(ctx)


async def test_a_handler_permitted_when_ready_sends_at_the_cap_however_long_its_setup(
    nats_url: str, redis_url: str
) -> None:
    jobs = 12
    async with TargetSimulator(SimulatorConfig()) as site:
        capped = target(site.base_url, rate=SETUP_RATE, burst=1, max_attempts=1)
        settings = queue_settings(nats_url, redis_url, {"setup": capped}, concurrency=4)
        settings = msgspec.structs.replace(
            settings, fleet=msgspec.structs.replace(settings.fleet, handlers=(SLOW_SETUP_HANDLER,))
        )
        stack = InProcessStack(settings)
        await stack.start(workers=2)
        try:
            js = stack.connections[0].jetstream()
            paths = [f"/page/{n}" for n in range(jobs)]
            await submit_paths(js, settings, "setup", paths, "ready", handler=SLOW_SETUP_HANDLER)

            async def all_committed() -> bool:
                return await committed(js, "setup") == jobs

            await wait_for(all_committed, 90, f"the {jobs} jobs committed")
            # A permit that said wait at ready ended its attempt unrun, refunded: with one
            # attempt each, none is dead.
            assert await dead(js, "setup") == 0
            assert site.counts()["by_path_kind"] == {"page": jobs}
            # 2/s, burst 1: any 1 s window holds at most 3 (taken before the setups, the
            # permits' spacing was gone by the time the requests left).
            assert site.max_in_any_window(1.0) <= SETUP_RATE + 1, site.counts()["windows"]
            refusals = sum(w.stats["refused:rate-limited"] for w in stack.workers)
            assert refusals >= 1, "no permit said wait at ready: the refund was not tested"
        finally:
            await stack.stop()
