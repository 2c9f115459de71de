"""I1 and I3 through the loss of a NATS node (DESIGN.md section 3): on a 3-node cluster
(R3 streams, consumers and buckets; ``sync_interval: always``) the real scheduler,
ratelimit, leaser, sink and workers run a few hundred ``http.get`` jobs against the
target simulator while the leader of a stream they depend on is SIGKILLed mid-run and
brought back later. Every job still ends committed or dead-lettered with a reason,
nothing is lost, and the target served each job's page exactly once (side effects
counted by the target / distinct jobs = 1.00).

Submissions go on through the election (a third of them are sent right after the kill),
so admission's publishes and the scheduler's routing meet the leaderless stream too.

A reply a service was about to send when its server died is refused by the server it
reconnects to (``allow_responses`` is that server's record of requests it delivered):
the requester asks again. Those refusals, and only those, are expected here.

An ack sent while a work consumer has no leader gets no answer; the worker sends it
again until the server confirms it (jetfleet/worker/settle_confirm.py). Should one still
be lost (given up after 30 s, or past the ack wait), its job, already committed, is
delivered again after ``ack_wait`` and acked as already done without a second request to
the target.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import pytest
from jetfleet.schemas import Job
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import resolve_url, submit_jobs
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.js_errors import is_unavailable
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.ops.status import confirmed_status
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import count_messages
from tests.conftest import admin_url, make_settings, sim_target, wait_for
from tests.stack import InProcessStack

JOBS = 300
BATCHES = 3
"""Submitted in three batches: before the kill, right after it, once the node is back."""
# The defaults. A lease must outlive the time its bucket has no leader, or its holder
# loses it with its work done and another runs the job again: with a 10 s TTL (the
# doctor's least) the leases bucket, led by the killed node, stayed unusable for up to
# 12 s here and about one job in thirty was served twice (docs/cluster.md).
LEASE_TTL_S = 30.0
ACK_WAIT_S = 45.0
SETTLE_TIMEOUT_S = 90.0

pytestmark = [pytest.mark.timeout(240), pytest.mark.expects_refusals]


class _Refusals(logging.Handler):
    """What NATS refused any connection of the run (connection.py logs each)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("NATS refused"):
            self.seen.append(record.getMessage())


@dataclass
class ClusterRun:
    """A stack of real services on the cluster, and the site that counts side effects."""

    cluster: EmbeddedCluster
    settings: Settings
    stack: InProcessStack
    sim: TargetSimulator
    target: str

    @property
    def js(self) -> JetStreamContext:
        return self.stack.connections[0].jetstream()

    def jobs(self, batch: int) -> list[Job]:
        per = JOBS // BATCHES
        return [
            Job(
                id=f"{self.target}-{n:04d}",
                url=resolve_url(self.settings, self.target, f"/page/{n}"),
            )
            for n in range(batch * per, (batch + 1) * per)
        ]

    async def submit(self, jobs: list[Job]) -> None:
        results = await submit_jobs(self.js, self.settings, self.target, jobs)
        refused = [r for r in results if r.rejection is not None or r.duplicate]
        assert not refused, refused[:3]

    async def ended(self) -> int:
        """Jobs committed or dead-lettered; -1 while a stream read finds no leader."""
        try:
            committed = await count_messages(
                self.js, subjects.STREAM_RESULTS, subjects.results(self.target)
            )
            dead = await count_messages(self.js, subjects.STREAM_DLQ, subjects.dlq(self.target))
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return -1
        return committed + dead

    async def work_left(self) -> int:
        """Work orders of this target still in JF_WORK; -1 while unreadable."""
        try:
            # A WorkQueue stream refuses the ack-less reader count_messages makes.
            info = await self.js.stream_info(
                subjects.STREAM_WORK, subjects_filter=f"jf.work.{self.target}.>"
            )
            return sum((info.state.subjects or {}).values())
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return -1

    async def leader_of(self, stream: str) -> str:
        info = await self.js.stream_info(stream)
        assert info.cluster is not None and info.cluster.leader, info.cluster
        return info.cluster.leader

    async def kill_leader_of(self, stream: str) -> int:
        """SIGKILL the node leading ``stream``; returns its index."""
        node = self.cluster.node_named(await self.leader_of(stream))
        await asyncio.to_thread(self.cluster.kill, node.index)
        return node.index


