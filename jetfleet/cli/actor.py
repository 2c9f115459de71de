"""``--as NAME`` and ``--why``: who runs a control command and why, for the audit log
(docs/audit.md)."""

from __future__ import annotations

import argparse
import os
import pwd

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
