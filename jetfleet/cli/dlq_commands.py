"""``jetfleet dlq list|show|replay|purge``: the dead letters on ``jf.dlq.<target>``.

See docs/dead-letters.md for what makes a dead letter and what a replay does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.js import JetStreamContext

from jetfleet.audit import record_action, record_raised
from jetfleet.cli.actor import actor, add_actor_arguments, why
from jetfleet.cli.progress import ProgressBar, print_json, print_table, progress_wanted
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.ops.dead_letters import (
    DeadLetterEntry,
    dead_letter_total,
    get_dead_letter,
    list_dead_letters,
    purge,
    replay,
)
from jetfleet.schemas import AttemptRecord
from jetfleet.settings import Settings

CONFIRM_WORD = "purge"
T = TypeVar("T")


def register(commands: Any) -> None:
    """Add ``dlq`` (list, show, replay, purge) to the parser."""
    parser = commands.add_parser(
        "dlq",
        help="list, inspect, replay or purge dead letters",
        description="Dead letters are jobs that will not be retried: a permanent failure "
        "(at once), a retryable one whose attempts ran out, a job past its max age "
        "(expired), or one the max_deliver backstop ended (no-eligible-worker, "
        "deliveries-exhausted). Each keeps the original job, the reason and every attempt. "
        "Ids are JF_DLQ stream sequences.",
    )
    actions = parser.add_subparsers(dest="dlq_action", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list",
        help="list dead letters",
        description="List dead letters, oldest first.",
    )
    listing.add_argument("--target", default=None, help="only this target's letters")
    listing.add_argument(
        "--reason",
        default=None,
        help="only letters with this reason (or with it before a ':', e.g. 'http-404')",
    )
    listing.add_argument(
        "--json", action="store_true", help="print a JSON list, with every attempt"
    )
    listing.set_defaults(run=_run_list)

    show = actions.add_parser(
        "show",
        help="show one dead letter in full",
        description="Show one dead letter: the job, its work order, the reason, the "
        "detail and each attempt (worker, identity, fence, duration, outcome).",
    )
    show.add_argument("id", type=int, metavar="ID", help="the dead letter's id")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=_run_show)

    again = actions.add_parser(
        "replay",
        help="submit dead-lettered jobs again",
        description="Submit each letter's original job again under a new id "
        "(<job id>.r<letter id>), with a fresh attempt budget and the SAME idempotency "
        "key: work committed meanwhile is not done again. Replaying a letter twice "
        "submits it once. Give exactly one of ID or --target.",
    )
    again.add_argument("id", type=int, nargs="?", metavar="ID", help="one dead letter's id")
    again.add_argument("--target", default=None, help="every letter of this target")
    again.add_argument(
        "--reason", default=None, help="with --target: only letters with this reason"
    )
    again.add_argument("--json", action="store_true", help="print the new job ids as JSON")
    add_actor_arguments(again)
    again.set_defaults(run=_run_replay)

    removal = actions.add_parser(
        "purge",
        help="remove dead letters for good",
        description="Remove every dead letter (or one target's). Asks you to type "
        f"'{CONFIRM_WORD}' unless --yes; without a terminal it refuses unless --yes. "
        "The number removed is recorded per target (jf-control purged.dlq.<target>) so "
        "the fleet's counts still add up.",
    )
    removal.add_argument("--target", default=None, help="only this target's letters")
    removal.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    removal.add_argument(
        "--json", action="store_true", help='print {"removed": N, "target": ...} as JSON'
    )
    add_actor_arguments(removal)
    removal.set_defaults(run=_run_purge)


# --- shaping output --------------------------------------------------------------------


def attempt_json(record: AttemptRecord) -> dict[str, Any]:
    """One attempt with every field present (the wire form omits defaults)."""
    return {
        "attempt": record.attempt,
        "worker": record.worker,
        "identity": record.identity,
        "fence": record.fence,
        "duration_s": record.duration_s,
        "outcome": record.outcome,
        "reason": record.reason,
    }


def entry_json(entry: DeadLetterEntry, full: bool = False) -> dict[str, Any]:
    """A dead letter as ``dlq list --json`` (or, ``full``, ``dlq show --json``) prints it."""
    letter = entry.letter
    out: dict[str, Any] = {
        "id": entry.id,
        "job": letter.order.job.id,
        "target": entry.target,
        "reason": letter.reason,
        "detail": letter.detail,
        "url": letter.order.job.url,
        "key": letter.order.key,
        "time": entry.time.isoformat() if entry.time else None,
        "attempts": [attempt_json(r) for r in letter.history],
    }
    if full:
        out["order"] = letter.order
    return out


def _show_text(entry: DeadLetterEntry) -> None:
    letter, order = entry.letter, entry.letter.order
    job = order.job
    fields = [
        ("id", entry.id),
        ("target", entry.target),
        ("time", entry.time.isoformat() if entry.time else "-"),
        ("job", job.id),
        ("url", job.url),
        ("handler", job.handler),
        ("tier", job.tier),
        ("key", order.key),
        ("max attempts", order.max_attempts),
        ("timeout", f"{order.timeout_s:g} s"),
        ("reason", letter.reason),
        ("detail", letter.detail or "-"),
    ]
    if job.pin_identity:
        fields.append(("pinned to", job.pin_identity))
    if job.args:
        fields.append(("args", ", ".join(f"{k}={v}" for k, v in sorted(job.args.items()))))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}")
    print()
    print_table(
        ["attempt", "worker", "identity", "fence", "duration_s", "outcome", "reason"],
        [
            [
                r.attempt,
                r.worker,
                r.identity or "-",
                r.fence,
                f"{r.duration_s:.3f}",
                r.outcome or "-",
                r.reason or "-",
            ]
            for r in letter.history
        ],
    )


# --- commands --------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> Settings:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    if getattr(args, "target", None) is not None:
        settings.target(args.target)
    return settings


async def _with_js(settings: Settings, work: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def _run_list(args: argparse.Namespace) -> int:
    settings = _settings(args)

    async def work(js: JetStreamContext) -> list[DeadLetterEntry]:
        return await list_dead_letters(js, args.target, args.reason)

    entries: list[DeadLetterEntry] = asyncio.run(_with_js(settings, work))
    if args.json:
        print_json([entry_json(e) for e in entries])
        return 0
    print_table(
        ["id", "target", "job", "reason", "attempts"],
        [
            [e.id, e.target, e.letter.order.job.id, e.letter.reason, len(e.letter.history)]
            for e in entries
        ],
    )
    return 0


def _run_show(args: argparse.Namespace) -> int:
    settings = _settings(args)

    async def work(js: JetStreamContext) -> DeadLetterEntry:
        return await get_dead_letter(js, args.id)

    entry: DeadLetterEntry = asyncio.run(_with_js(settings, work))
    if args.json:
        print_json(entry_json(entry, full=True))
    else:
        _show_text(entry)
    return 0


async def replay_recorded(
    js: JetStreamContext,
    settings: Settings,
    id: int | None,
    target: str | None,
    reason: str | None,
    who: str,
    why_: str,
    bar: ProgressBar | None = None,
) -> list[str]:
    """Replay dead letter ``id`` (or ``target``'s, with ``reason``) and record it in the
    audit log as ``dlq.replay`` by ``who``: done, refused or failed (docs/audit.md).

    Returns:
        The new job ids (empty when no letter matched).

    Raises:
        JetfleetError: no such letter, or admission would refuse a replay.
    """
    what = f"dead letter {id}" if id is not None else f"dead letters of {target}"
    if reason is not None:
        what += f" with reason {reason}"
    try:
        if id is not None:
            entries = [await get_dead_letter(js, id)]
        else:
            entries = await list_dead_letters(js, target, reason)
        if not entries:
            return []
        if bar is not None:
            bar.total = max(len(entries), 1)
        new_ids = await replay(js, settings, entries, progress=bar.update if bar else None)
    except Exception as exc:  # refused or failed: recorded too (docs/audit.md)
        await record_raised(js, "dlq.replay", who, what, why_, exc)
        raise
    detail = f"replayed {len(new_ids)} letter(s) as {', '.join(new_ids)}"[:1024]
    await record_action(js, "dlq.replay", who, what, why_, detail)
    return new_ids


def _run_replay(args: argparse.Namespace) -> int:
    if (args.id is None) == (args.target is None):
        raise JetfleetError("dlq replay: give exactly one of ID or --target")
    if args.reason is not None and args.target is None:
        raise JetfleetError("dlq replay: --reason goes with --target")
    settings = _settings(args)

    async def work(js: JetStreamContext) -> list[str]:
        # The bar's total is set once the letters are read (replay_recorded).
        bar = ProgressBar(0, "replaying", enabled=progress_wanted(args.json))
        try:
            return await replay_recorded(
                js, settings, args.id, args.target, args.reason, actor(args), why(args), bar
            )
        finally:
            bar.close()

    new_ids: list[str] = asyncio.run(_with_js(settings, work))
    if args.json:
        print_json({"replayed": new_ids})
    else:
        for job_id in new_ids:
            print(job_id)
    if not new_ids:
        print("no dead letters matched: nothing replayed", file=sys.stderr)
        return 1
    print(f"replayed {len(new_ids)} dead letter(s)", file=sys.stderr)
    return 0


def _confirmed(count: int, scope: str) -> bool:
    if not sys.stdin.isatty():
        print(
            f"refusing to purge {count} dead letter(s){scope}: stdin is not a terminal; "
            "pass --yes to purge without asking",
            file=sys.stderr,
        )
        return False
    sys.stderr.write(f"type '{CONFIRM_WORD}' to remove {count} dead letter(s){scope} for good: ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip()
    if answer != CONFIRM_WORD:
        print("not confirmed: nothing removed", file=sys.stderr)
        return False
    return True


def _run_purge(args: argparse.Namespace) -> int:
    settings = _settings(args)
    scope = f" of {args.target}" if args.target else ""

    async def count(js: JetStreamContext) -> int:
        return await dead_letter_total(js, args.target)

    pending: int = asyncio.run(_with_js(settings, count))
    if pending == 0:
        if args.json:
            print_json({"removed": 0, "target": args.target})
        else:
            print(f"no dead letters{scope} to purge")
        return 0
    if not args.yes and not _confirmed(pending, scope):
        return 1

    async def work(js: JetStreamContext) -> int:
        what = f"dead letters of {args.target}" if args.target else "every dead letter"
        bar = ProgressBar(pending, "purging", enabled=progress_wanted(args.json))
        try:
            removed = await purge(js, args.target, progress=bar.update)
        except Exception as exc:  # part may be gone: recorded failed (docs/audit.md)
            await record_raised(js, "dlq.purge", actor(args), what, why(args), exc)
            raise
        finally:
            bar.close()
        detail = f"removed {removed} letter(s)"
        await record_action(js, "dlq.purge", actor(args), what, why(args), detail)
        return removed

    removed: int = asyncio.run(_with_js(settings, work))
    if args.json:
        print_json({"removed": removed, "target": args.target})
        return 0
    print(f"purged {removed} dead letter(s){scope}; the count is recorded in jf-control")
    return 0