@pytest.fixture
async def cluster_run(
    request: pytest.FixtureRequest, nats_cluster: EmbeddedCluster, redis_url: str
) -> AsyncIterator[ClusterRun]:
    target = request.node.callspec.params["stream"].lower().replace("_", "").replace("-", "")
    async with TargetSimulator(SimulatorConfig()) as sim:
        settings = make_settings(
            admin_url(nats_cluster.url),
            redis_url,
            {target: sim_target(sim)},
            lease_ttl_s=LEASE_TTL_S,
            ack_wait_s=ACK_WAIT_S,
        )
        settings = msgspec.structs.replace(
            settings, nats=msgspec.structs.replace(settings.nats, replicas=3)
        )
        stack = InProcessStack(settings)
        refusals = _Refusals()
        logging.getLogger("jetfleet").addHandler(refusals)
        await stack.start(workers=2)
        try:
            yield ClusterRun(nats_cluster, settings, stack, sim, target)
        finally:
            await stack.stop()
            logging.getLogger("jetfleet").removeHandler(refusals)
            # The next test gets the whole cluster again.
            for index, node in enumerate(nats_cluster.nodes):
                if not node.running:
                    await asyncio.to_thread(nats_cluster.restart, index)
        # Only replies lost with their server (to an inbox), never a subject a role lacks.
        other = [r for r in refusals.seen if "refused publish to '_inbox_" not in r]
        assert not other, other


@pytest.mark.parametrize("stream", [subjects.STREAM_WORK, f"KV_{subjects.BUCKET_LEASES}"])
async def test_I1_I3_nothing_lost_and_one_side_effect_each_when_a_stream_leader_is_killed(
    cluster_run: ClusterRun, stream: str
) -> None:
    run = cluster_run
    began = time.monotonic()
    replicas = (await run.js.stream_info(stream)).config.num_replicas
    assert replicas == 3, f"{stream} has {replicas} replicas"
    await run.submit(run.jobs(0))
    await wait_for(
        lambda: _at_least(run.ended, JOBS // (2 * BATCHES)), 60, "progress before the kill"
    )
    ended_at_kill = await run.ended()
    killed = await run.kill_leader_of(stream)
    killed_at = time.monotonic()
    # Submitted while the stream has no leader (or has just elected one).
    await run.submit(run.jobs(1))
    await wait_for(
        lambda: _at_least(run.ended, ended_at_kill + JOBS // (2 * BATCHES)),
        60,
        "progress with the node down",
    )

    new_leader = await run.leader_of(stream)
    assert new_leader != run.cluster.nodes[killed].server_name
    down_s = time.monotonic() - killed_at
    await asyncio.to_thread(run.cluster.restart, killed)
    await run.submit(run.jobs(2))

    async def settled() -> bool:
        return await run.ended() >= JOBS and await run.work_left() == 0

    await wait_for(settled, SETTLE_TIMEOUT_S, f"{JOBS} jobs ended")

    # I3: every job ended exactly once, committed or dead-lettered with a reason.
    # (The module's earlier tests left their own targets' jobs in the totals.)
    counts = (await confirmed_status(run.js, run.settings)).targets[run.target]
    assert counts.submitted == JOBS and counts.queued == 0 and counts.leased == 0, counts
    assert counts.committed + counts.dead == JOBS and counts.rejected == 0, counts
    records = [r async for r in iter_results(run.js, run.target)]
    per_job = Counter(r.job_id for r in records)
    letters = await list_dead_letters(run.js, run.target)
    assert all(e.letter.reason for e in letters), letters
    assert not [j for j, n in per_job.items() if n > 1], "committed twice"
    dead_ids = {e.letter.order.job.id for e in letters}
    assert not set(per_job) & dead_ids, "committed and dead-lettered"
    assert len(per_job) + len(dead_ids) == JOBS

    # I1, counted by the target: pages served for the committed jobs / distinct jobs.
    served = run.sim.served_by_path()
    side_effects = [served.get(urlsplit(r.url).path, 0) for r in records]
    ratio = sum(side_effects) / len(records)
    over = {r.job_id: n for r, n in zip(records, side_effects, strict=True) if n != 1}
    print(
        f"\ncluster: killed the {stream} leader {run.cluster.nodes[killed].server_name} "
        f"after {ended_at_kill} jobs; new leader {new_leader}; node down {down_s:.1f} s; "
        f"{len(records)} committed, {len(letters)} dead-lettered "
        f"({Counter(e.letter.reason for e in letters)}); over-apply ratio {ratio:.2f}; "
        f"{time.monotonic() - began:.1f} s"
    )
    assert not over, f"jobs whose page was not served exactly once: {dict(list(over.items())[:10])}"
    assert ratio == 1.0
    assert not letters, f"dead letters: {Counter(e.letter.reason for e in letters)}"


async def _at_least(read: Callable[[], Awaitable[int]], n: int) -> bool:
    return await read() >= n
