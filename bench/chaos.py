"""Chaos soak: a replicated fleet runs N jobs while everything around it breaks.

    python bench/chaos.py [--jobs 20000] [--workers 4] [--replicas 2] [--kill-every 4]
        [--rate 60] [--seed 1] [--timeout 1800] [--nats single|cluster] [--json] [--keep]

A ``DevStack`` (jetfleet/dev/devstack.py) with ``--replicas`` processes of every service
(scheduler, leaser, ratelimit, quarantine, sink, gateway), ``--workers`` plain workers,
one worker that loses some acks (tests/faults/ack_dropping_worker.py) and one whose wall
clock is 37 s ahead (libfaketime, jetfleet/dev/clock_skew.py), NATS with
``sync_interval: always`` (production's setting where fences and keys live), runs
``--jobs`` jobs against the target simulator (a few of them gone pages, dead-lettered
``http-404``). Meanwhile it:

- SIGKILLs a random worker every ``--kill-every`` seconds (jittered) and starts it again,
  as a supervisor would (on a cluster also while a node is down or just back; only the
  ack-dropping and clock-skewed ones while the stall step looks for its victim);
- at set points of progress, restarts each service once (SIGKILL of its first replica,
  then started again), disturbs NATS once, mid-run (``NatsTopology``: on one node, SIGKILL
  of the nats-server and a start on the same store and port; on a cluster, the node
  leading the work stream and, moved there first, its work consumers), stalls a worker
  past its lease (SIGSTOP for TTL + ack_wait + 2 s, then SIGCONT, beside the later steps)
  and restarts Redis empty (SIGKILL, a fresh server on the same port).

At the end it checks, from durable state (the streams and the lease buckets) and the
simulator's own counts, and exits 1 if any check fails:

- ``lost``: every submitted job is committed, dead-lettered or rejected (by job id), and
  the fleet's status is conserved with nothing unfinished;
- ``over-apply (records)``: one committed record per committed job (ratio 1.00);
- ``over-apply (site)``: pages the site served for the committed jobs over the jobs; a
  page is served again when its worker died between the site's answer and the commit
  (only the commit is fenced), so at most one page per worker SIGKILL may be served
  twice (measured 0.3 to 0.4 per kill; "rounded to 1.00" allowed 9 of 2,000 and failed
  a CI run at 10, with 24 kills);
- ``stale commits accepted``: every committed record's fence is the job's sealed fence
  and its highest fence ever granted, and no lease the stalled worker held when it was
  stopped has a record stored after that lease ran out;
- ``rate cap``: the site never saw more than rate + burst requests in any 1 s;
- ``dead letters``: every dead letter has a reason, and only the gone pages died;
- ``faults ran``: every step above happened, the NATS step before 60 % of the jobs had
  ended (a soak whose faults silently did not happen would prove nothing).

It also reports, not as a check, acks that did not take: JF_WORK messages a worker
acked that were delivered again 10 s or more later (``AckTap``, watching ``$JS.ACK``).

The last results are in docs/benchmarks.md ("Chaos soak"); tests/test_chaos_soak.py runs
the short form on the cluster (``--jobs 2000 --nats cluster``) in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from jetfleet.schemas import Job  # noqa: E402
from jetfleet.schemas.events import CommittedResult, Duplicate, Rejection  # noqa: E402
from jetfleet.services import SERVICE_NAMES  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.client import submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev import demo_cast  # noqa: E402
from jetfleet.dev.clock_skew import clock_skew, measured_offset_s  # noqa: E402
from jetfleet.dev.devstack import DevStack, NatsFactory, WorkerSpec  # noqa: E402
from jetfleet.dev.embedded import EmbeddedNats  # noqa: E402
from jetfleet.dev.embedded_cluster import EmbeddedCluster  # noqa: E402
from jetfleet.dev.settings_file import toml_tables  # noqa: E402
from jetfleet.js_errors import is_unavailable  # noqa: E402
from jetfleet.lease_store import LeaseStore  # noqa: E402
from jetfleet.ops.dead_letters import list_dead_letters  # noqa: E402
from jetfleet.ops.status import FleetStatus, confirmed_status, fleet_status  # noqa: E402
from jetfleet.settings import Settings  # noqa: E402
from jetfleet.simulator import most_in_any_window  # noqa: E402
from jetfleet.stream_reader import read_stream  # noqa: E402
from jetfleet.topology import declare  # noqa: E402
from tests.faults.ack_watch import AckEvent, AckWatcher  # noqa: E402

T = TypeVar("T")
TARGET = "demo"
LEASE_TTL_S = demo_cast.LEASE_TTL_S
ACK_WAIT_S = 8.0
CLUSTER_LEASE_TTL_S = 30.0
"""On the cluster: a lease must outlive a bucket's leader election (up to 12 s measured;
a 10 s TTL let second holders run jobs, docs/cluster.md), as `jetfleet doctor` asks."""
CLUSTER_ACK_WAIT_S = 45.0
READY_WAIT_S = 240.0
"""How long the stack's children get to answer, at start and after each restart: on a
machine loaded far past its 2 cores (a test suite beside the soak, load 20) the 18 first
starts took more than 60 s. Each restart's time is in the events."""
LEADER_WAIT_S = 60.0
STEPDOWN_WAIT_S = 15.0
LOST_GAP_S = 10.0
"""A message acked, then delivered again at least this much later: the ack did not take."""
"""How long the cluster step waits for a new stream leader, and for the killed node."""
SKEW = "+37"
"""libfaketime's offset for the skewed worker: 37 s ahead."""
DROP_ACK_PER_MILLE = 20
GONE_EVERY = 50
"""One job in this many asks for a page that is gone (404): a dead letter with a reason."""
BURST = 10
PAGE_LATENCY_S = 0.3
"""How long the site takes to answer each page: jobs spend most of their lease waiting on
it, as on a real site, so a SIGKILL or SIGSTOP finds requests in flight."""
SEND_JITTER_S = 0.2
"""As ``jetfleet demo``'s targets: a permitted request may leave up to this late on a busy
machine, so the burst is cut by that much (docs/rate-limits.md)."""
WATCH_S = 1.0
"""How long to wait, once every job has ended, for the last acks (a dropped ack's job is
acked on its redelivery, one ack_wait later)."""
LEASED_WAIT_S = 20.0
"""How long the stall step looks for a worker with ``STALL_PREFER`` jobs in hand before it
settles for the one with the most now."""
STALL_PREFER = 3
COMMITS_LAND_S = 2.0
STALL_TRIES = 3
"""How long after the SIGSTOP the stall step reads what the worker holds: a commit it
sent just before lands by then."""
STALL_STEP = "stall a worker past its TTL"
MID_RUN = 0.6
"""The NATS step must begin before this share of the jobs has ended (a kill near the end
proves little: few jobs meet the election)."""
RUN_BESIDE = frozenset({STALL_STEP})
"""Steps that run beside the later ones rather than before them: the stall lasts the
lease TTL + ack_wait + 2 s (77 s on the cluster), and queued behind it the NATS step
landed near the end of a 2,000-job run, where a leader kill proves little."""
ACK_DROPPER = "w-acks"
SKEWED = "w-skew"
RESULTS_READ_IN_FLIGHT = 64
_result = msgspec.json.Decoder(CommittedResult)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class NatsTopology(Protocol):
    """What NATS the soak runs on, and how it is disturbed once mid-run (the rest of the
    soak does not care whether NATS is one server or a cluster).

    A cluster plugs in here: ``servers`` builds it (``DevStack(nats_servers=...)``: the
    nodes must include the stack's auth file and report ``replicas = 3``), and
    ``disrupt`` SIGKILLs the node that leads the work stream (and its consumers) and
    starts it again."""

    label: str
    """What the step is called in the output."""
    servers: NatsFactory | None
    """Builds the servers; None: DevStack's one embedded server."""
    lease_ttl_s: float
    """``fleet.lease_ttl_s`` on this NATS: short on one node, long enough for a leader
    election on a cluster."""
    ack_wait_s: float
    """``fleet.ack_wait_s``: the redelivery of a stalled holder's job waits past its lease."""
    blocks_restarts: bool
    """Whether a worker cannot start while ``disrupt`` runs (no server to connect to), so
    the worker kills wait for it."""

    async def disrupt(self, stack: DevStack) -> str:
        """Do it; say what was done."""
        ...


