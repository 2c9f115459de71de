"""What per-job subjects cost nats-server: memory, disk and read/write time at N settled jobs.

    python bench/subject_state_bench.py [--jobs 1000000] [--marks 100000,1000000]
        [--layouts per-job,per-target,per-job-ttl] [--ttl-s 60] [--targets 100]
        [--dead-every 100] [--msg-ids] [--budget-s 900] [--data-dir /tmp] [--json] [--keep]

For each layout, a fresh nats-server (``EmbeddedNats``, file storage, a temp folder under
``--data-dir``) gets jetfleet's topology (``jetfleet.topology.declare`` with default
Settings), then the bench writes N settled jobs' durable state as jetfleet leaves it:

- committed job: its ``jf-fences`` entry (``JobLeaseHistory`` with the id claim, fence,
  grant count and the ``SealedCommit`` seal carrying the result, written as ``kv.create``
  writes: ``Nats-Expected-Last-Subject-Sequence: 0``), one ``ok`` ``Outcome`` on
  ``jf.outcome.<target>.<job>`` (a core publish, no headers: the per-job layout from
  before outcomes moved to one subject per target, which is what this bench measures;
  today's worker sends its ok events in batches on ``jf.outcome.<target>``), and
  the ``CommittedResult`` on ``jf.results.<target>.<key>`` (put-if-absent header);
- every ``--dead-every``-th job is dead instead: its entry sealed with ``SealedDeath``
  (the letter with a 3-attempt history), three failure ``Outcome`` events, and the
  ``DeadLetter`` on ``jf.dlq.<target>.<job>`` with ``Jf-Reason`` / ``Jf-Job`` and the
  put-if-absent header.

Payloads are the real msgspec structs from ``schemas/``, encoded as jetfleet encodes
them (an ``http.get`` result without a stored body: status, final URL, three headers,
body size). The entry is written once, in its final (sealed) form: jetfleet writes it
four times (claim, routed, grant, seal), but the bucket keeps one revision per key, so
the state at rest is the same. Leases are not written: a settled job's lease expires by
its TTL (30 s), so leases are bounded by the jobs in flight, not by the jobs settled.

``per-target`` writes the same messages, same bytes, to the same streams, with the job
token dropped from every subject (``jf.results.<target>``, ``jf.outcome.<target>``,
``jf.dlq.<target>``, ``$KV.jf-fences.<target>``) and the job id (and key) in headers
instead, so the two runs differ only in the number of subjects. For that run the bench
lifts ``KV_jf-fences``'s one-message-per-subject limit (else it would keep one entry per
target) and drops the put-if-absent header (there is no per-key subject to test).

``per-job-ttl`` is ``per-job`` with ``Nats-TTL: --ttl-s`` on every message (the streams
get ``allow_msg_ttl``; jetfleet's KV buckets have it already): after each mark the bench
waits (bounded) until the subjects are gone and measures again, to show that per-message
expiry gives the subject state back.

``Nats-Msg-Id`` headers (``res-<key>``, ``dlq-<id>``, ``out-<id>-<fence>``) are left out
unless ``--msg-ids``: the server keeps each id for the stream's duplicate window (120 s
here) whatever the subject layout, so during a fill they swamp what this bench measures
(docs/benchmarks.md section 5 measured them: about 200 B each, for rate x window).

Writes go as JetStream atomic batches (``allow_atomic`` is switched on for the four
streams written; it changes nothing stored), one batch per stream per chunk of jobs,
``--in-flight`` chunks at once.

At each mark it records: nats-server RSS (psutil) just after the writes; each stream's
messages, bytes and ``num_subjects`` (``$JS.API.STREAM.INFO``); the store's size on
disk; then it restarts nats-server (clean stop, start, time until ready) and records its
RSS at rest, which holds what the server keeps for the store (per-subject index and
per-block state) without the fill's garbage. Then it times, after 20 warm-up reads,
the reads jetfleet's hot path makes: the leader read of a result by subject (the
leaser's and sink's committed-key check, hit and miss), the leader read of a job's
``jf-fences`` entry, the batched direct get of a job's outcome subject (the dead
letter's attempt history), and a put-if-absent result publish to a new subject. For
``per-target`` the result and entry reads and the publish name the target's subject (the
last message on it, always in the newest block); it has no per-job miss or history read.

The bench stops itself: after ``--budget-s`` of writing it measures where it got to
(marked partial). It refuses to start when the data folder lacks room. The temp folder
is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
import nats  # noqa: E402
from harness import fmt_table  # noqa: E402
from jetfleet.schemas import (  # noqa: E402
    AttemptRecord,
    CommittedResult,
    DeadLetter,
    HttpFetch,
    Job,
    Outcome,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.lease import JobLeaseHistory, SealedCommit, SealedDeath  # noqa: E402
from nats.aio.client import Client as NatsClient  # noqa: E402
from nats.js.errors import NotFoundError  # noqa: E402
from stats import folder_bytes, latency_summary, process_usage  # noqa: E402
from tree_state import tree_state  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.dev.embedded import EmbeddedNats  # noqa: E402
from jetfleet.direct_batch import read_subject  # noqa: E402
from jetfleet.settings import load_settings  # noqa: E402
from jetfleet.topology import declare  # noqa: E402

LAYOUTS = ("per-job", "per-target", "per-job-ttl")
FENCES_STREAM = f"KV_{subjects.BUCKET_FENCES}"
WRITTEN_STREAMS = (
    subjects.STREAM_RESULTS,
    subjects.STREAM_OUTCOMES,
    subjects.STREAM_DLQ,
    FENCES_STREAM,
)
IF_ABSENT = {"Nats-Expected-Last-Subject-Sequence": "0"}
READS = 200
WARM_UP = 20
SAMPLE_IDS = 4000
# Stored bytes per job measured at 1M (about 2.4 KiB); the disk check asks for 2x that.
DISK_BYTES_PER_JOB = 5 * 1024
_encoder = msgspec.json.Encoder()

Message = tuple[str, dict[str, str], bytes]


@dataclasses.dataclass(frozen=True)
class SettledJob:
    """What the reads need to find one written job again."""

    job_id: str
    target: str
    key: str
    dead: bool


@dataclasses.dataclass
class Batches:
    """One chunk's messages, per stream."""

    by_stream: dict[str, list[Message]] = dataclasses.field(
        default_factory=lambda: {s: [] for s in WRITTEN_STREAMS}
    )

    ttl: str = ""
    """Nats-TTL for every message (per-job-ttl), empty for none."""

    def add(self, stream: str, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        if self.ttl:
            headers = {**headers, "Nats-TTL": self.ttl}
        self.by_stream[stream].append((subject, headers, payload))


VERSIONS = Versions(
    jetfleet="0.1.0",
    handler="http.get@1",
    code="3925a7fd07130866",
    config="9f2c1e4b7a0d5e36",
    python="3.11.7",
    nats_py="2.16.0",
    id="a1b2c3d4e5f60718",
)


class JobWriter:
    """Builds each job's durable state as jetfleet writes it, in one layout."""

    def __init__(
        self, layout: str, targets: int, dead_every: int, msg_ids: bool, ttl_s: int = 0
    ) -> None:
        self.per_job = layout != "per-target"
        self.ttl_s = ttl_s
        self.targets = [f"t{n:03d}" for n in range(targets)]
        self.dead_every = dead_every
        self.msg_ids = msg_ids
        self.rng = random.Random(7)

    def job(self, i: int) -> SettledJob:
        target = self.targets[i % len(self.targets)]
        job_id = f"{self.rng.getrandbits(128):032x}"
        url = f"https://{target}.example.com/catalogue/item/{i}"
        key = hashlib.sha256(url.encode()).hexdigest()[:40]
        dead = self.dead_every > 0 and i % self.dead_every == self.dead_every - 1
        return SettledJob(job_id, target, key, dead)

    def add(self, batches: Batches, i: int, job: SettledJob) -> None:
        """Add job ``i``'s messages to ``batches``."""
        if self.ttl_s:
            batches.ttl = str(self.ttl_s)
        order = WorkOrder(
            job=Job(id=job.job_id, url=f"https://{job.target}.example.com/catalogue/item/{i}"),
            target=job.target,
            key=job.key,
            max_attempts=3,
            timeout_s=30.0,
        )
        fence = 3 * i + 1
        if job.dead:
            self._add_dead(batches, i, job, order, fence)
        else:
            self._add_committed(batches, i, job, order, fence)

    def _add_committed(
        self, batches: Batches, i: int, job: SettledJob, order: WorkOrder, fence: int
    ) -> None:
        result = CommittedResult(
            job_id=job.job_id,
            target=job.target,
            url=order.job.url,
            key=job.key,
            handler="http.get",
            worker=f"w-{i % 16:02d}",
            attempt=1,
            duration_s=0.4123,
            output=HttpFetch(
                status=200,
                final_url=order.job.url,
                headers={
                    "content-type": "text/html; charset=utf-8",
                    "content-length": "18234",
                    "last-modified": "Sat, 05 Dec 2026 10:00:00 GMT",
                },
                body_bytes=18234,
            ),
            versions=VERSIONS,
            identity=f"id-{i % 64:02d}",
            fence=fence,
        )
        self._entry(batches, i, job, SealedCommit(fence=fence, result=result), fence)
        self._outcome(batches, i, job, 1, "ok", "", fence, durable=False)
        headers = {**IF_ABSENT} if self.per_job else {"Jf-Key": job.key, "Jf-Job": job.job_id}
        if self.msg_ids:
            headers["Nats-Msg-Id"] = f"res-{job.key}"
        subject = (
            subjects.result_key(job.target, job.key)
            if self.per_job
            else self._flat(subjects.result_key(job.target, job.key))
        )
        batches.add(subjects.STREAM_RESULTS, subject, _encoder.encode(result), headers)

    def _add_dead(
        self, batches: Batches, i: int, job: SettledJob, order: WorkOrder, fence: int
    ) -> None:
        kinds = (("retryable", "http-503"), ("retryable", "http-503"), ("permanent", "http-503"))
        history = [
            AttemptRecord(
                attempt=n,
                worker=f"w-{(i + n) % 16:02d}",
                identity=f"id-{(i + n) % 64:02d}",
                fence=fence - 2 + n,
                duration_s=0.25,
                outcome=kind,
                reason=reason,
            )
            for n, (kind, reason) in enumerate(kinds, 1)
        ]
        for record in history:
            self._outcome(
                batches, i, job, record.attempt, record.outcome, record.reason, record.fence, True
            )
        letter = DeadLetter(
            order=order, reason="attempts-exhausted", history=history, detail="last: http-503"
        )
        self._entry(batches, i, job, SealedDeath(fence=fence + 1, letter=letter), fence + 1)
        headers = {"Jf-Reason": letter.reason, "Jf-Job": job.job_id}
        if self.per_job:
            headers.update(IF_ABSENT)
        if self.msg_ids:
            headers["Nats-Msg-Id"] = f"dlq-{job.job_id}"
        subject = subjects.dead_letter(job.target, job.job_id)
        subject = subject if self.per_job else self._flat(subject)
        batches.add(subjects.STREAM_DLQ, subject, _encoder.encode(letter), headers)

    def _entry(self, batches: Batches, i: int, job: SettledJob, sealed: Any, fence: int) -> None:
        grants = 3 if job.dead else 1
        entry = JobLeaseHistory(
            fence=fence, grants=grants, submit_seq=i + 1, settled=sealed, routed_seq=i + 1
        )
        if self.per_job:
            subject, headers = f"$KV.{subjects.BUCKET_FENCES}.{job.job_id}", {**IF_ABSENT}
        else:
            subject, headers = f"$KV.{subjects.BUCKET_FENCES}.{job.target}", {"Jf-Job": job.job_id}
        batches.add(FENCES_STREAM, subject, _encoder.encode(entry), headers)

    def _outcome(
        self,
        batches: Batches,
        i: int,
        job: SettledJob,
        attempt: int,
        kind: Any,
        reason: str,
        fence: int,
        durable: bool,
    ) -> None:
        event = Outcome(
            job_id=job.job_id,
            target=job.target,
            worker=f"w-{(i + attempt) % 16:02d}",
            attempt=attempt,
            kind=kind,
            duration_s=0.4123,
            versions=VERSIONS,
            identity=f"id-{(i + attempt) % 64:02d}",
            reason=reason,
            fence=fence,
            subnet="10.1.0.0/24",
        )
        headers: dict[str, str] = {} if self.per_job else {"Jf-Job": job.job_id}
        if durable and self.msg_ids:
            headers["Nats-Msg-Id"] = f"out-{job.job_id}-{fence}"
        subject = subjects.outcome(job.target, job.job_id)
        subject = subject if self.per_job else self._flat(subject)
        batches.add(subjects.STREAM_OUTCOMES, subject, _encoder.encode(event), headers)

    @staticmethod
    def _flat(subject: str) -> str:
        """The subject without its last (per-job) token."""
        return subject.rsplit(".", 1)[0]


async def publish_batch(nc: NatsClient, messages: list[Message]) -> None:
    """Store ``messages`` (one stream) as one atomic batch; raise on the server's error."""
    if not messages:
        return
    batch_id = f"{random.getrandbits(96):024x}"
    for n, (subject, headers, payload) in enumerate(messages[:-1], 1):
        tagged = {**headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n)}
        await nc.publish(subject, payload, headers=tagged)
    subject, headers, payload = messages[-1]
    tagged = {
        **headers,
        "Nats-Batch-Id": batch_id,
        "Nats-Batch-Sequence": str(len(messages)),
        "Nats-Batch-Commit": "1",
    }
    reply = await nc.request(subject, payload, headers=tagged, timeout=60.0)
    answer = json.loads(reply.data or b"{}")
    if "error" in answer:
        raise RuntimeError(f"atomic batch to {subject} refused: {answer['error']}")


