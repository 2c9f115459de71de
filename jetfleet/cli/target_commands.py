"""``jetfleet target list|show|set|unset``: each target's rate, burst and daily budget in
force, changed at run time without a restart (docs/cli.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.js import JetStreamContext

from jetfleet.audit import record_action, record_raised
from jetfleet.cli.actor import actor, add_actor_arguments, why
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.ops.run_time_limits import (
    RATE_FORMS,
    LimitChange,
    clear_limits,
    operator_name,
    parse_rate,
    parse_whole,
    set_limits,
)
from jetfleet.ops.target_view import TargetListing, TargetView, target_listing
from jetfleet.schemas.targets import TargetLimits
from jetfleet.settings import Settings

_T = TypeVar("_T")

DESCRIPTION = """\
Each declared target's limits in force: the config file's, what `target set` changed at
run time, and a robots.txt Crawl-delay (which lowers the rate to 1 per delay). A change
reaches every ratelimit replica within a second (a KV watch on jf-targets); workers and
leasers need no restart. `unset` (or `set --clear`) puts the config file's values back.
"""


def register(commands: Any) -> None:
    """Add ``target`` to the parser."""
    parser = commands.add_parser(
        "target",
        help="show or change a target's rate, burst and daily budget at run time",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="target_action", required=True)
    listing = actions.add_parser("list", help="every declared target's limits and hold")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=_run_list)
    show = actions.add_parser("show", help="one target in detail, with where each value is from")
    show.add_argument("name", metavar="NAME", help="a declared target")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_run_show)
    change = actions.add_parser("set", help="change limits (merged with those already set)")
    change.add_argument("name", metavar="NAME", help="a declared target")
    change.add_argument("--rate", help=RATE_FORMS)
    change.add_argument("--burst", help="requests at once after an idle spell (whole, >= 1)")
    change.add_argument("--daily", help="requests per UTC day (whole, >= 0; 0: no budget)")
    change.add_argument("--reason", default="", help="why (recorded with the change)")
    change.add_argument(
        "--set-by", metavar="WHO", default=None, help="who (default: user@host of this shell)"
    )
    change.add_argument(
        "--clear", action="store_true", help="remove every run-time value (as `unset`)"
    )
    change.add_argument("--json", action="store_true", help="print the record as JSON")
    add_actor_arguments(change)
    change.set_defaults(run=_run_set)
    unset = actions.add_parser("unset", help="remove run-time values: the config file applies")
    unset.add_argument("name", metavar="NAME", help="a declared target")
    unset.add_argument("--json", action="store_true", help="print JSON")
    add_actor_arguments(unset)
    unset.set_defaults(run=_run_unset, clear=True)


def _settings(args: argparse.Namespace) -> Settings:
    from jetfleet.cli.main import settings_from

    return settings_from(args)


def change_from(args: argparse.Namespace) -> LimitChange:
    """The change ``set``'s options ask for, validated (JetfleetError says what to fix)."""
    return LimitChange(
        rate=None if args.rate is None else parse_rate(args.rate),
        burst=None
        if args.burst is None
        else parse_whole(args.burst, "--burst", 1, "a whole number >= 1"),
        daily=None
        if args.daily is None
        else parse_whole(args.daily, "--daily", 0, "a whole number >= 0 (0: no daily budget)"),
        reason=why(args) or args.reason,
        set_by=args.actor or (args.set_by if args.set_by is not None else operator_name()),
    )


def _run_list(args: argparse.Namespace) -> int:
    listing = asyncio.run(_listing(_settings(args), None))
    if args.json:
        print_json(listing)
        return 0
    print_table(
        ["target", "rate", "burst", "daily", "crawl-delay", "held", "set by"],
        [_row(view) for view in listing.targets],
    )
    _warn_redis(listing)
    return 0


def _run_show(args: argparse.Namespace) -> int:
    settings = _settings(args)
    settings.target(args.name)
    listing = asyncio.run(_listing(settings, args.name))
    if args.json:
        print_json(listing.targets[0])
        return 0
    for label, text in _detail(listing.targets[0]):
        print(f"{label:<12} {text}")
    _warn_redis(listing)
    return 0


