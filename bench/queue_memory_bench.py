"""Memory of each service as the queue grows to 1,000,000 jobs, with no worker.

    python bench/queue_memory_bench.py [--jobs 1000000] [--budget-s 900] [--in-flight 1024]
                                       [--marks 100000,250000,500000,1000000] [--settle-s 130]

A DevStack with ``workers=0`` (nats-server, redis-server, scheduler, leaser, sink,
gateway). The bench publishes N small ``noop`` jobs to ``jf.submit.demo`` itself
(``js.publish`` with ``Nats-Msg-Id: sub-<job id>``, as ``jetfleet.client`` does, with
``--in-flight`` publishes awaiting their ack at once) while the scheduler admits them
into ``JF_WORK``. A separate probe process (this file with ``--probe``) reads
``fleet_status`` every 2 s and reports the counts (``queued`` is what ``jetfleet status``
shows) and how long the call took; on each report the bench reads the RSS of every
process (psutil). The samples where ``queued`` is first 0 (before the submit) and first
reaches each mark are kept.

At the end (everything queued, or the time budget spent) it times, 3 times each:
``fleet_status`` in this process, ``GET /v1/status`` on the gateway, and the command
``jetfleet status`` (a new Python process: its start-up is included), and the same at 0
queued for comparison. Then it keeps sampling, idle, for ``--settle-s`` (JetStream's
duplicate window here is 120 s: the Nats-Msg-Ids it remembers expire within it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
from harness import fmt_table, run_with_tree, stop_stack  # noqa: E402
from jetfleet.schemas import Job  # noqa: E402
from jetfleet_bench import _wait_ready  # noqa: E402
from stats import folder_bytes, process_usage  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev.devstack import DevStack  # noqa: E402
from jetfleet.dev.embedded import die_with_parent  # noqa: E402
from jetfleet.ops.status import fleet_status  # noqa: E402
from jetfleet.publish import publish_durably  # noqa: E402
from jetfleet.settings import load_settings  # noqa: E402

TARGET = "demo"
SAMPLE_EVERY_S = 2.0
_encoder = msgspec.json.Encoder()


def _rss(pids: dict[str, int | None]) -> dict[str, float | None]:
    return {k: (process_usage(v) or {}).get("rss_mib") for k, v in pids.items()}


def _cpu(pids: dict[str, int | None]) -> dict[str, float | None]:
    return {k: (process_usage(v) or {}).get("cpu_s") for k, v in pids.items()}


def _du_mib(path: Path) -> float:
    return folder_bytes(path) / 2**20


async def _time_status(stack: DevStack, js: Any, settings: Any, tries: int = 3) -> dict[str, Any]:
    """Wall time (ms) of fleet_status in-process, GET /v1/status, and `jetfleet status`."""
    out: dict[str, Any] = {"inproc_ms": [], "gateway_ms": [], "cli_ms": [], "cli_rc": []}
    for _ in range(tries):
        t0 = time.perf_counter()
        status = await asyncio.wait_for(fleet_status(js, settings), 60.0)
        out["inproc_ms"].append(1000.0 * (time.perf_counter() - t0))
        out["queued"] = status.totals.queued
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(tries):
            t0 = time.perf_counter()
            async with session.get(f"{stack.gateway_url}/v1/status") as resp:
                body = await resp.read()
                out["gateway_status"] = resp.status
            out["gateway_ms"].append(1000.0 * (time.perf_counter() - t0))
            out["gateway_queued"] = json.loads(body)["totals"]["queued"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETFLEET_")}
    env["JETFLEET_CONFIG"] = str(stack.config_path)
    for _ in range(tries):
        t0 = time.perf_counter()
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "jetfleet", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        out["cli_ms"].append(1000.0 * (time.perf_counter() - t0))
        out["cli_rc"].append(proc.returncode)
        out["cli_output"] = proc.stdout.strip().splitlines()[-1:]
        out["cli_stderr"] = proc.stderr.strip().splitlines()[-2:]
    return out


async def run(
    jobs: int, budget_s: float, in_flight: int, marks: list[int], settle_s: float, keep: bool
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-queue-"))
    stack = DevStack(folder, workers=0)
    result: dict[str, Any] = {
        "jobs": jobs,
        "budget_s": budget_s,
        "in_flight": in_flight,
        "marks": marks,
    }
    nc = None
    lanes: list[asyncio.Task[None]] = []
    probe_box: list[asyncio.subprocess.Process] = []
    try:
        await asyncio.wait_for(stack.start(), 120.0)
        result["ready_s"] = await _wait_ready(stack, 60.0)
        assert stack.settings is not None
        settings = stack.settings
        nc = await connect_nats(settings.nats, "bench-queue")
        js = nc.jetstream()
        pids: dict[str, int | None] = {n: p.pid for n, p in stack.children.items()}
        result["services"] = list(stack.children)  # workers=0: every child is a service
        pids["nats-server"] = stack.nats.process.pid if stack.nats.process else None
        pids["redis-server"] = stack.redis.process.pid if stack.redis.process else None
        pids["bench (submitter)"] = os.getpid()

        result["status_timing_at_0"] = await _time_status(stack, js, settings)
        samples: list[dict[str, Any]] = []
        mark_samples: dict[str, dict[str, Any]] = {}

        base = settings.target(TARGET).base_url.rstrip("/")
        subject = subjects.submit(TARGET)
        published = 0
        failed: list[str] = []
        next_n = 0
        last_ack = 0.0

        async def lane() -> None:
            nonlocal published, next_n, last_ack
            while next_n < jobs:
                n = next_n
                next_n += 1
                job_id = f"q{n:08d}"
                payload = _encoder.encode(Job(id=job_id, url=f"{base}/page/{n}", handler="noop"))
                try:
                    await publish_durably(js, subject, payload, msg_id=f"sub-{job_id}")
                    published += 1
                    last_ack = time.monotonic()
                except Exception as exc:  # counted, not fatal
                    if len(failed) < 5:
                        failed.append(f"{type(exc).__name__}: {exc}")
                    else:
                        failed.append("")

        # fleet_status is read by a separate probe process, so its timing is not
        # slowed down by this process's event loop, busy with the publishes.
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / "queue_memory_bench.py"),
            "--probe",
            str(stack.config_path),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        probe_box.append(probe)

        async def sample(label: str | None, t0: float) -> dict[str, Any]:
            assert probe.stdout is not None
            line = await asyncio.wait_for(probe.stdout.readline(), 90.0)
            if not line:
                raise RuntimeError("the status probe exited")
            status = json.loads(line)
            s = {
                "t_s": time.monotonic() - t0,
                "published": published,
                "queued": status["queued"],
                "admitting": status["admitting"],
                "submitted": status["submitted"],
                "rejected": status["rejected"],
                "status_ms": status["status_ms"],
                "rss_mib": _rss(pids),
            }
            if label:
                s["label"] = label
            return s

        t0 = time.monotonic()
        s0 = await sample("0", t0)
        s0["cpu_s"] = _cpu(pids)
        mark_samples["0"] = s0
        samples.append(s0)
        first_submit = time.monotonic()
        lanes = [asyncio.create_task(lane()) for _ in range(in_flight)]
        submit_done_at: float | None = None
        deadline = first_submit + budget_s
        stop_reason = f"{jobs} queued"
        pending_marks = sorted(m for m in marks if m > 0)
        while True:
            if submit_done_at is None and all(t.done() for t in lanes):
                submit_done_at = time.monotonic()
            s = await sample(None, t0)
            samples.append(s)
            while pending_marks and s["queued"] >= pending_marks[0]:
                m = pending_marks.pop(0)
                s = dict(s, label=str(m), cpu_s=_cpu(pids))
                mark_samples[str(m)] = s
            if s["queued"] >= jobs or (
                submit_done_at and s["admitting"] == 0 and s["queued"] + s["rejected"] >= published
            ):
                if s["queued"] < jobs:
                    stop_reason = f"everything published was admitted ({s['queued']} queued)"
                break
            if time.monotonic() > deadline:
                stop_reason = f"time budget of {budget_s:.0f} s spent"
                break
            if stack.dead_children():
                stop_reason = "a child died: " + stack.describe_dead_children()
                break
        end = time.monotonic()
        for t in lanes:
            t.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        final = await sample("end", t0)
        final["cpu_s"] = _cpu(pids)
        samples.append(final)
        mark_samples["end"] = final
        result["stop_reason"] = stop_reason
        result["published"] = published
        result["publish_failures"] = len(failed)
        result["publish_failure_examples"] = [f for f in failed if f][:5]
        # The last publish ack, when every lane finished; else the end of the wait.
        sub_s = (last_ack if submit_done_at else end) - first_submit
        result["submit_s"] = sub_s
        result["submit_per_s"] = published / sub_s if sub_s > 0 else 0.0
        result["admit_s"] = end - first_submit
        result["queued_at_end"] = final["queued"]
        result["admit_per_s"] = final["queued"] / (end - first_submit)
        result["samples"] = samples
        result["marks_reached"] = mark_samples
        result["status_timing_at_end"] = await _time_status(stack, js, settings)
        streams = {}
        for name in (subjects.STREAM_SUBMIT, subjects.STREAM_WORK):
            info = await js.stream_info(name)
            streams[name] = {"messages": info.state.messages, "mib": info.state.bytes / 2**20}
        result["streams"] = streams
        result["nats_store_mib"] = _du_mib(folder / "nats")
        # Idle with everything queued: does anything shrink back?
        settle_end = time.monotonic() + settle_s
        while time.monotonic() < settle_end:
            samples.append(await sample(None, t0))
        if settle_s > 0:
            settled = await sample(f"end + {settle_s:.0f} s idle", t0)
            settled["cpu_s"] = _cpu(pids)
            samples.append(settled)
            mark_samples["settled"] = settled
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in lanes:
            t.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        for probe in probe_box:
            if probe.returncode is None:
                probe.terminate()
                try:
                    await asyncio.wait_for(probe.wait(), 10.0)
                except TimeoutError:
                    probe.kill()
                    await probe.wait()
        # Logs are scanned after the stop, so errors logged while draining count too.
        await stop_stack(stack, nc, folder, keep, result)
    return result


SERVICE_LIMIT_MB = 150.0
STATUS_LIMIT_MS = 1000.0
_MB = 1.048576  # MB per MiB


def memory_summary(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's memory target read off a run: each jetfleet service's RSS (MB) at
    every mark, its growth from the first mark above 0 to the last, the slowest status
    read, and whether every service stayed under 150 MB and status under a second."""
    services = r.get("services") or []
    marks = {k: v for k, v in (r.get("marks_reached") or {}).items() if k.isdigit() and k != "0"}
    rss = {
        label: {name: (mib or 0.0) * _MB for name, mib in s["rss_mib"].items()}
        for label, s in marks.items()
    }
    first, last = (next(iter(rss.values())), list(rss.values())[-1]) if rss else ({}, {})
    end = r.get("status_timing_at_end") or {}
    status_ms = [s["status_ms"] for s in r.get("samples") or []] + list(end.get("inproc_ms", []))
    gateway_ms = list(end.get("gateway_ms", []))
    largest = max((v for m in rss.values() for k, v in m.items() if k in services), default=None)
    slowest = max(status_ms + gateway_ms, default=None)
    return {
        "rss_mb_at_mark": rss,
        "growth_mb": {k: last.get(k, 0.0) - first.get(k, 0.0) for k in services if k in first},
        "largest_service_mb": largest,
        "slowest_status_ms": slowest,
        "cli_status_ms": end.get("cli_ms"),
        "queued_at_end": r.get("queued_at_end"),
        "ok": largest is not None
        and largest < SERVICE_LIMIT_MB
        and slowest is not None
        and slowest < STATUS_LIMIT_MS
        and not r.get("error"),
    }


