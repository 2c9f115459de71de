"""Commands that read or write the fleet's data: submit, status, results, schemas,
topology."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from jetfleet import subjects, tracing
from jetfleet.auth.credentials import declares_topology
from jetfleet.cli.progress import ProgressBar, print_json, print_table
from jetfleet.cli.quarantine_commands import print_quarantines
from jetfleet.client import new_job_id, submit_raw
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.ops.breaker_status import breaker_lines
from jetfleet.ops.pause_status import pause_lines
from jetfleet.ops.status import CONFIRM_GAP_S, FIELDS, FleetStatus, confirmed_status
from jetfleet.results import iter_results, with_stored_body
from jetfleet.settings import Settings
from jetfleet.topology import declare
from jetfleet.work_lanes import LaneMap

MAX_QUARANTINES_SHOWN = 50
CLI_SERVICE_NAME = "jetfleet-cli"
"""The ``service.name`` of ``jetfleet submit``'s spans (each job's root span)."""
"""Rows of quarantines and of proposals ``jetfleet status`` prints (``--json``: all)."""


def register(commands: Any) -> None:
    """Add submit, status, results, schemas and topology to the parser."""
    submit = commands.add_parser(
        "submit",
        help="submit jobs for a target",
        description="Submit one job per URL (or path under the target's base_url). "
        "Refused jobs are reported at once and kept on jf.rejected with the reason.",
    )
    submit.add_argument("target", help="a declared target")
    submit.add_argument("urls", nargs="*", metavar="URL_OR_PATH")
    submit.add_argument(
        "--file",
        type=Path,
        help="read URLs or paths from FILE, one a line "
        "('-' for stdin; blank lines and # comments skipped)",
    )
    submit.add_argument("--handler", default="http.get", help="handler name (default http.get)")
    submit.add_argument("--tier", default="normal", choices=("high", "normal", "bulk"))
    submit.add_argument("--store-body", action="store_true", help="keep response bodies")
    submit.add_argument(
        "--pin-identity",
        default="",
        metavar="IDENTITY",
        help="only the worker owning IDENTITY may run the jobs",
    )
    submit.add_argument(
        "--pin-region",
        default="",
        metavar="REGION",
        help="only workers of REGION (worker.region) may run the jobs; one nobody serves "
        "ends dead-lettered no-eligible-worker",
    )
    submit.add_argument("--json", action="store_true", help="print job ids and refusals as JSON")
    submit.set_defaults(run=_run_submit)

    status = commands.add_parser(
        "status",
        help="per-target counts from durable state",
        description="submitted, queued, leased, committed, dead, rejected per target and in "
        "total, read from the streams and consumers (not from any service's memory); then "
        "the rate limiter's health (ok, or failing-closed while its Redis does not answer), "
        "the targets held fleet-wide with the seconds left (at most 50 listed), and the "
        "quarantines in force and egress proposals (second-order retirements counted; at "
        "most 50 of each listed).",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_run_status)

    results = commands.add_parser("results", help="committed results")
    results_cmds = results.add_subparsers(dest="results_command", required=True)
    export = results_cmds.add_parser("export", help="write committed results as JSONL to stdout")
    export.add_argument("--target", default=None, help="only this target")
    export.add_argument(
        "--bodies",
        action="store_true",
        help="put bodies kept in the object store (too large for a message) back inline",
    )
    export.set_defaults(run=_run_results_export)

    schemas = commands.add_parser("schemas", help="the wire contract's generated documents")
    schema_cmds = schemas.add_subparsers(dest="schemas_command", required=True)
    s_export = schema_cmds.add_parser("export", help="write JSON Schema + AsyncAPI files")
    s_export.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder (default: the schemas/ folder of this checkout)",
    )
    s_export.set_defaults(run=_run_schemas_export)
    s_check = schema_cmds.add_parser("check", help="fail if the generated files are stale")
    s_check.add_argument("--out", type=Path, default=None, help="folder to check")
    s_check.set_defaults(run=_run_schemas_check)

    topology = commands.add_parser(
        "topology",
        help="streams, consumers and buckets",
        description="show: create what is missing and list settings that drifted; apply: "
        "also change drifted ones to the declared settings; lanes: which work consumers "
        "carry which targets (from the configuration alone, no server needed).",
    )
    topology.add_argument("action", choices=("show", "apply", "lanes"))
    topology.add_argument("--json", action="store_true", help="lanes: print JSON")
    topology.set_defaults(run=_run_topology)


def _settings(args: argparse.Namespace) -> Settings:
    from jetfleet.cli.main import settings_from

    return settings_from(args)


def _read_urls(args: argparse.Namespace) -> list[str]:
    urls = list(args.urls)
    if args.file is not None:
        stream = sys.stdin if str(args.file) == "-" else args.file.open()
        with stream:
            urls += [ln.strip() for ln in stream if ln.strip() and not ln.startswith("#")]
    if not urls:
        raise JetfleetError("nothing to submit: give URLs or paths, or --file FILE")
    return urls


def _run_submit(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not subjects.TARGET_NAME_RE.match(args.target):
        raise JetfleetError(
            f"target name {args.target!r} is not valid (invalid-subject): use lowercase "
            "letters, digits, '-' or '_' (at most 64)"
        )
    # Each job goes out as the JSON any client would send, even one that is not a valid
    # Job (an empty URL, say): the scheduler refuses it with the same reason as anywhere.
    urls = _read_urls(args)
    ids = [new_job_id() for _ in urls]
    # Pins only when given: the JSON stays what any client sends without them.
    pins = {
        name: value
        for name, value in (("pin_identity", args.pin_identity), ("pin_region", args.pin_region))
        if value
    }
    payloads = [
        msgspec.json.encode(
            {
                "id": job_id,
                "url": url,
                "handler": args.handler,
                "tier": args.tier,
                "store_body": args.store_body,
                **pins,
            }
        )
        for job_id, url in zip(ids, urls, strict=True)
    ]
    with tracing.traced_process(CLI_SERVICE_NAME, os.environ):
        return asyncio.run(_submit(settings, args, ids, payloads))


async def _submit(
    settings: Settings, args: argparse.Namespace, ids: list[str], payloads: list[bytes]
) -> int:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        js = nc.jetstream()
        if declares_topology(settings):
            await declare(js, settings)
        bar = ProgressBar(len(ids), "submitting", enabled=None if len(ids) > 100 else False)
        results = await submit_raw(js, settings, args.target, payloads, ids, progress=bar.update)
        bar.close()
    finally:
        await nc.close()
    refused = [r for r in results if r.rejection is not None]
    if args.json:
        print_json(
            {
                "submitted": [r.job_id for r in results],
                "rejected": [
                    {
                        "job_id": r.job_id,
                        "reason": r.rejection.reason,
                        "message": r.rejection.message,
                    }
                    for r in refused
                    if r.rejection is not None
                ],
            }
        )
    else:
        print(f"submitted {len(results)} job(s) to {args.target}")
        for r in refused:
            assert r.rejection is not None
            print(
                f"rejected {r.job_id}: {r.rejection.reason}: {r.rejection.message}", file=sys.stderr
            )
    return 1 if refused else 0


def _run_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    return asyncio.run(_status(settings, args.json))


async def _status(settings: Settings, as_json: bool) -> int:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        status = await confirmed_status(nc.jetstream(), settings)
    finally:
        await nc.close()
    if as_json:
        print_json(status)
        return 0
    rows = [[name, *(getattr(c, f) for f in FIELDS)] for name, c in status.targets.items()]
    rows.append(["TOTAL", *(getattr(status.totals, f) for f in FIELDS)])
    print_table(["target", *FIELDS], rows)
    if status.admitting:
        print(f"\n{status.admitting} submission(s) awaiting admission")
    _print_limiter(status)
    if status.quarantines or status.proposals:
        print()
        print_quarantines(status.quarantines, status.proposals, most=MAX_QUARANTINES_SHOWN)
    for n, line in enumerate(breaker_lines(status.breakers)):
        print(f"\n{line}" if n == 0 else line)
    for n, line in enumerate(pause_lines(status.pauses)):
        print(f"\n{line}" if n == 0 else line)
    if not status.conserved:
        # Read again already; a difference that lasts while jobs flow fast can still be
        # jobs in motion, so say how to tell.
        print(
            f"\nWARNING: submitted != queued + leased + committed + dead + rejected + "
            f"admitting in each of {status.reads} reads over "
            f"{(status.reads - 1) * CONFIRM_GAP_S:g} s (last off by {status.unaccounted:+d}). "
            "While jobs flow, a few may be between states; once the fleet is idle, a "
            "difference means a job is missing or counted twice",
            file=sys.stderr,
        )
    return 0


def _print_limiter(status: FleetStatus) -> None:
    if status.rate_limiter == "ok":
        print("\nrate limiter: ok")
    else:
        print(f"\nrate limiter: {status.rate_limiter}: {status.rate_limiter_detail}")
    if not status.held:
        return
    print(f"held targets: {status.held} (nothing is sent to them until the hold ends)")
    width = max(len(hold.target) for hold in status.holds) if status.holds else 0
    for hold in status.holds:
        print(f"  {hold.target:<{width}}  {hold.seconds_left:.1f} s left")
    if status.held > len(status.holds):
        print(f"  ... and {status.held - len(status.holds)} more (shortest holds not listed)")


def _run_results_export(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.target is not None:
        settings.target(args.target)
    return asyncio.run(_results_export(settings, args.target, args.bodies))


async def _results_export(settings: Settings, target: str | None, bodies: bool) -> int:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    js = nc.jetstream()
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    missing = 0
    try:
        async for record in iter_results(js, target):
            if bodies:
                try:
                    record = await with_stored_body(js, record)
                except JetfleetError as exc:
                    # Written without its body (its reference stays), never left out.
                    missing += 1
                    print(f"jetfleet: result of job {record.job_id}: {exc}", file=sys.stderr)
            out.write(encoder.encode(record) + b"\n")
    finally:
        await nc.close()
        out.flush()
    return 1 if missing else 0


def _run_schemas_export(args: argparse.Namespace) -> int:
    from jetfleet.ops.schema_export import default_dir, export

    written = export(args.out or default_dir())
    print(f"wrote {len(written)} file(s) to {args.out or default_dir()}")
    return 0


def _run_schemas_check(args: argparse.Namespace) -> int:
    from jetfleet.ops.schema_export import check, default_dir

    problems = check(args.out or default_dir())
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("schemas are current")
    return 1 if problems else 0


def _run_topology(args: argparse.Namespace) -> int:
    if args.action == "lanes":
        return _print_lanes(_settings(args), args.json)
    from jetfleet.cli.main import settings_from

    # Declaring streams is the admin role's (docs/security.md): its credentials file,
    # not the operator's, is the one a production `topology apply` is given.
    settings = settings_from(args, "admin")
    return asyncio.run(_topology(settings, args.action == "apply"))


def _print_lanes(settings: Settings, as_json: bool) -> int:
    lanes = LaneMap(settings).lanes
    if as_json:
        rows = [
            {
                "lane": lane.name,
                "shared": lane.shared,
                "targets": list(lane.targets),
                "consumers": [lane.consumer(t) for t in subjects.TIERS],
                "max_ack_pending": lane.max_in_flight,
            }
            for lane in lanes
        ]
        print(json.dumps(rows, indent=2))
        return 0
    for lane in lanes:
        if lane.shared:
            what = f"partition of {len(lane.targets)} (caps by the leaser): "
            what += ", ".join(lane.targets)
        else:
            what = f"own lane, max_in_flight {lane.max_in_flight} per tier"
        print(f"{lane.name:<20} work-{lane.name}-{{high,normal,bulk}}  {what}")
    return 0


async def _topology(settings: Settings, update: bool) -> int:
    # Creating and changing streams is administration: only the admin role may.
    nc = await connect_nats(settings.nats, "jetfleet-topology", role="admin")
    try:
        drifts = await declare(nc.jetstream(), settings, update=update)
    finally:
        await nc.close()
    for drift in drifts:
        print(f"{'updated' if update else 'drift'}: {drift}")
    if not drifts:
        print("topology matches the configuration")
    return 0