def _run_set(args: argparse.Namespace) -> int:
    if args.clear:
        if args.rate or args.burst or args.daily:
            raise JetfleetError("give --clear alone, or --rate/--burst/--daily without it")
        return _run_unset(args)
    settings = _settings(args)
    change = change_from(args)

    async def change_and_record(js: JetStreamContext) -> TargetLimits:
        asked = ", ".join(
            f"{name} {value}"
            for name, value in (("rate", args.rate), ("burst", args.burst), ("daily", args.daily))
            if value is not None
        )
        what = f"target {args.name}: {asked or 'no change'}"
        try:
            record = await set_limits(js, settings, args.name, change)
        except Exception as exc:  # refused or failed: recorded too (docs/audit.md)
            await record_raised(js, "target.set", change.set_by, what, change.reason, exc)
            raise
        await record_action(js, "target.set", change.set_by, what, change.reason)
        return record

    record = asyncio.run(_with_js(settings, change_and_record))
    if args.json:
        print_json(record)
        return 0
    values = [f"rate {_rate(record.rate)}"] if record.rate is not None else []
    values += [
        f"{name} {value}"
        for name, value in (("burst", record.burst), ("daily", record.daily))
        if value is not None
    ]
    print(f"{args.name}: {', '.join(values)} at run time (set by {record.set_by or '-'})")
    print("every ratelimit replica applies it within a second; `jetfleet target show` to check")
    return 0


def _run_unset(args: argparse.Namespace) -> int:
    settings = _settings(args)

    async def clear_and_record(js: JetStreamContext) -> bool:
        try:
            removed = await clear_limits(js, settings, args.name)
        except Exception as exc:  # refused or failed: recorded too (docs/audit.md)
            what = f"target {args.name}"
            await record_raised(js, "target.unset", actor(args), what, why(args), exc)
            raise
        detail = "run-time limits removed" if removed else "had no run-time limits"
        await record_action(
            js, "target.unset", actor(args), f"target {args.name}", why(args), detail
        )
        return removed

    removed = asyncio.run(_with_js(settings, clear_and_record))
    if args.json:
        print_json({"target": args.name, "removed": removed})
    elif removed:
        print(f"{args.name}: run-time limits removed; the config file's apply")
    else:
        print(f"{args.name}: had no run-time limits; the config file's apply")
    return 0


async def _listing(settings: Settings, only: str | None) -> TargetListing:
    return await _with_js(settings, lambda js: target_listing(js, settings, only))


async def _with_js(settings: Settings, call: Callable[[JetStreamContext], Awaitable[_T]]) -> _T:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        return await call(nc.jetstream())
    finally:
        await nc.close()


def _with_source(text: str, source: str) -> str:
    return text if source == "config" else f"{text} ({source})"


def _rate(rate: float) -> str:
    return f"{rate:g}/s"


def _daily(daily: float) -> str:
    return f"{daily:g}" if daily else "none"


def _row(view: TargetView) -> list[object]:
    return [
        view.target,
        _with_source(_rate(view.rate), view.rate_from),
        _with_source(str(view.burst), view.burst_from),
        _with_source(str(view.daily or "-"), view.daily_from),
        f"{view.crawl_delay_s:g} s" if view.crawl_delay_s else "-",
        f"{view.held_s:.1f} s" if view.held_s else "-",
        view.run_time.set_by if view.run_time and view.run_time.set_by else "-",
    ]


def _detail(view: TargetView) -> list[tuple[str, str]]:
    config = view.config

    def source(where: str, config_text: str) -> str:
        return f"from {where}" + (f" (config {config_text})" if where != "config" else "")

    lines = [
        ("target", view.target),
        ("rate", f"{_rate(view.rate)}  {source(view.rate_from, _rate(config['rate']))}"),
        ("burst", f"{view.burst}  {source(view.burst_from, str(int(config['burst'])))}"),
        ("daily", f"{view.daily or 'none'}  {source(view.daily_from, _daily(config['daily']))}"),
        (
            "crawl-delay",
            f"{view.crawl_delay_s:g} s from robots.txt" if view.crawl_delay_s else "none",
        ),
        ("held", f"{view.held_s:.1f} s left" if view.held_s else "no"),
        (
            "in flight",
            f"{'?' if view.in_flight is None else view.in_flight} of max_in_flight "
            f"{view.max_in_flight}",
        ),
    ]
    if view.run_time is not None:
        who = view.run_time.set_by or "-"
        lines.append(("set by", f"{who}: {view.run_time.reason}" if view.run_time.reason else who))
    return lines


def _warn_redis(listing: TargetListing) -> None:
    if listing.redis != "ok":
        print(f"warning: {listing.redis}", file=sys.stderr)