class SingleNodeRestart:
    """One nats-server: SIGKILL it and start it again on the same store and port (there is
    no stream leader to kill on one node; this is the honest equivalent)."""

    label = "restart nats-server (single node: SIGKILL, same store and port)"
    servers = None
    lease_ttl_s = LEASE_TTL_S
    ack_wait_s = ACK_WAIT_S
    blocks_restarts = True

    async def disrupt(self, stack: DevStack) -> str:
        assert isinstance(stack.nats, EmbeddedNats)
        port = stack.nats.port
        began = time.monotonic()
        await asyncio.to_thread(stack.nats.kill)
        await asyncio.to_thread(stack.nats.start_again, 30.0)
        return f"nats-server SIGKILLed, back on port {port} in {time.monotonic() - began:.1f} s"


def _three_nodes(folder: Path, auth_include: Path) -> EmbeddedCluster:
    # sync_interval: always on every node (EmbeddedCluster's default), as production runs.
    return EmbeddedCluster(folder, size=3, auth_include=auth_include)


class StreamLeaderKill:
    """A 3-node cluster (R3 streams, consumers and buckets): move the leadership of
    JF_WORK's consumers to the node that leads JF_WORK, SIGKILL that node, wait until
    another node leads the stream, then start the killed one again on its store and
    ports (it rejoins and catches up). Worker restarts go on meanwhile."""

    label = "kill the NATS stream leader (3-node cluster, JF_WORK's leader SIGKILLed)"
    servers: NatsFactory | None = staticmethod(_three_nodes)
    lease_ttl_s = CLUSTER_LEASE_TTL_S
    ack_wait_s = CLUSTER_ACK_WAIT_S
    blocks_restarts = False

    async def disrupt(self, stack: DevStack) -> str:
        cluster = stack.nats
        assert isinstance(cluster, EmbeddedCluster) and stack.settings is not None
        nc = await connect_nats(stack.settings.nats, "jetfleet-chaos-leader", role="admin")
        try:
            js = nc.jetstream()
            old = await _stream_leader(js, subjects.STREAM_WORK, "", LEADER_WAIT_S)
            index = cluster.nodes.index(cluster.node_named(old))
            led = await _lead_consumers_from(nc, js, subjects.STREAM_WORK, old)
            began = time.monotonic()
            await asyncio.to_thread(cluster.kill, index)
            new = await _stream_leader(js, subjects.STREAM_WORK, old, LEADER_WAIT_S)
            elected_s = time.monotonic() - began
            await asyncio.to_thread(cluster.restart, index, LEADER_WAIT_S)
        finally:
            await nc.close()
        return (
            f"JF_WORK's leader {old} (leading {led} of its work consumers too) SIGKILLed; "
            f"{new} led it {elected_s:.1f} s later; the killed node back after "
            f"{time.monotonic() - began:.1f} s"
        )


