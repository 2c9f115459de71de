"""``jetfleet auth init``: generate every role's credentials and the servers' auth files.

The bundle folder holds:

- ``nats-auth.conf``: an ``authorization {}`` block for nats-server (``include`` it);
- ``redis-users.acl``: a Redis ACL file (``aclfile``; passwords stored as SHA-256);
- ``credentials/<role>.toml``: one file per role (mode 0600), what ``nats.credentials``
  names (credentials.py);
- ``gateway-token``: the bearer token for the gateway's control and read routes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from jetfleet import inflight_caps, rate_cells, subnet_holds
from jetfleet.auth.credentials import CREDENTIALS_DIR, RoleCredentials, credentials_file
from jetfleet.auth.roles import ROLE_NAMES, ROLES, Role, RolePermissions
from jetfleet.errors import ConfigError

NATS_AUTH_FILE = "nats-auth.conf"
REDIS_ACL_FILE = "redis-users.acl"
GATEWAY_TOKEN_FILE = "gateway-token"

# The keys jetfleet keeps in Redis: the rate cells and holds (the fleet's hash tag and
# each target's), the in-flight places and the subnet holds. A service user touches no
# other key (a Redis shared with other applications keeps theirs) and no pub/sub channel
# (jetfleet uses none).
REDIS_KEY_PATTERNS = (
    rate_cells.KEY_PATTERN,
    f"{inflight_caps.KEY_PREFIX}*",
    f"{subnet_holds.KEY_PREFIX}*",
)

# What a service's Redis user may run: jetfleet's keys, everything but administration and
# the commands that can wipe or scan the whole keyspace (FLUSHALL, KEYS, CONFIG, DEBUG, ...),
# except CLUSTER SLOTS: a Redis Cluster client asks it to learn which node holds which
# slot (Redis 6 files all of CLUSTER under @dangerous). A cluster loads the file on
# every node (ACLs are per node, never shared by the cluster).
SERVICE_REDIS_RULES = (
    "resetkeys "
    + " ".join(f"~{p}" for p in REDIS_KEY_PATTERNS)
    + " resetchannels +@all -@dangerous +cluster|slots"
)


@dataclass(frozen=True)
class Bundle:
    """What ``init_bundle`` wrote."""

    directory: Path
    credentials: dict[Role, RoleCredentials]
    gateway_token: str

    @property
    def nats_include(self) -> Path:
        """The ``authorization {}`` file nats-server includes."""
        return self.directory / NATS_AUTH_FILE

    @property
    def redis_acl(self) -> Path:
        """The Redis ACL file (``redis-server --aclfile``)."""
        return self.directory / REDIS_ACL_FILE


def _generated_files(directory: Path) -> list[Path]:
    return [
        directory / NATS_AUTH_FILE,
        directory / REDIS_ACL_FILE,
        directory / GATEWAY_TOKEN_FILE,
        *(credentials_file(directory, role) for role in ROLE_NAMES),
    ]


def init_bundle(directory: Path, use_nkeys: bool = False, force: bool = False) -> Bundle:
    """Generate fresh credentials for every role and write the bundle.

    Args:
        directory: the bundle folder (created if missing).
        use_nkeys: NATS users by nkey (ed25519 seed) instead of user/password.
        force: replace a bundle already there (every credential changes).

    Raises:
        ConfigError: a bundle exists and ``force`` is false, or the folder is unusable.
    """
    existing = [p for p in _generated_files(directory) if p.exists()]
    if existing and not force:
        raise ConfigError(
            f"{directory} already holds credentials ({existing[0].name} and "
            f"{len(existing) - 1} more): pass --force to replace them all (running "
            "processes then need the new files), or choose another --dir"
        )
    try:
        (directory / CREDENTIALS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {directory}: {exc}") from None
    os.chmod(directory / CREDENTIALS_DIR, 0o700)
    creds = {role: _new_credentials(role, use_nkeys) for role in ROLE_NAMES}
    token = secrets.token_urlsafe(32)
    _write_private(directory / NATS_AUTH_FILE, nats_authorization(creds))
    _write_private(directory / REDIS_ACL_FILE, redis_acl(creds))
    _write_private(directory / GATEWAY_TOKEN_FILE, token + "\n")
    for role, cred in creds.items():
        _write_private(credentials_file(directory, cred.role), credentials_toml(cred, role))
    return Bundle(directory=directory, credentials=dict(creds), gateway_token=token)


def read_gateway_token(directory: Path) -> str:
    """The gateway token of a bundle, or "" when it has none."""
    path = directory / GATEWAY_TOKEN_FILE
    return path.read_text().strip() if path.is_file() else ""


def _new_credentials(role: Role, use_nkeys: bool) -> RoleCredentials:
    perms = ROLES[role]
    redis = {"redis_user": role, "redis_password": secrets.token_urlsafe(24)} if perms.redis else {}
    if use_nkeys:
        return RoleCredentials(role=perms.role, nats_nkey_seed=_nkey_seed(), **redis)
    return RoleCredentials(
        role=perms.role, nats_user=role, nats_password=secrets.token_urlsafe(24), **redis
    )


def _nkey_seed() -> str:
    import nkeys

    # nkeys 0.2.1 has no generator; a user seed is 32 random bytes, encoded.
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)).decode()


def nkey_public(seed: str) -> str:
    """The public key (``U...``) nats-server lists for a user nkey seed."""
    import nkeys

    return bytes(nkeys.from_seed(bytearray(seed.encode())).public_key).decode()


def _quoted(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def _permissions_block(perms: RolePermissions) -> str:
    publish = f"allow: {_quoted(perms.publish)}"
    if perms.publish_deny:
        publish += f", deny: {_quoted(perms.publish_deny)}"
    lines = [
        f"    publish: {{ {publish} }}",
        f"    subscribe: {{ allow: {_quoted(perms.subscribe_all)} }}",
    ]
    if perms.serves_requests:
        # Reply to requests it received, and only to those (no publishing on inboxes).
        lines.append("    allow_responses: true")
    return "\n".join(lines)


def nats_authorization(creds: dict[Role, RoleCredentials]) -> str:
    """The ``authorization {}`` block granting each role its permissions."""
    out = ["# Written by `jetfleet auth init`; roles from jetfleet/auth/roles.py.", ""]
    out.append("authorization {")
    for cred in creds.values():
        out.append(f"  {cred.role.upper()} = {{")
        out.append(_permissions_block(ROLES[cred.role]))
        out.append("  }")
    out.append("  users: [")
    for cred in creds.values():
        if cred.nats_nkey_seed:
            who = f"nkey: {json.dumps(nkey_public(cred.nats_nkey_seed))}"
        else:
            who = f"user: {json.dumps(cred.nats_user)}, password: {json.dumps(cred.nats_password)}"
        out.append(f"    {{ {who}, permissions: ${cred.role.upper()} }}")
    out += ["  ]", "}", ""]
    return "\n".join(out)


def redis_acl(creds: dict[Role, RoleCredentials]) -> str:
    """A Redis ACL file: the default user off, a user for each role that uses Redis."""
    lines = ["user default off"]
    for cred in creds.values():
        if not cred.redis_user:
            continue
        digest = hashlib.sha256(cred.redis_password.encode()).hexdigest()
        rules = "~* &* +@all" if cred.role == "admin" else SERVICE_REDIS_RULES
        lines.append(f"user {cred.redis_user} on #{digest} {rules}")
    return "\n".join(lines) + "\n"


def credentials_toml(cred: RoleCredentials, role: Role) -> str:
    """One role's credentials file."""
    lines = [
        f"# jetfleet credentials for role {role!r}: keep this file private (mode 0600).",
        f"role = {json.dumps(cred.role)}",
    ]
    for name in ("nats_user", "nats_password", "nats_nkey_seed", "redis_user", "redis_password"):
        value = getattr(cred, name)
        if value:
            lines.append(f"{name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by the owner only, atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # Before the secret is written: a .tmp left by a crash keeps its old mode on open.
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    tmp.replace(path)


def ensure_bundle(directory: Path) -> Bundle:
    """The bundle in ``directory``, generated first if it is not complete there (dev and
    tests keep one per data folder).

    A kept bundle keeps its secrets, but its server files are written again from the
    role table: permissions are the code's, so a data folder made by an older jetfleet
    would otherwise start nats-server with that version's roles (a subject the new code
    uses refused, only in dev)."""
    if all(p.exists() for p in _generated_files(directory)):
        from jetfleet.auth.credentials import load_credentials

        loaded = {role: load_credentials(str(directory), role) for role in ROLE_NAMES}
        creds = {k: v for k, v in loaded.items() if v is not None}
        _write_private(directory / NATS_AUTH_FILE, nats_authorization(creds))
        _write_private(directory / REDIS_ACL_FILE, redis_acl(creds))
        return Bundle(
            directory=directory,
            credentials=creds,
            gateway_token=read_gateway_token(directory),
        )
    return init_bundle(directory, force=True)
