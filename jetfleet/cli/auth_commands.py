"""``jetfleet auth init``: every role's credentials and the servers' auth files
(docs/security.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jetfleet.auth.bundle import GATEWAY_TOKEN_FILE, init_bundle
from jetfleet.auth.credentials import CREDENTIALS_DIR
from jetfleet.auth.roles import ROLES, roles_markdown
from jetfleet.cli.progress import print_json

DEFAULT_AUTH_DIR = Path(".jetfleet-auth")


def register(commands: Any) -> None:
    """Add ``auth`` to the parser."""
    parser = commands.add_parser(
        "auth",
        help="generate NATS users, Redis users and the gateway token per role",
        description="init: generate fresh credentials for every role (admin, operator, "
        "client, scheduler, leaser, ratelimit, quarantine, sink, gateway, worker) and "
        "write a nats-server `authorization {}` include, a Redis ACL file, one "
        "credentials file per role (mode 0600) and the gateway token. Point each "
        "process's nats.credentials (JETFLEET_NATS__CREDENTIALS) at its own role's file. "
        "See docs/security.md.",
    )
    actions = parser.add_subparsers(dest="auth_action", required=True)
    init = actions.add_parser("init", help="generate the credentials bundle")
    init.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_AUTH_DIR,
        help=f"folder to write (default: ./{DEFAULT_AUTH_DIR})",
    )
    init.add_argument(
        "--nkeys", action="store_true", help="NATS users by nkey (ed25519) instead of passwords"
    )
    init.add_argument(
        "--force", action="store_true", help="replace credentials already in the folder"
    )
    init.add_argument("--json", action="store_true", help="print what was written as JSON")
    init.set_defaults(run=_run_init)
    roles = actions.add_parser(
        "roles", help="print every role's permissions (Markdown, as in docs/security.md)"
    )
    roles.add_argument(
        "--json", action="store_true", help="print every role's permissions as a JSON list"
    )
    roles.set_defaults(run=_run_roles)


def _run_roles(args: argparse.Namespace) -> int:
    if args.json:
        print_json(list(ROLES.values()))
        return 0
    print(roles_markdown(), end="")
    return 0


def _run_init(args: argparse.Namespace) -> int:
    bundle = init_bundle(args.dir, use_nkeys=args.nkeys, force=args.force)
    written = {
        "nats_include": str(bundle.nats_include),
        "redis_acl": str(bundle.redis_acl),
        "credentials": str(bundle.directory / CREDENTIALS_DIR),
        "gateway_token": str(bundle.directory / GATEWAY_TOKEN_FILE),
        "roles": sorted(bundle.credentials),
    }
    if args.json:
        print_json(written)
        return 0
    print(f"wrote credentials for {len(bundle.credentials)} roles in {bundle.directory}:")
    print(f"  nats-server:  include {bundle.nats_include.name!r} (a path relative to the")
    print("                including file) in the server's config")
    print(f"  redis-server: aclfile {bundle.redis_acl}")
    print(f"  processes:    nats.credentials = {bundle.directory / CREDENTIALS_DIR}/<role>.toml")
    print(f"  gateway:      gateway.token = contents of {bundle.directory / GATEWAY_TOKEN_FILE}")
    return 0