def render(r: dict[str, Any]) -> str:
    out = []
    marks = r.get("marks_reached") or {}
    procs = list((next(iter(marks.values()))["rss_mib"] if marks else {}).keys())
    header = ["queued (mark)", "t s", "published", "queued", "admitting", "status ms", *procs]
    rows = []
    for label, s in marks.items():
        rows.append(
            [
                label,
                s["t_s"],
                s["published"],
                s["queued"],
                s["admitting"],
                s["status_ms"],
                *(s["rss_mib"].get(p) for p in procs),
            ]
        )
    out.append("RSS MiB at each mark:")
    out.append(fmt_table(header, rows))
    out.append("")
    for key in (
        "stop_reason",
        "published",
        "publish_failures",
        "submit_s",
        "submit_per_s",
        "admit_s",
        "admit_per_s",
        "queued_at_end",
        "streams",
        "nats_store_mib",
    ):
        out.append(f"{key}: {r.get(key)}")
    for key in ("status_timing_at_0", "status_timing_at_end"):
        t = r.get(key) or {}
        out.append(
            f"{key}: queued {t.get('queued')}, in-process fleet_status ms "
            f"{[round(x, 1) for x in t.get('inproc_ms', [])]}, GET /v1/status ms "
            f"{[round(x, 1) for x in t.get('gateway_ms', [])]} (HTTP {t.get('gateway_status')}), "
            f"`jetfleet status` ms {[round(x) for x in t.get('cli_ms', [])]} rc {t.get('cli_rc')}"
        )
    if marks:
        first, last = marks.get("0"), marks.get("end")
        if first and last and first.get("cpu_s") and last.get("cpu_s"):
            out.append(
                "CPU s used 0 -> end: "
                + ", ".join(
                    f"{k} {(last['cpu_s'][k] or 0) - (first['cpu_s'][k] or 0):.1f}"
                    for k in first["cpu_s"]
                )
            )
    series = r.get("samples") or []
    if series:
        step = max(1, len(series) // 40)
        out.append("samples (t s: queued, nats-server RSS MiB, status ms):")
        out.append(
            "  "
            + "; ".join(
                f"{x['t_s']:.0f}: {x['queued']}, {x['rss_mib'].get('nats-server') or 0:.0f}, "
                f"{x['status_ms']:.0f}"
                for x in [*series[::step], series[-1]]
            )
        )
    problems = r.get("log_problems") or {}
    out.append(f"log problem lines: {sum(v['count'] for v in problems.values())} {problems or ''}")
    if r.get("error"):
        out.append(f"ERROR {r['error']}")
    return "\n".join(out)


async def probe(config: Path) -> None:
    """The status probe: every SAMPLE_EVERY_S, one JSON line with the counts and how long
    ``fleet_status`` took (run as a child by the bench)."""
    settings = load_settings(config, {})
    nc = await connect_nats(settings.nats, "bench-queue-probe")
    js = nc.jetstream()
    try:
        while True:
            started = time.perf_counter()
            status = await asyncio.wait_for(fleet_status(js, settings), 60.0)
            took = time.perf_counter() - started
            line = {
                "queued": status.totals.queued,
                "admitting": status.admitting,
                "submitted": status.totals.submitted,
                "rejected": status.totals.rejected,
                "status_ms": 1000.0 * took,
            }
            print(json.dumps(line), flush=True)
            await asyncio.sleep(max(0.0, SAMPLE_EVERY_S - took))
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--probe":
        with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
            asyncio.run(probe(Path(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--budget-s", type=float, default=900.0, help="submit+admit time budget")
    parser.add_argument("--in-flight", type=int, default=1024, help="publishes awaiting acks")
    parser.add_argument("--marks", default="100000,250000,500000,1000000")
    parser.add_argument("--settle-s", type=float, default=300.0, help="idle sampling at the end")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    marks = [int(x) for x in args.marks.split(",") if x.strip()]
    result = asyncio.run(
        run(args.jobs, args.budget_s, args.in_flight, marks, args.settle_s, args.keep)
    )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str) if args.json else render(result))
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main() if sys.argv[1:2] == ["--probe"] else run_with_tree(main))
