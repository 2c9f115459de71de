"""One job's path end to end over real NATS JetStream: submit, admit, run, commit."""

from __future__ import annotations

from jetfleet.schemas import HttpFetch
from nats.aio.client import Client as NatsClient

from jetfleet.client import jobs_for, resolve_url, submit_jobs
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.stack import InProcessStack


async def test_500_jobs_over_the_simulator_are_all_committed_and_exported(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    jobs = jobs_for("demo", settings, [f"/page/{n}" for n in range(500)])
    results = await submit_jobs(js, settings, "demo", jobs)
    assert all(r.published and r.rejection is None for r in results)

    async def all_committed() -> bool:
        return (await stack.status()).totals.committed == 500

    await wait_for(all_committed, 120, "500 commits")
    status = await stack.status()
    assert status.targets["demo"].submitted == 500
    assert (status.totals.queued, status.totals.dead, status.totals.rejected) == (0, 0, 0)

    exported = [r async for r in iter_results(js, "demo")]
    assert sorted(r.job_id for r in exported) == sorted(j.id for j in jobs)
    by_id = {j.id: j for j in jobs}
    for record in exported:
        # The job carries the path as given; admission resolved it under the target.
        assert record.url == resolve_url(settings, "demo", by_id[record.job_id].url)
        assert isinstance(record.output, HttpFetch)
        assert record.output.status == 200
        assert len(record.output.body_sha256) == 64
        assert record.versions.jetfleet and record.worker == "w-0"
        assert record.key.startswith("u-")
    # Every page was fetched from the target once, by our worker.
    assert simulator.counts()["by_path_kind"]["page"] == 500
