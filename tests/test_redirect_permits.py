"""Every request pays for a permit, a redirect hop included: a target at 2 requests/s
whose pages all redirect once never sees more than its cap at the simulator."""

from __future__ import annotations

from jetfleet.connection import connect_nats
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from tests.conftest import wait_for
from tests.queueing.helpers import committed, queue_settings, submit_paths, target
from tests.stack import InProcessStack

RATE = 2.0


async def test_a_redirect_hop_takes_a_permit_of_its_own(nats_url: str, redis_url: str) -> None:
    async with TargetSimulator(SimulatorConfig()) as site:
        targets = {"hops": target(site.base_url, rate=RATE, burst=1)}
        settings = queue_settings(nats_url, redis_url, targets, concurrency=8)
        stack = InProcessStack(settings)
        await stack.start(workers=2)
        observer = await connect_nats(settings.nats, "redirect-observer")
        try:
            js = observer.jetstream()
            # Each job is two requests: /redirect/N answers 302 to /page/N.
            await submit_paths(js, settings, "hops", [f"/redirect/{n}" for n in range(8)], "r")

            async def all_committed() -> bool:
                return await committed(js, "hops") == 8

            await wait_for(all_committed, 60, "the redirected jobs to commit")
            counts = site.counts()
            assert counts["by_path_kind"] == {"redirect": 8, "page": 8}, counts
            # 16 requests at 2/s (burst 1): any 1 s window holds at most 3. On one
            # permit per job it would be 4 (a job's two requests back to back).
            assert site.max_in_any_window(1.0) <= RATE + 1, counts["windows"]
            assert site.max_in_any_window(3.0) <= 3 * RATE + 1
        finally:
            await stack.stop()
            await observer.close()
