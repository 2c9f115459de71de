"""The raw nats-py floor: what JetStream moves with no jetfleet logic, two ways.

    python bench/floor_bench.py [--jobs N] [--consumers W] [--rate R] [--json]

Each run gets its own nats-server in a temp folder, one WorkQueue stream (file storage,
as jetfleet's streams) and one durable pull consumer:

    batched  one process: publish N messages with 256 awaiting their PubAck, then pull
             them 200 at a time and ack each. Publish and consume never overlap; a
             ceiling for the server, not what a worker sees (``make bench-smoke``'s floor).
    flow     what a worker does, job by job: W consumer processes (``--consume``, this
             file) pull while the bench process publishes. Each consumer runs
             ``worker.concurrency`` (8) pull loops, one per slot, each on its own
             subscription to the durable: fetch one message, ack it, fetch the next (a
             saturated worker's slots free one at a time, so it fetches one at a time).
             The producer publishes every message with its PubAck awaited, 256 in
             flight (as jetfleet's submitter). Throughput runs from the first publish
             to the last ack; latency is publish -> ack, per message.

``--rate R`` paces the flow producer at R messages/s (the latency scenario's raw round
trip); the consumers then ack with ``ack_sync`` (the ack confirmed by the server), so
publish -> fetch -> ack is a complete round trip. Unpaced, they ack as the worker does,
with a plain ``ack()``.

Consumers record ``time.monotonic()`` per ack; CLOCK_MONOTONIC is one clock for every
process on a Linux machine, so the bench compares it with its publish times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

import nats  # noqa: E402
from child_procs import spawn_logged, stop_all  # noqa: E402
from harness import fmt_table, run_with_tree, start_nats  # noqa: E402
from nats.errors import TimeoutError as NatsTimeoutError  # noqa: E402
from nats.js import api as js_api  # noqa: E402
from stats import cpu_snapshot, latency_summary, usage_since  # noqa: E402

IN_FLIGHT = 256  # PubAcks awaited at once (= jetfleet.client.IN_FLIGHT)
FETCH_BATCH = 200  # the batched floor's pull size
WORKER_SLOTS = 8  # worker.concurrency's default: jobs one worker runs at once
STREAM = "FLOOR"
DURABLE = "floor"
TIMEOUT_S = 300.0
READY_TIMEOUT_S = 30.0
BODY = b'{"id":"job-0000000","url":"http://127.0.0.1/page/0","handler":"noop"}'


async def _declare(js: Any) -> None:
    await js.add_stream(
        js_api.StreamConfig(
            name=STREAM,
            subjects=["floor.>"],
            retention=js_api.RetentionPolicy.WORK_QUEUE,
            storage=js_api.StorageType.FILE,
        )
    )
    await js.add_consumer(
        STREAM,
        js_api.ConsumerConfig(
            durable_name=DURABLE,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=60.0,
            max_ack_pending=10_000,
        ),
    )


async def batched_floor(jobs: int) -> dict[str, Any]:
    """Publish ``jobs`` messages (PubAck awaited, 256 in flight), then fetch and ack them
    all, in this process; jobs/s overall, and CPU of nats-server and this process."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-floor-"))
    server = await start_nats(folder)
    nc = await nats.connect(server.url)
    pids = {"nats-server": server.process.pid if server.process else None, "bench": os.getpid()}
    try:
        js = nc.jetstream()
        await _declare(js)
        sub = await js.pull_subscribe_bind(DURABLE, stream=STREAM)
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def publish(n: int) -> None:
            async with gate:
                await js.publish(f"floor.demo.{n % 3}", BODY)

        cpu0 = cpu_snapshot(pids)
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(publish(n) for n in range(jobs))), TIMEOUT_S)
        published = time.monotonic()
        acked = 0
        deadline = published + TIMEOUT_S
        while acked < jobs and time.monotonic() < deadline:
            for msg in await sub.fetch(FETCH_BATCH, timeout=5.0):
                await msg.ack()
                acked += 1
        await nc.flush()
        done = time.monotonic()
        usage = usage_since(pids, cpu0)
        return {
            "system": "nats-py",
            "jobs": jobs,
            "committed": acked,
            "lost": jobs - acked,
            "publish_per_s": jobs / (published - started),
            "fetch_ack_per_s": acked / (done - published),
            "elapsed_s": done - started,
            "jobs_per_s": acked / (done - started),
            "processes": usage,
        }
    finally:
        await nc.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _spawn_consumer(
    n: int, url: str, folder: Path, sync_ack: bool, slots: int, batch: int
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        str(HERE / "floor_bench.py"),
        "--consume",
        url,
        str(folder / f"c{n}"),
        "sync" if sync_ack else "async",
        str(slots),
        str(batch),
    ]
    return spawn_logged(argv, folder / f"consumer-{n}.log")