async def stream_state(nc: NatsClient, stream: str) -> dict[str, int]:
    """Messages, bytes and subjects of ``stream`` (nats-py's StreamState has no
    ``num_subjects``, so the API is asked directly)."""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=30.0)
    state = json.loads(reply.data)["state"]
    return {k: int(state.get(k, 0)) for k in ("messages", "bytes", "num_subjects")}


async def time_reads(
    nc: NatsClient, per_job: bool, written: list[SettledJob], rng: random.Random, ttl_s: int = 0
) -> dict[str, dict[str, float | int]]:
    """p50/p90/p99/max (ms) of the hot path's reads and of a put-if-absent publish."""
    if not written:
        return {}
    js = nc.jetstream(timeout=30.0)
    picks = [rng.choice(written) for _ in range(READS + WARM_UP)]

    def result_subject(job: SettledJob) -> str:
        subject = subjects.result_key(job.target, job.key)
        return subject if per_job else subject.rsplit(".", 1)[0]

    def entry_subject(job: SettledJob) -> str:
        return f"$KV.{subjects.BUCKET_FENCES}.{job.job_id if per_job else job.target}"

    def outcome_subject(job: SettledJob) -> str:
        subject = subjects.outcome(job.target, job.job_id)
        return subject if per_job else subject.rsplit(".", 1)[0]

    async def leader_get(stream: str, subject: str) -> None:
        with contextlib.suppress(NotFoundError):
            await js.get_msg(stream, subject=subject, direct=False)

    async def history(job: SettledJob) -> None:
        await read_subject(nc, subjects.STREAM_OUTCOMES, outcome_subject(job))

    async def new_result(n: int, job: SettledJob) -> None:
        key = hashlib.sha256(f"new-{n}-{rng.random()}".encode()).hexdigest()[:40]
        subject = subjects.result_key(job.target, key) if per_job else result_subject(job)
        headers = {**IF_ABSENT} if per_job else {"Jf-Key": key}
        if ttl_s:
            headers["Nats-TTL"] = str(ttl_s)
        await js.publish(subject, b'{"probe":true}', headers=headers)

    def missing(job: SettledJob) -> str:
        return subjects.result_key(job.target, hashlib.sha256(job.key.encode()).hexdigest()[:40])

    probes: dict[str, Callable[[int, SettledJob], Awaitable[object]]] = {
        "result_get": lambda n, j: leader_get(subjects.STREAM_RESULTS, result_subject(j)),
        "entry_get": lambda n, j: leader_get(FENCES_STREAM, entry_subject(j)),
        "result_publish": new_result,
    }
    if per_job:
        # per-target has no per-job reads: a job's history or key is not one subject there.
        probes["result_miss"] = lambda n, j: leader_get(subjects.STREAM_RESULTS, missing(j))
        probes["history_read"] = lambda n, j: history(j)
    out: dict[str, dict[str, float | int]] = {}
    for name, probe in probes.items():
        times = []
        for n, job in enumerate(picks):
            started = time.perf_counter()
            await probe(n, job)
            if n >= WARM_UP:
                times.append(time.perf_counter() - started)
        out[name] = latency_summary(times)
    return out