async def _lead_consumers_from(nc: NatsClient, js: JetStreamContext, stream: str, node: str) -> str:
    """Move the leadership of ``stream``'s consumers to ``node`` (a stepdown naming it
    preferred, nats-server 2.11+), so killing it also leaves the work consumers without a
    leader: acks then have nowhere to go, the case a worker's acks must survive. Left
    where they were, the consumers were led elsewhere in some runs and the kill cost them
    nothing. Returns "k/n": how many of the n it leads after up to ``STEPDOWN_WAIT_S``."""
    names = [c.name for c in await js.consumers_info(stream)]
    request = msgspec.json.encode({"placement": {"preferred": node}})
    deadline = time.monotonic() + STEPDOWN_WAIT_S
    while True:
        infos = await asyncio.gather(*(js.consumer_info(stream, n) for n in names))
        elsewhere = [i.name for i in infos if i.cluster is None or i.cluster.leader != node]
        if not elsewhere or time.monotonic() > deadline:
            return f"{len(names) - len(elsewhere)}/{len(names)}"
        for name in elsewhere:
            with contextlib.suppress(Exception):  # mid-election: asked again next round
                await nc.request(
                    f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{name}", request, timeout=5.0
                )
        await asyncio.sleep(1.0)


async def _stream_leader(js: JetStreamContext, stream: str, not_this: str, wait_s: float) -> str:
    """The node leading ``stream``, once it is not ``not_this`` (wait up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(Exception):  # no leader yet, or the asked node is gone
            info = await js.stream_info(stream)
            leader = info.cluster.leader if info.cluster is not None else None
            if leader and leader != not_this:
                return leader
        if time.monotonic() > deadline:
            raise RuntimeError(f"{stream} had no leader but {not_this!r} after {wait_s:g} s")
        await asyncio.sleep(0.2)


class AckTap:
    """``AckWatcher``s (tests/faults/ack_watch.py) on ``$JS.ACK.>``, one per NATS node (a
    node killed mid-run hides what its own connection would have seen; the others still
    see it), to count acks that did not take: a stream sequence of JF_WORK acked by
    delivery *d* and seen again from a later delivery (the server delivered again a job
    whose ack a worker had sent). Counts only acks that reached some node; the ack
    dropper's drops are never sent."""

    def __init__(self) -> None:
        self.watchers: list[AckWatcher] = []
        self._conns: list[NatsClient] = []

    async def start(self, settings: Settings, urls: list[str]) -> None:
        for n, url in enumerate(urls):
            node = msgspec.structs.replace(settings.nats, url=url)
            nc = await connect_nats(node, f"jetfleet-chaos-acktap-{n}", role="admin")
            self._conns.append(nc)
            watcher = AckWatcher()
            await watcher.start(nc)
            self.watchers.append(watcher)

    def _work_events(self) -> list[AckEvent]:
        return sorted(
            (e for w in self.watchers for e in w.events if e.stream == subjects.STREAM_WORK),
            key=lambda e: e.at,
        )

    def lost(self) -> dict[int, float]:
        """Stream sequence -> when a later delivery of an acked message was first seen,
        ``LOST_GAP_S`` or more after the ack. (A delivery seen sooner was made before
        the ack was taken: a consumer's leader change hands out again the deliveries it
        had not replicated, and their holders hand them back at once.)"""
        acked: dict[int, tuple[int, float]] = {}
        lost: dict[int, float] = {}
        for event in self._work_events():
            first = acked.get(event.stream_seq)
            if first is not None and event.delivered > first[0]:
                if event.at - first[1] >= LOST_GAP_S:
                    lost.setdefault(event.stream_seq, event.at)
                # Seen again sooner: a delivery made before the ack, not after it.
                acked[event.stream_seq] = (event.delivered, first[1])
            elif event.verb == "+ACK" and first is None:
                acked[event.stream_seq] = (event.delivered, event.at)
        return lost

    def save(self, path: Path) -> None:
        """Every JF_WORK event seen, one JSON line each (``--keep``: for a second look)."""
        with path.open("w") as out:
            for e in self._work_events():
                out.write(msgspec.json.encode(e.__dict__).decode() + "\n")

    def lost_detail(self, origin: float, most: int = 8) -> list[str]:
        """For the first ``most`` lost acks: the acked delivery with when (+s from
        ``origin``) each of its acks was seen, and when the later delivery was first seen."""
        lost = self.lost()
        events = [e for e in self._work_events() if e.stream_seq in lost]
        shown = []
        for seq in sorted(lost, key=lost.__getitem__)[:most]:
            mine = sorted(
                {
                    (e.delivered, e.verb, round(e.at - origin, 1))
                    for e in events
                    if e.stream_seq == seq
                }
            )
            consumer = next(e.consumer for e in events if e.stream_seq == seq)
            shown.append(
                f"{consumer} seq {seq}: "
                + ", ".join(f"d{d} {verb} +{at}" for d, verb, at in mine if verb != "+WPI")
            )
        return shown

    def seen(self) -> int:
        """Settles and beats seen, once per node connection that saw them."""
        return sum(len(w.events) for w in self.watchers)

    async def stop(self) -> None:
        for watcher in self.watchers:
            with contextlib.suppress(Exception):
                await watcher.stop()
        for nc in self._conns:
            with contextlib.suppress(Exception):
                await nc.close()


TOPOLOGIES: dict[str, Callable[[], NatsTopology]] = {
    "single": SingleNodeRestart,
    "cluster": StreamLeaderKill,
}


class Check(msgspec.Struct):
    """One end-of-run check: its name, whether it held, and the figures behind it."""

    name: str
    passed: bool
    detail: str


