"""``--as NAME`` and ``--why``: who runs a control command and why, for the audit log
(docs/audit.md)."""

from __future__ import annotations

import argparse
import os
import pwd
import sys

from jetfleet.audit import NOT_RECORDED

MAX_CHARS = 256  # as ShortText: what the command structs carry


def add_actor_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--as`` and ``--why`` to a control command."""
    parser.add_argument(
        "--as",
        dest="actor",
        default="",
        metavar="NAME",
        help="who is acting, for the audit log (default: the OS user)",
    )
    parser.add_argument("--why", default="", help="why, for the audit log (jetfleet audit)")


def actor(args: argparse.Namespace) -> str:
    """Who acts: ``--as``, else the OS user (from the password database, not the
    environment)."""
    named = str(getattr(args, "actor", "") or "")
    if named:
        return named[:MAX_CHARS]
    try:
        return pwd.getpwuid(os.getuid()).pw_name[:MAX_CHARS]
    except KeyError:
        return f"uid-{os.getuid()}"


def why(args: argparse.Namespace) -> str:
    """The reason given with ``--why`` (trimmed to what the command structs carry)."""
    return str(getattr(args, "why", "") or "")[:MAX_CHARS]


def audit_note_off(detail: str) -> str:
    """``detail`` without the leaser's note that the action's audit entry could not be
    written, which goes to stderr as a warning instead: the operator must learn it, and
    the answer's detail must keep meaning what the command prints it for (a record kept,
    a breaker not open), not turn a plain success into a puzzling line."""
    if NOT_RECORDED not in detail:
        return detail
    print(
        "jetfleet: WARNING: done, but the audit entry could not be written (the leaser "
        "logged it as AUDIT NOT WRITTEN); record the action by hand",
        file=sys.stderr,
    )
    return detail.replace(NOT_RECORDED, "")