class Run:
    """One layout: its server, writer and measurements."""

    def __init__(self, args: argparse.Namespace, layout: str, root: Path) -> None:
        self.args = args
        self.layout = layout
        self.folder = root / layout
        self.server = EmbeddedNats(self.folder)
        self.ttl_s = args.ttl_s if layout == "per-job-ttl" else 0
        self.writer = JobWriter(layout, args.targets, args.dead_every, args.msg_ids, self.ttl_s)
        self.sampled: list[SettledJob] = []
        self.nc: NatsClient | None = None

    async def connect(self) -> NatsClient:
        self.nc = await nats.connect(self.server.url, max_reconnect_attempts=0)
        return self.nc

    async def prepare(self) -> None:
        self.server.start()
        nc = await self.connect()
        js = nc.jetstream(timeout=30.0)
        settings = load_settings(None, {"NATS_URL": self.server.url})
        await declare(js, settings)
        for stream in WRITTEN_STREAMS:
            config = (await js.stream_info(stream)).config
            changes: dict[str, Any] = {"allow_atomic": True}
            if stream == FENCES_STREAM and self.layout == "per-target":
                changes["max_msgs_per_subject"] = -1
            if self.ttl_s:
                changes["allow_msg_ttl"] = True  # KV buckets have it already
            await js.update_stream(dataclasses.replace(config, **changes))

    async def write(self, start: int, stop: int, deadline: float) -> int:
        """Write jobs [start, stop) until ``deadline``; the index reached."""
        assert self.nc is not None
        nc, chunk = self.nc, self.args.chunk
        every = max(1, self.args.jobs // SAMPLE_IDS)
        sem = asyncio.Semaphore(self.args.in_flight)
        failures: list[BaseException] = []

        async def send(batches: Batches) -> None:
            try:
                await asyncio.gather(*(publish_batch(nc, m) for m in batches.by_stream.values()))
            except Exception as exc:  # surfaced below, after the others finish
                failures.append(exc)
            finally:
                sem.release()

        tasks: set[asyncio.Task[None]] = set()
        i = start
        while i < stop and time.monotonic() < deadline and not failures:
            batches = Batches()
            for n in range(i, min(stop, i + chunk)):
                job = self.writer.job(n)
                self.writer.add(batches, n, job)
                if n % every == 0:
                    self.sampled.append(job)
            i = min(stop, i + chunk)
            await sem.acquire()
            task = asyncio.create_task(send(batches))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        if failures:
            raise failures[0]
        await nc.flush()
        return i

    async def measure(
        self, jobs: int, write_s: float, partial: bool, phase: str = "written", read: bool = True
    ) -> dict[str, Any]:
        """The server's memory, store and read times now (restarting the server)."""
        assert self.nc is not None
        pid = self.server.process.pid if self.server.process else None
        rss_live = (process_usage(pid) or {}).get("rss_mib")
        streams = {s: await stream_state(self.nc, s) for s in WRITTEN_STREAMS}
        disk = folder_bytes(self.folder / "jetstream")
        await self.nc.drain()
        started = time.monotonic()
        self.server.stop(timeout_s=120.0)
        stop_s = time.monotonic() - started
        started = time.monotonic()
        self.server.start(timeout_s=600.0)
        start_s = time.monotonic() - started
        pid = self.server.process.pid if self.server.process else None
        rss_rest = (process_usage(pid) or {}).get("rss_mib")
        nc = await self.connect()
        per_job = self.layout != "per-target"
        reads = (
            await time_reads(nc, per_job, self.sampled, random.Random(jobs), self.ttl_s)
            if read
            else {}
        )
        rss_after_reads = (process_usage(pid) or {}).get("rss_mib")
        messages = sum(s["messages"] for s in streams.values())
        return {
            "layout": self.layout,
            "phase": phase,
            "ttl_s": self.ttl_s,
            "jobs": jobs,
            "partial": partial,
            "write_s": round(write_s, 1),
            "messages": messages,
            "subjects": sum(s["num_subjects"] for s in streams.values()),
            "stream_bytes": sum(s["bytes"] for s in streams.values()),
            "streams": streams,
            "disk_bytes": disk,
            "rss_live_mib": rss_live,
            "rss_rest_mib": rss_rest,
            "rss_after_reads_mib": rss_after_reads,
            "stop_s": round(stop_s, 2),
            "start_s": round(start_s, 2),
            "reads": reads,
        }

    async def wait_expired(self, subjects_before: int) -> float:
        """Wait (bounded: TTL + 300 s) until the TTL'd subjects are gone; seconds waited."""
        assert self.nc is not None
        started = time.monotonic()
        deadline = started + self.ttl_s + 300.0
        while time.monotonic() < deadline:
            states = [await stream_state(self.nc, s) for s in WRITTEN_STREAMS]
            if sum(s["num_subjects"] for s in states) <= subjects_before // 1000:
                break
            await asyncio.sleep(2.0)
        return round(time.monotonic() - started, 1)

    def close(self) -> None:
        self.server.stop(timeout_s=120.0)


async def run_layout(args: argparse.Namespace, layout: str, root: Path) -> list[dict[str, Any]]:
    run = Run(args, layout, root)
    rows: list[dict[str, Any]] = []
    try:
        await run.prepare()
        rows.append(await run.measure(0, 0.0, False))
        deadline = time.monotonic() + args.budget_s
        written, write_s = 0, 0.0
        for mark in args.marks:
            started = time.monotonic()
            written = await run.write(written, mark, deadline)
            write_s += time.monotonic() - started
            partial = written < mark
            rows.append(await run.measure(written, write_s, partial))
            _progress(rows[-1])
            if run.ttl_s:
                waited = await run.wait_expired(rows[-1]["subjects"])
                rows.append(await run.measure(written, write_s, partial, "expired", read=False))
                rows[-1]["expiry_wait_s"] = waited
                _progress(rows[-1])
            if partial:
                break
    finally:
        if run.nc is not None and not run.nc.is_closed:
            with contextlib.suppress(Exception):
                await run.nc.close()
        run.close()
    return rows


def _progress(row: dict[str, Any]) -> None:
    print(
        f"# {row['layout']} {row['jobs']:,} jobs: {row['messages']:,} msgs, "
        f"{row['subjects']:,} subjects, rss live {row['rss_live_mib']:.0f} MiB, "
        f"at rest {row['rss_rest_mib']:.0f} MiB, write {row['write_s']} s",
        file=sys.stderr,
        flush=True,
    )


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "layout",
        "jobs",
        "messages",
        "subjects",
        "stored MiB",
        "disk MiB",
        "RSS live MiB",
        "RSS at rest MiB",
        "restart s",
        "write jobs/s",
        "result get p50/p99 ms",
        "result miss p50/p99 ms",
        "entry get p50/p99 ms",
        "history read p50/p99 ms",
        "result publish p50/p99 ms",
    ]

    def pct(row: dict[str, Any], name: str) -> str:
        r = row["reads"].get(name)
        return f"{r['p50_ms']:.2f}/{r['p99_ms']:.2f}" if r else "-"

    body = []
    for row in rows:
        rate = row["jobs"] / row["write_s"] if row["write_s"] else 0.0
        body.append(
            [
                row["layout"] + ("" if row["phase"] == "written" else f", {row['phase']}"),
                f"{row['jobs']:,}" + (" (partial)" if row["partial"] else ""),
                f"{row['messages']:,}",
                f"{row['subjects']:,}",
                f"{row['stream_bytes'] / 2**20:.0f}",
                f"{row['disk_bytes'] / 2**20:.0f}",
                f"{row['rss_live_mib']:.0f}",
                f"{row['rss_rest_mib']:.0f}",
                f"{row['start_s']:.1f}",
                f"{rate:,.0f}" if rate else "-",
                pct(row, "result_get"),
                pct(row, "result_miss"),
                pct(row, "entry_get"),
                pct(row, "history_read"),
                pct(row, "result_publish"),
            ]
        )
    return fmt_table(header, body)