class ChaosReport(msgspec.Struct):
    """What the soak prints at the end (``--json``: this object)."""

    jobs: int
    committed: int
    dead: int
    rejected: int
    lost: int
    over_apply_records: float
    over_apply_site: float
    stale_commits_accepted: int
    largest_1s_rate: int
    rate_cap: int
    dead_by_reason: dict[str, int]
    seconds: float
    jobs_per_s: float
    nats: str
    checks: list[Check]
    events: list[str]
    passed: bool
    acks_lost: int = 0
    """Jobs a worker acked that the server delivered again (``AckTap``): not a check, the
    cost of acks a consumer with no leader dropped (each job waits out ack_wait)."""
    acks_lost_after_nats_step: int = 0
    """Of those, the ones redelivered after the NATS step began."""
    acks_lost_detail: list[str] = []
    """The first few lost acks: each delivery's settles and when (+s), WPI left out."""
    settles_seen: int = 0
    """Acks, naks, terms and +WPI the tap saw (once per node connection that saw them)."""


@dataclass
class Stall:
    """The SIGSTOP step: whom, when (wall clock), and the leases it held then."""

    worker: str = ""
    stopped_at: float = 0.0
    held: dict[str, int] = field(default_factory=dict)
    """job id -> fence of each lease the worker held when it was stopped."""
    committed_by_others: int = 0
    """Of those jobs, how many were committed under a later grant (durable state)."""