async def flow_floor(
    jobs: int,
    consumers: int = 2,
    rate: float | None = None,
    timeout_s: float = TIMEOUT_S,
    slots: int = WORKER_SLOTS,
    batch: int = 1,
) -> dict[str, Any]:
    """The per-job floor: ``consumers`` processes, each with ``slots`` pull loops fetching
    ``batch`` at a time, pull and ack while this process publishes (paced at ``rate``/s
    if given). Never leaves a process behind."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-flow-"))
    server = await start_nats(folder)
    nc = await nats.connect(server.url)
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {
        "system": "nats-py",
        "jobs": jobs,
        "workers": consumers,
        "paced_per_s": rate,
        "ack": "ack_sync" if rate else "ack",
        "slots": slots,
        "fetch_batch": batch,
    }
    try:
        js = nc.jetstream()
        await _declare(js)
        procs = [
            _spawn_consumer(n, server.url, folder, bool(rate), slots, batch)
            for n in range(consumers)
        ]
        await _wait_files([folder / f"c{n}.ready" for n in range(consumers)], procs)
        pids: dict[str, int | None] = {
            "nats-server": server.process.pid if server.process else None,
            **{f"consumer-{n}": p.pid for n, p in enumerate(procs)},
            "bench (producer)": os.getpid(),
        }
        cpu0 = cpu_snapshot(pids)
        published_at = [0.0] * jobs
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def publish(n: int) -> None:
            async with gate:
                published_at[n] = time.monotonic()
                await js.publish(f"floor.demo.{n % 3}", str(n).encode())

        first = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        for n in range(jobs):
            if rate:
                await asyncio.sleep(max(0.0, first + n / rate - time.monotonic()))
            tasks.append(asyncio.create_task(publish(n)))
            if len(tasks) >= 4 * IN_FLIGHT:  # bound the tasks waiting at the gate
                await asyncio.gather(*tasks)
                tasks = []
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        result["submit_s"] = time.monotonic() - first
        deadline = first + timeout_s
        result["stop_reason"] = "all acked"
        while (await js.stream_info(STREAM)).state.messages > 0:
            if time.monotonic() > deadline:
                result["stop_reason"] = f"timeout after {timeout_s:.0f} s"
                break
            if any(p.poll() is not None for p in procs):
                result["stop_reason"] = "a consumer died"
                break
            await asyncio.sleep(0.02)
        result["processes"] = usage_since(pids, cpu0)
        acks = _stop_consumers(procs, folder)
        acked = {n: t for n, t in acks.items() if 0 <= n < jobs}
        last = max(acked.values()) if acked else time.monotonic()
        elapsed = last - first
        result.update(
            {
                "committed": len(acked),
                "lost": jobs - len(acked),
                "duplicates": sum(1 for _ in acks) - len(acked),
                "elapsed_s": elapsed,
                "jobs_per_s": len(acked) / elapsed if elapsed > 0 else 0.0,
                "latency": latency_summary(t - published_at[n] for n, t in acked.items()),
                "latency_label": "publish -> ack" + (" confirmed" if rate else " sent"),
            }
        )
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _stop_consumers(procs, folder)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10.0)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return result


async def _wait_files(paths: list[Path], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(p.exists() for p in paths):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a floor consumer exited during start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"floor consumers not ready after {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.02)


def _stop_consumers(procs: list[subprocess.Popen[bytes]], folder: Path) -> dict[int, float]:
    """SIGTERM the consumers (they write their ack times on the way out); the times."""
    stop_all(procs)
    acks: dict[int, float] = {}
    for n in range(len(procs)):
        path = folder / f"c{n}.acks"
        if path.exists():
            for line in path.read_text().splitlines():
                idx, t = line.split()
                acks[int(idx)] = float(t)
            path.unlink()
    return acks


async def consume(url: str, stem: Path, sync_ack: bool, slots: int, batch: int) -> None:
    """A floor consumer: ``slots`` pull loops (each its own subscription on the durable),
    each fetching up to ``batch`` messages and acking each, until SIGTERM; then write
    ``<stem>.acks`` (message index, monotonic ack time per line)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    subs = [await js.pull_subscribe_bind(DURABLE, stream=STREAM) for _ in range(slots)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    acks: list[tuple[bytes, float]] = []

    async def pull(sub: Any) -> None:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (NatsTimeoutError, TimeoutError):
                continue
            for msg in msgs:
                if sync_ack:
                    await msg.ack_sync()
                else:
                    await msg.ack()
                acks.append((msg.data, time.monotonic()))

    loops = [asyncio.create_task(pull(sub)) for sub in subs]
    stem.with_suffix(".ready").write_text("ready")
    await stop.wait()
    await asyncio.gather(*loops, return_exceptions=True)
    await nc.flush()
    await nc.close()
    stem.with_suffix(".acks").write_text("".join(f"{d.decode()} {t!r}\n" for d, t in acks))


def render(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, r in results.items():
        lat = r.get("latency") or {}
        rows.append(
            [
                name,
                r.get("jobs"),
                r.get("committed"),
                r.get("jobs_per_s"),
                lat.get("p50_ms"),
                lat.get("p99_ms"),
                r.get("error") or r.get("stop_reason", ""),
            ]
        )
    return fmt_table(["floor", "jobs", "acked", "jobs/s", "p50 ms", "p99 ms", "note"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="messages (default 5000)")
    parser.add_argument("--consumers", type=int, default=2, help="flow consumers (default 2)")
    parser.add_argument("--rate", type=float, default=None, help="pace the flow producer")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.consumers < 1:
        parser.error("--jobs and --consumers must be at least 1")
    results = {
        "batched": asyncio.run(batched_floor(args.jobs)),
        "flow": asyncio.run(flow_floor(args.jobs, args.consumers, args.rate)),
    }
    print(json.dumps(results, indent=2, default=str) if args.json else render(results))
    return 1 if any(r.get("error") or r.get("lost") for r in results.values()) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--consume"]:
        url, stem, sync = sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "sync"
        asyncio.run(consume(url, stem, sync, int(sys.argv[5]), int(sys.argv[6])))
        sys.exit(0)
    sys.exit(run_with_tree(main))