def check_room(folder: Path, jobs: int) -> None:
    """Refuse to start when ``folder``'s disk cannot hold one layout's store."""
    need = jobs * DISK_BYTES_PER_JOB
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SystemExit(
            f"{folder} has {free / 2**30:.1f} GiB free; {jobs:,} jobs need about "
            f"{need / 2**30:.1f} GiB (each layout's folder is deleted before the next): "
            "pass --data-dir on a disk with room, or fewer --jobs"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=1_000_000, help="settled jobs to write")
    p.add_argument(
        "--marks",
        default="",
        help="comma-separated job counts to measure at (default 100000 and --jobs)",
    )
    p.add_argument(
        "--layouts",
        default="per-job,per-target",
        help=f"comma-separated, of {', '.join(LAYOUTS)}",
    )
    p.add_argument("--targets", type=int, default=100, help="targets the jobs spread over")
    p.add_argument("--dead-every", type=int, default=100, help="every Nth job is dead (0: none)")
    p.add_argument("--msg-ids", action="store_true", help="also send jetfleet's Nats-Msg-Ids")
    p.add_argument(
        "--ttl-s", type=int, default=60, help="per-job-ttl: each message's Nats-TTL (seconds)"
    )
    p.add_argument("--chunk", type=int, default=250, help="jobs per atomic batch set")
    p.add_argument("--in-flight", type=int, default=8, help="chunks awaiting their commit")
    p.add_argument("--budget-s", type=float, default=900.0, help="writing time per layout")
    p.add_argument("--data-dir", default=tempfile.gettempdir(), help="where the temp store goes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--json-out", default="", help="also write the JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    args = p.parse_args(argv)
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    marks = [int(m) for m in args.marks.split(",") if m] or [min(100_000, args.jobs), args.jobs]
    args.marks = sorted({m for m in marks if 0 < m <= args.jobs})
    args.layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"--layouts: unknown {bad}; choose from {', '.join(LAYOUTS)}")
    if args.chunk * 4 > 1000 or args.chunk < 1:
        p.error("--chunk: 1 to 250 (a dead job's 3 events must fit a 1,000-message batch)")
    return args


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Run every layout; the results with the code fingerprint and times."""
    check_room(Path(args.data_dir), args.jobs)
    tree = tree_state()["sha256"]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        root = Path(tempfile.mkdtemp(prefix="jf-subjects-", dir=args.data_dir))
        try:
            rows += await run_layout(args, layout, root)
        finally:
            if args.keep:
                print(f"# kept {root}", file=sys.stderr)
            else:
                shutil.rmtree(root, ignore_errors=True)
    return {
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tree": tree,
        "tree_after": tree_state()["sha256"],
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(collect(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(table(result["rows"]))
    print(
        f"\ntree {result['tree']} (after: {result['tree_after']}); "
        f"{result['started']} - {result['finished']}"
    )


if __name__ == "__main__":
    main()