@dataclass
class Soak:
    """One run of the soak: its plan, its stack, and what it did."""

    jobs: int
    workers: int
    replicas: int
    kill_every_s: float
    rate: float
    seed: int
    timeout_s: float
    topology: NatsTopology
    folder: Path
    events: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    steps_done: list[str] = field(default_factory=list)
    stall: Stall = field(default_factory=Stall)
    frozen: set[str] = field(default_factory=set)
    killed_at: dict[str, float] = field(default_factory=dict)
    """Child name -> when (monotonic) the worker killer last SIGKILLed it."""
    starting: set[str] = field(default_factory=set)
    """Workers the killer started again that have not answered yet."""
    sparing_plain: bool = False
    """Set while the stall step looks for its victim: the killer spares the plain workers,
    which are eligible only a lease TTL after their last kill. With 30 s leases on the
    cluster and a kill every 4 s among six workers, all four were often ineligible, and
    one CI run's stall found nobody to stop ("MISSING: no lease of the stalled worker")."""
    servers_down: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while Redis, or the only nats-server, is down: a worker started then could not
    connect, and a supervisor's restart would fail the same way, so kills wait for it.
    (A cluster node's loss does not hold it: the others serve a starting worker.)"""
    started: float = 0.0
    nats_step_at: float = 0.0
    """When the NATS step began (monotonic; 0: not yet)."""
    nats_step_ended_before: int = 0
    """How many jobs had ended when it began."""
    acks: AckTap = field(default_factory=AckTap)
    done: int = 0
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set each time ``done`` is read anew."""

    @property
    def stall_s(self) -> float:
        """How long the stalled worker stays stopped: past its leases and their deliveries."""
        return self.topology.lease_ttl_s + self.topology.ack_wait_s + 2.0

    def say(self, text: str) -> None:
        since = time.monotonic() - self.started if self.started else 0.0
        line = f"+{since:.1f} s {text}"
        self.events.append(line)
        log(line)

    # -- the stack ------------------------------------------------------------------

    def _fleet_table(self) -> dict[str, object]:
        # The demo's short leases and back-offs, with a longer ack_wait: the redelivery of
        # a stalled holder's job waits for more than the lease.
        return {
            **demo_cast.fleet_table(),
            "lease_ttl_s": self.topology.lease_ttl_s,
            "ack_wait_s": self.topology.ack_wait_s,
        }

    def _worker_specs(self) -> list[WorkerSpec]:
        skew = clock_skew(SKEW)
        self.skew = skew
        events = self.folder / "ack-drops.jsonl"
        dropper_env = {
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "DROP_ACK_PER_MILLE": str(DROP_ACK_PER_MILLE),
            "ACK_DROP_EVENTS": str(events),
            "ACK_DROP_WORKER": ACK_DROPPER,
        }
        plain = [WorkerSpec(f"w-{n}") for n in range(self.workers)]
        return [
            *plain,
            WorkerSpec(ACK_DROPPER, env=dropper_env, module="tests.faults.ack_dropping_worker"),
            WorkerSpec(SKEWED, env=dict(skew.env)),
        ]

    async def run(self) -> ChaosReport:
        config = self.folder / "chaos.toml"
        config.write_text(toml_tables({"fleet": self._fleet_table()}))
        stack = DevStack(
            self.folder / "stack",
            workers=0,
            user_config=config,
            worker_specs=self._worker_specs(),
            simulator_latency_s=PAGE_LATENCY_S,
            demo_table={
                "rate": self.rate,
                "burst": BURST,
                "max_in_flight": 32,
                "send_jitter_s": SEND_JITTER_S,
            },
            sites_on_own_loop=True,
            service_replicas=self.replicas,
            nats_sync_always=True,
            nats_servers=self.topology.servers,
            ready_timeout_s=READY_WAIT_S,
        )
        log(f"chaos: starting {self.replicas} replicas of each service and the workers")
        async with stack:
            assert stack.settings is not None
            self.stack = stack
            nc = await connect_nats(stack.settings.nats, "jetfleet-chaos", role="admin")
            try:
                await declare(nc.jetstream(), stack.settings)
                await self.acks.start(stack.settings, stack.nats.url.split(","))
                return await self._play(nc.jetstream())
            finally:
                await self.acks.stop()
                await nc.close()

    async def _play(self, js: JetStreamContext) -> ChaosReport:
        assert self.stack.settings is not None
        jobs = self._job_list()
        self.started = time.monotonic()
        await submit_jobs(js, self.stack.settings, TARGET, jobs)
        self.say(f"{len(jobs)} jobs submitted")
        tasks = [
            asyncio.create_task(self._kill_workers()),
            asyncio.create_task(self._scripted_steps(js)),
        ]
        try:
            status = await self._watch(js, tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._thaw()
        elapsed = time.monotonic() - self.started
        status = await self._settled(js, status)
        return await self._report(js, jobs, status, elapsed)

    def _job_list(self) -> list[Job]:
        jobs = []
        for n in range(self.jobs):
            if n % GONE_EVERY == GONE_EVERY - 1:
                jobs.append(Job(id=f"gone-{n:05d}", url=f"/missing/{n}"))
            else:
                jobs.append(Job(id=f"page-{n:05d}", url=f"/page/{n}"))
        return jobs

    async def _watch(self, js: JetStreamContext, tasks: list[asyncio.Task[None]]) -> FleetStatus:
        assert self.stack.settings is not None
        deadline = self.started + self.timeout_s
        last_said = 0.0
        status: FleetStatus | None = None
        while True:
            try:
                status = await fleet_status(js, self.stack.settings)
            except Exception as exc:  # NATS restarting: read again
                if time.monotonic() > deadline:
                    raise
                log(f"  status not read ({type(exc).__name__}: {exc}); reading again")
                await asyncio.sleep(WATCH_S)
                continue
            totals = status.totals
            self.done = totals.committed + totals.dead + totals.rejected
            self.progressed.set()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            dead = self.stack.dead_children()
            if dead:
                raise RuntimeError(self.stack.describe_dead_children())
            if time.monotonic() - last_said > 10:
                last_said = time.monotonic()
                log(f"  {self.done}/{self.jobs} ended (committed {totals.committed})")
            steps_over = tasks[1].done()
            if (self.done >= self.jobs and steps_over) or time.monotonic() > deadline:
                return status
            await asyncio.sleep(WATCH_S)

    async def _settled(self, js: JetStreamContext, status: FleetStatus) -> FleetStatus:
        """Read again until the counts add up and no ended job is still queued or leased
        (a dropped ack's job is acked on its redelivery), or three ack waits have passed."""
        assert self.stack.settings is not None
        deadline = time.monotonic() + 3 * self.topology.ack_wait_s
        while not status.conserved or _open(status):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
            status = await confirmed_status(js, self.stack.settings)
        return status

    # -- the faults ---------------------------------------------------------------

    def _workers_alive(self) -> list[str]:
        return [
            name
            for name, proc in self.stack.children.items()
            if name.startswith("worker-") and proc.poll() is None and name not in self.frozen
        ]

    async def _kill_workers(self) -> None:
        """SIGKILL a random worker every few seconds, then start it again."""
        rng = random.Random(self.seed)
        while True:
            await asyncio.sleep(self.kill_every_s * rng.uniform(0.7, 1.3))
            alive = self._workers_alive()
            if self.sparing_plain:
                alive = [n for n in alive if n.removeprefix("worker-") in (ACK_DROPPER, SKEWED)]
            if not alive:
                continue
            async with self.servers_down:
                victim = rng.choice(sorted(alive))
                self.killed_at[victim] = time.monotonic()
                self.starting.add(victim)
                self.stack.kill(victim)
                self.kills.append(victim)
                self.say(f"SIGKILL {victim}")
                began = time.monotonic()
                await self.stack.start_again(victim)
                self.starting.discard(victim)
                self.say(f"{victim} answering again after {time.monotonic() - began:.1f} s")

    async def _scripted_steps(self, js: JetStreamContext) -> None:
        steps: list[tuple[str, Callable[[], Awaitable[str]]]] = [
            *((f"restart {s}", self._restarter(s)) for s in SERVICE_NAMES[:3]),
            (STALL_STEP, lambda: self._stall_worker(js)),
            (self.topology.label, self._disrupt_nats),
            *((f"restart {s}", self._restarter(s)) for s in SERVICE_NAMES[3:]),
            ("restart redis empty", self._restart_redis),
        ]
        beside: list[asyncio.Task[None]] = []
        try:
            for n, (label, step) in enumerate(steps, start=1):
                threshold = int(self.jobs * 0.8 * n / (len(steps) + 1))
                while self.done < threshold:
                    self.progressed.clear()
                    await self.progressed.wait()
                self.say(f"step {label}: starting at {self.done} ended")
                if label in RUN_BESIDE:
                    beside.append(asyncio.create_task(self._step(label, step)))
                else:
                    await self._step(label, step)
            await asyncio.gather(*beside)
        finally:
            for task in beside:
                task.cancel()

    async def _step(self, label: str, step: Callable[[], Awaitable[str]]) -> None:
        self.say(f"step {label}: {await step()}")
        self.steps_done.append(label)

    async def _disrupt_nats(self) -> str:
        self.nats_step_at = time.monotonic()
        self.nats_step_ended_before = self.done
        if not self.topology.blocks_restarts:
            # Workers are killed and started again through it, as a supervisor would:
            # a worker started while a node is down or just back must come up.
            return await self.topology.disrupt(self.stack)
        async with self.servers_down:
            return await self.topology.disrupt(self.stack)

    def _restarter(self, service: str) -> Callable[[], Awaitable[str]]:
        async def restart() -> str:
            name = self.stack.replicas(service)[0]
            self.stack.kill(name)
            began = time.monotonic()
            await self.stack.start_again(name)
            return f"{name} SIGKILLed, answering again after {time.monotonic() - began:.1f} s"

        return restart

    async def _restart_redis(self) -> str:
        port = self.stack.redis.port
        async with self.servers_down:
            await asyncio.to_thread(self.stack.redis.kill)
            await asyncio.to_thread(self.stack.redis.start, 20.0, 1, port)
        return f"redis-server SIGKILLed, an empty one on port {port}"

    async def _stall_worker(self, js: JetStreamContext) -> str:
        """SIGSTOP the plain worker with the most jobs in hand (leases of jobs not yet
        settled: a lease outlives its job's ack until its TTL), for ``stall_s``, then
        SIGCONT. If it turns out to hold none once stopped (each was in its commit round
        trip), it is let go at once and another is picked, up to ``STALL_TRIES`` times."""
        store = await LeaseStore.open(js)
        self.sparing_plain = True
        try:
            for _ in range(STALL_TRIES):
                found = await self._stop_one_holding(store)
                if found is None:
                    return "no plain worker held a lease of an unsettled job: nothing stalled"
                name, stall = found
                if stall.held:
                    break
                await self._thaw()
                self.say(f"SIGCONT {name} at once: it held no job once stopped; picking again")
        finally:
            self.sparing_plain = False
        self.stall = stall
        stall_s = self.stall_s
        self.say(f"{name} stopped with {len(stall.held)} jobs in hand: {sorted(stall.held)}")
        await asyncio.sleep(stall_s - (time.time() - stall.stopped_at))  # the fault itself
        await self._thaw()
        return f"SIGCONT {name} after {stall_s:g} s, holding {len(stall.held)} jobs"

    async def _stop_one_holding(self, store: LeaseStore) -> tuple[str, Stall] | None:
        """SIGSTOP the worker with the most unsettled jobs in hand; its name and the jobs
        it still holds 2 s later (None: no worker held any)."""
        deadline = time.monotonic() + LEASED_WAIT_S
        while True:
            in_hand = await _read_through(lambda: self._unsettled_leases(store))
            enough = _most(in_hand) >= STALL_PREFER
            late = time.monotonic() > deadline
            # Past the deadline any worker with a job in hand will do; none past the time
            # every plain worker has been spared its kills for a lease TTL as well.
            give_up = deadline + max(LEASED_WAIT_S, self.topology.lease_ttl_s + 2.0)
            if enough or (in_hand and late) or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.2)
        if not in_hand:
            return None
        victim = max(sorted(in_hand), key=lambda w: len(in_hand[w]))
        name = f"worker-{victim}"
        self.frozen.add(name)
        os.kill(self.stack.children[name].pid, signal.SIGSTOP)
        stopped_at = time.time()
        self.say(f"SIGSTOP {name} ({len(in_hand[victim])} jobs in hand before the stop)")
        # What it holds now that it is stopped: a job read as unsettled above may have
        # been in its commit round trip (slow on a cluster), committed under its own
        # lease before that ran out; only the rest is held past the lease. (Read from
        # the seals, which stay, so a read slowed by the NATS step is still right.)
        await asyncio.sleep(COMMITS_LAND_S)
        held = await _read_through(lambda: _not_sealed_by(store, in_hand[victim]))
        return name, Stall(victim, stopped_at, held)

    async def _unsettled_leases(self, store: LeaseStore) -> dict[str, dict[str, int]]:
        """Per plain worker that may be stalled, job id -> fence of its leases whose job
        is unsettled.

        Not a worker still starting, nor one killed less than a lease TTL ago (its id's
        live leases may be its killed predecessor's). Stopping one that the killer was
        starting again left ``start_again`` waiting out the stall (77 s on the cluster,
        past its 60 s): the soak's "restarted worker did not answer"."""
        recent = time.monotonic() - self.topology.lease_ttl_s - 1.0
        alive = {
            n.removeprefix("worker-")
            for n in self._workers_alive()
            if self.killed_at.get(n, 0.0) < recent and n not in self.starting
        }
        alive -= {ACK_DROPPER, SKEWED}
        leases = [x for x in await store.all_live() if x.record.worker in alive]
        histories = await asyncio.gather(*(store.read_history(x.record.job_id) for x in leases))
        in_hand: dict[str, dict[str, int]] = {}
        for lease, entry in zip(leases, histories, strict=True):
            if entry.history is None or entry.history.settled is None:
                in_hand.setdefault(lease.record.worker, {})[lease.record.job_id] = lease.fence
        return in_hand

    async def _thaw(self) -> None:
        for name in list(self.frozen):
            proc = self.stack.children.get(name)
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            self.frozen.discard(name)

    # -- the checks ---------------------------------------------------------------

    async def _report(
        self, js: JetStreamContext, jobs: list[Job], status: FleetStatus, elapsed: float
    ) -> ChaosReport:
        assert self.stack.settings is not None
        # Each read is asked again on a 503: on the cluster a fresh reader's first fetch
        # was answered "service unavailable" once, after every job had ended.
        stored = await _read_through(lambda: _results(js))
        records = [r for r, _ in stored]
        per_job = Counter(r.job_id for r in records)
        letters = await _read_through(lambda: list_dead_letters(js))
        dead_by_reason = Counter(e.letter.reason or "(none)" for e in letters)
        dead_ids = {e.letter.order.job.id for e in letters}
        duplicates = await _read_through(
            lambda: _job_ids(js, subjects.STREAM_DUPLICATES, "jf.duplicates.>", Duplicate)
        )
        rejected = await _read_through(
            lambda: _job_ids(js, subjects.STREAM_REJECTED, "jf.rejected.>", Rejection)
        )
        ended = set(per_job) | dead_ids | duplicates | rejected
        missing = sorted(j.id for j in jobs if j.id not in ended)
        totals = status.totals
        unfinished = _open(status)
        checks = [
            Check(
                "lost",
                not missing and status.unaccounted == 0 and unfinished == 0,
                f"{len(missing)} jobs in no end state {missing[:5]}; status unaccounted "
                f"{status.unaccounted}, unfinished {unfinished}",
            )
        ]
        twice = {j: n for j, n in per_job.items() if n > 1}
        ratio_records = len(records) / len(per_job) if per_job else 0.0
        checks.append(
            Check(
                "over-apply (records)",
                not twice and bool(per_job),
                f"{len(records)} records for {len(per_job)} jobs; committed twice: "
                f"{dict(list(twice.items())[:5])}",
            )
        )
        ratio_site, served_again = self._site_ratio(records)
        checks.append(
            Check(
                "over-apply (site)",
                len(served_again) <= len(self.kills),
                f"ratio {ratio_site:.4f}; pages served more than once: {len(served_again)} "
                f"(at most one per worker SIGKILL, {len(self.kills)}) {served_again[:5]}",
            )
        )
        stale = await self._stale_commits(js, stored)
        checks.append(Check("stale commits accepted", not stale, f"{len(stale)}: {stale[:5]}"))
        largest, cap = self._rate()
        checks.append(Check("rate cap", largest <= cap, f"largest 1 s {largest}, cap {cap}"))
        gone = {j.id for j in jobs if j.id.startswith("gone-")}
        no_reason = [e.letter.order.job.id for e in letters if not e.letter.reason]
        checks.append(
            Check(
                "dead letters",
                not no_reason and dead_ids == gone,
                f"{len(letters)} letters {dict(dead_by_reason)}; without a reason "
                f"{no_reason[:5]}; gone pages not dead {sorted(gone - dead_ids)[:5]}; "
                f"others dead {sorted(dead_ids - gone)[:5]}",
            )
        )
        checks.append(self._faults_ran())
        passed = all(c.passed for c in checks)
        lost_acks = self.acks.lost()
        self.acks.save(self.folder / "ack-events.jsonl")
        return ChaosReport(
            jobs=len(jobs),
            committed=totals.committed,
            dead=totals.dead,
            rejected=totals.rejected,
            lost=len(missing),
            over_apply_records=round(ratio_records, 2),
            over_apply_site=round(ratio_site, 2),
            stale_commits_accepted=len(stale),
            largest_1s_rate=largest,
            rate_cap=cap,
            dead_by_reason=dict(sorted(dead_by_reason.items())),
            seconds=round(elapsed, 1),
            jobs_per_s=round(len(ended) / elapsed, 1) if elapsed else 0.0,
            nats=self.topology.label,
            checks=checks,
            events=self.events,
            passed=passed,
            acks_lost=len(lost_acks),
            settles_seen=self.acks.seen(),
            acks_lost_detail=self.acks.lost_detail(self.started),
            acks_lost_after_nats_step=sum(
                1 for at in lost_acks.values() if self.nats_step_at and at >= self.nats_step_at
            ),
        )

    def _site_ratio(self, records: list[CommittedResult]) -> tuple[float, list[str]]:
        """Pages the site served (2xx, its own count) for the committed jobs over the
        jobs, and the pages served more than once (with who asked for them)."""
        served = self.stack.simulator.served_by_path()
        paths = {urlsplit(r.url).path for r in records}
        counts = {p: served.get(p, 0) for p in paths}
        again = sorted(p for p, n in counts.items() if n > 1)
        clients: dict[str, list[str]] = {}
        for visit in self.stack.simulator.visits():
            if visit.path in again:
                clients.setdefault(visit.path, []).append(visit.client)
        shown = [f"{p} by {','.join(clients.get(p, []))}" for p in again]
        distinct = sum(1 for n in counts.values() if n)
        return (sum(counts.values()) / distinct if distinct else 0.0), shown

    async def _stale_commits(
        self, js: JetStreamContext, stored: list[tuple[CommittedResult, float]]
    ) -> list[str]:
        """Committed records that a stale holder got accepted: a fence that is not the
        job's sealed one or is below the highest fence ever granted for it; or a lease
        the stalled worker held when stopped, committed after that lease ran out."""
        store = await LeaseStore.open(js)
        stale: list[str] = []
        gate = asyncio.Semaphore(RESULTS_READ_IN_FLIGHT)

        async def judge(record: CommittedResult, stored_at: float) -> None:
            async with gate:
                entry = await store.read_history(record.job_id)
            history = entry.history
            sealed = history.settled.fence if history and history.settled else None
            highest = history.fence if history else 0
            if sealed != record.fence or record.fence < highest:
                stale.append(
                    f"{record.job_id}: fence {record.fence}, sealed {sealed}, highest {highest}"
                )
            stalled_fence = self.stall.held.get(record.job_id)
            if stalled_fence is not None and record.fence > stalled_fence:
                self.stall.committed_by_others += 1
            ran_out = self.stall.stopped_at + self.topology.lease_ttl_s + 1.0
            if stalled_fence == record.fence and stored_at > ran_out:
                stale.append(
                    f"{record.job_id}: the stalled holder's fence {record.fence} committed "
                    f"{stored_at - self.stall.stopped_at:.1f} s after it was stopped"
                )

        await asyncio.gather(*(judge(r, at) for r, at in stored))
        return stale

    def _rate(self) -> tuple[int, int]:
        assert self.stack.settings is not None
        target = self.stack.settings.targets[TARGET]
        stamps = [a.at for a in self.stack.simulator.arrivals() if a.kind != "robots"]
        return most_in_any_window(stamps, 1.0), int(target.rate) + target.burst

    def _faults_ran(self) -> Check:
        drops = _count_lines(self.folder / "ack-drops.jsonl")
        offset = measured_offset_s(self.skew)
        missing = []
        if not self.kills:
            missing.append("no worker was killed")
        if len(self.steps_done) < len(SERVICE_NAMES) + 3:
            missing.append(f"steps done: {self.steps_done}")
        if not self.stall.committed_by_others:
            missing.append("no lease of the stalled worker was granted again and committed")
        if drops == 0:
            missing.append("no ack was dropped")
        if self.nats_step_ended_before > self.jobs * MID_RUN:
            missing.append(
                f"the NATS step began with {self.nats_step_ended_before} of {self.jobs} jobs "
                "ended: not mid-run"
            )
        if offset is None or abs(offset - 37) > 2:
            missing.append(
                f"the skewed worker's clock is off by {offset} s, not 37 ({self.skew.via})"
            )
        return Check(
            "faults ran",
            not missing,
            f"{len(self.kills)} worker SIGKILLs, {len(self.steps_done)} steps, stall of "
            f"{self.stall.worker} holding {len(self.stall.held)} leases "
            f"({self.stall.committed_by_others} committed by later grants), {drops} acks "
            f"dropped, clock skew {offset} s via {self.skew.via}, the NATS step at "
            f"{self.nats_step_ended_before} jobs ended"
            + (f"; MISSING: {'; '.join(missing)}" if missing else ""),
        )


async def _not_sealed_by(store: LeaseStore, held: dict[str, int]) -> dict[str, int]:
    """Of ``held`` (job id -> fence), the jobs not sealed under that very fence."""
    ids = sorted(held)
    entries = await asyncio.gather(*(store.read_history(j) for j in ids))
    return {
        j: held[j]
        for j, entry in zip(ids, entries, strict=True)
        if entry.history is None
        or entry.history.settled is None
        or entry.history.settled.fence != held[j]
    }


async def _read_through(read: Callable[[], Awaitable[T]]) -> T:
    """``read()``, asked again while NATS does not answer (the NATS step may run beside
    the stall; a reader's fetch may meet a 503), for up to ``LEADER_WAIT_S``."""
    deadline = time.monotonic() + LEADER_WAIT_S
    while True:
        try:
            return await read()
        except Exception as exc:
            if not is_unavailable(exc) or time.monotonic() > deadline:
                raise
            log(f"  lease read failed ({type(exc).__name__}); reading again")
        await asyncio.sleep(0.5)


def _most(in_hand: dict[str, dict[str, int]]) -> int:
    return max((len(jobs) for jobs in in_hand.values()), default=0)


def _open(status: FleetStatus) -> int:
    return status.totals.queued + status.totals.leased + status.admitting


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _results(js: JetStreamContext) -> list[tuple[CommittedResult, float]]:
    """Every committed record with when the server stored it (unix seconds)."""
    found = []
    async with contextlib.aclosing(
        read_stream(js, subjects.STREAM_RESULTS, "jf.results.>")
    ) as msgs:
        async for msg in msgs:
            found.append((_result.decode(msg.data), msg.metadata.timestamp.timestamp()))
    return found


async def _job_ids(
    js: JetStreamContext, stream: str, filter_subject: str, kind: type[Duplicate | Rejection]
) -> set[str]:
    """The job ids of a stream's ``Duplicate`` or ``Rejection`` records."""
    decoder = msgspec.json.Decoder(kind)
    found = set()
    async with contextlib.aclosing(read_stream(js, stream, filter_subject)) as msgs:
        async for msg in msgs:
            found.add(decoder.decode(msg.data).job_id)
    return found


def print_report(report: ChaosReport) -> None:
    """The report as people read it."""
    print(
        f"\nchaos soak: {report.jobs} jobs in {report.seconds:.1f} s "
        f"({report.jobs_per_s:.1f} jobs/s); NATS step: {report.nats}"
    )
    print(
        f"committed {report.committed}, dead {report.dead} {report.dead_by_reason}, "
        f"rejected {report.rejected}, lost {report.lost}"
    )
    print(
        f"over-apply ratio: records {report.over_apply_records:.2f}, site "
        f"{report.over_apply_site:.2f}; stale commits accepted {report.stale_commits_accepted}; "
        f"largest 1 s at the site {report.largest_1s_rate} (cap {report.rate_cap})"
    )
    print(
        f"acks sent but redelivered: {report.acks_lost} ({report.acks_lost_after_nats_step} "
        f"after the NATS step began; {report.settles_seen} settles seen)"
    )
    for line in report.acks_lost_detail:
        print(f"  lost ack: {line}")
    for check in report.checks:
        print(f"  [{'ok' if check.passed else 'FAIL'}] {check.name}: {check.detail}")
    print("PASSED" if report.passed else "FAILED")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/chaos.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=20000, help="jobs to run (default 20000)")
    parser.add_argument("--workers", type=int, default=4, help="plain workers (default 4)")
    parser.add_argument("--replicas", type=int, default=2, help="processes per service")
    parser.add_argument(
        "--kill-every", type=float, default=4.0, help="seconds between worker SIGKILLs"
    )
    parser.add_argument("--rate", type=float, default=60.0, help="the target's rate cap (/s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random kills")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after (s)")
    parser.add_argument("--nats", choices=sorted(TOPOLOGIES), default="single")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the data folder (logs)")
    args = parser.parse_args(argv)
    if args.jobs < 2 * GONE_EVERY:
        parser.error(f"--jobs must be at least {2 * GONE_EVERY}")
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-chaos-"))
    soak = Soak(
        jobs=args.jobs,
        workers=args.workers,
        replicas=args.replicas,
        kill_every_s=args.kill_every,
        rate=args.rate,
        seed=args.seed,
        timeout_s=args.timeout,
        topology=TOPOLOGIES[args.nats](),
        folder=folder,
    )
    try:
        report = asyncio.run(soak.run())
    finally:
        if args.keep:
            log(f"data folder kept: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print_report(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
