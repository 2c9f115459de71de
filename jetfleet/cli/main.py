"""``jetfleet``: the one entry point. ``jetfleet --help`` lists every command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from jetfleet import __version__
from jetfleet.auth.credentials import settings_for_role
from jetfleet.auth.roles import Role
from jetfleet.cli import (
    audit_command,
    auth_commands,
    breaker_commands,
    completion_command,
    data_commands,
    dlq_commands,
    doctor_command,
    pause_commands,
    quarantine_commands,
    run_commands,
    runbook_command,
    scenario_command,
    target_commands,
    version_commands,
)
from jetfleet.cli.exit_codes import run_guarded
from jetfleet.dev.stack_env import effective_env
from jetfleet.settings import Settings, load_settings

DESCRIPTION = """\
Run a polite fleet of crawl and browser-automation workers from NATS JetStream.

Start here:  jetfleet demo          (the showcase: a local fleet, misbehaving sites, a report)
             jetfleet dev           (the same fleet, kept running; Ctrl-C stops it)
Then, from another shell in the same folder:
             jetfleet submit demo /page/1 /page/2
             jetfleet status
"""


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser."""
    parser = argparse.ArgumentParser(
        prog="jetfleet",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jetfleet {__version__}")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="jetfleet.toml to use (default: $JETFLEET_CONFIG, or the running dev stack's)",
    )
    parser.add_argument(
        "--stack",
        type=Path,
        default=None,
        help="folder of a running `jetfleet dev` (default: $JETFLEET_STACK or ./.jetfleet)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_commands.register(commands)
    data_commands.register(commands)
    quarantine_commands.register(commands)
    breaker_commands.register(commands)
    target_commands.register(commands)
    dlq_commands.register(commands)
    doctor_command.register(commands)
    scenario_command.register(commands)
    pause_commands.register(commands)
    version_commands.register(commands)
    audit_command.register(commands)
    runbook_command.register(commands)
    auth_commands.register(commands)
    completion_command.register(commands)
    return parser


def settings_from(args: argparse.Namespace, role: Role = "operator") -> Settings:
    """The settings for this invocation: --config, the environment, a running dev stack;
    with Redis credentials of ``role`` (the CLI's commands run as ``operator``)."""
    env = effective_env(os.environ, args.stack)
    return settings_for_role(load_settings(args.config, env), role)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (docs/cli.md, "Exit codes":
    jetfleet/cli/exit_codes.py maps what a command raises)."""
    return run_guarded(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code: int = args.run(args)
    return code
