"""A retryable failure is retried preferably by another worker (another identity)."""

from __future__ import annotations

import itertools

from nats.aio.client import Client as NatsClient

from jetfleet.client import jobs_for, submit_jobs
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.settings import Settings
from tests.conftest import wait_for
from tests.stack import InProcessStack

JOBS = 60  # 120 retries: enough that chance cannot pass the bar below


async def test_a_retry_goes_to_another_worker_first(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await stack.add_worker("w-1", identity="p-other")
    js = nc.jetstream()
    jobs = jobs_for("demo", settings, [f"/error/{n}" for n in range(JOBS)])
    await submit_jobs(js, settings, "demo", jobs)

    async def all_dead() -> bool:
        return (await stack.status()).totals.dead == len(jobs)

    await wait_for(all_dead, 60, "every failing job to use its attempts")
    letters = await list_dead_letters(js, "demo")
    moved = retries = 0
    for entry in letters:
        workers = [a.worker for a in entry.letter.history]
        assert len(workers) == settings.targets["demo"].max_attempts
        moved += sum(a != b for a, b in itertools.pairwise(workers))
        retries += len(workers) - 1
    deferred = sum(w.stats["deferred-elsewhere"] for w in stack.workers)
    print(f"\nretry elsewhere: {moved} of {retries} retries moved ({moved / retries:.0%})")
    # Each worker offered the retries it failed to the other one first.
    assert deferred > 0
    # Left to chance, half the retries would stay on the worker that failed them: mean
    # 60 of 120, sd 5.5, so 0.65 (78) is 3.3 sd above chance (with 24 jobs it was 2 sd:
    # a worker that never offered elsewhere passed one run in 40). With both cores busy
    # (five other test sessions) 83-91 % moved; with offer_elsewhere switched off,
    # 46-56 %.
    assert moved >= 0.65 * retries, (moved, retries, deferred)
