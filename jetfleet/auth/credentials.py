"""One role's credentials, read from its file or from a bundle folder.

``nats.credentials`` (``JETFLEET_NATS__CREDENTIALS``) names either one role's file
(production: each process gets only its own) or the folder ``jetfleet auth init`` wrote
(dev and tests: each process picks its role's file from ``credentials/``). A file is TOML::

    role = "worker"
    nats_user = "worker"          # with nats_password; or nats_nkey_seed = "SU..."
    nats_password = "..."
    redis_user = "ratelimit"      # only for roles whose code opens Redis
    redis_password = "..."
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import msgspec

from jetfleet.auth.roles import ROLE_NAMES, Role
from jetfleet.errors import ConfigError
from jetfleet.settings import Settings

CREDENTIALS_DIR = "credentials"


@dataclass(frozen=True)
class RoleCredentials:
    """What one role presents to NATS (and to Redis, for the roles that use it)."""

    role: Role
    nats_user: str = ""
    nats_password: str = ""
    nats_nkey_seed: str = ""
    redis_user: str = ""
    redis_password: str = ""


def credentials_file(bundle: Path, role: Role) -> Path:
    """Where ``role``'s file sits in a bundle folder."""
    return bundle / CREDENTIALS_DIR / f"{role}.toml"


def load_credentials(setting: str, role: Role) -> RoleCredentials | None:
    """The credentials ``role`` connects with, or None when ``setting`` is empty.

    Args:
        setting: ``nats.credentials``: a role's file, or a bundle folder.
        role: the role this process runs as.

    Raises:
        ConfigError: the file is missing, malformed, or belongs to another role.
    """
    if not setting:
        return None
    path = Path(setting).expanduser()
    if path.is_dir():
        path = credentials_file(path, role)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"nats.credentials: {path} does not exist: run `jetfleet auth init` or point "
            f"nats.credentials (JETFLEET_NATS__CREDENTIALS) at the {role!r} role's file"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"nats.credentials: {path} is not a credentials file ({exc})") from None
    found = raw.get("role")
    if found != role:
        raise ConfigError(
            f"nats.credentials: {path} holds the {found!r} role's credentials; this "
            f"process runs as {role!r}: give it the {role!r} file (or the bundle folder)"
        )
    fields = ("nats_user", "nats_password", "nats_nkey_seed", "redis_user", "redis_password")
    values = {name: str(raw.get(name, "")) for name in fields}
    if not values["nats_nkey_seed"] and not (values["nats_user"] and values["nats_password"]):
        raise ConfigError(
            f"nats.credentials: {path} has neither nats_nkey_seed nor nats_user and "
            "nats_password: regenerate it with `jetfleet auth init --force`"
        )
    return RoleCredentials(role=role, **values)


def redis_url_for(url: str, credentials: RoleCredentials | None) -> str:
    """``url`` with the role's Redis user and password in place of any it carries.

    Without credentials (no ``nats.credentials``) the URL is kept as it is; a role with no
    Redis user gets the URL without any user, so it cannot borrow another's.
    """
    parts = urlsplit(url)
    if credentials is None or parts.scheme == "unix":
        return url
    # Everything after the userinfo, kept as written: one host:port, or a cluster's or
    # the Sentinels' comma-separated list (jetfleet/redis_topology.py).
    netloc = parts.netloc.rpartition("@")[2] or "127.0.0.1"
    if credentials.redis_user:
        user = quote(credentials.redis_user, safe="")
        netloc = f"{user}:{quote(credentials.redis_password, safe='')}@{netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


def without_secrets(url: str) -> str:
    """``url`` without any user or password (a Sentinel URL's ``sentinel_password``
    included), fit for a log line or an error message."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(
        "sentinel_password=***" if part.startswith("sentinel_password=") else part
        for part in parts.query.split("&")
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query if parts.query else ""))


def settings_for_role(settings: Settings, role: Role) -> Settings:
    """``settings`` as a process of ``role`` uses them: its Redis URL carries the role's
    own Redis user (credentials.py), none for a role that does not use Redis.

    Raises:
        ConfigError: ``nats.credentials`` is set but unusable for ``role``.
    """
    credentials = load_credentials(settings.nats.credentials, role)
    if credentials is None:
        return settings
    redis = msgspec.structs.replace(
        settings.redis, url=redis_url_for(settings.redis.url, credentials)
    )
    return msgspec.structs.replace(settings, redis=redis)


def declares_topology(settings: Settings) -> bool:
    """Whether a service, worker or submit may create missing streams itself.

    Without credentials every process declares what is missing, as on a server with no
    auth. With them, creating streams is administration: the admin role does it
    (``jetfleet topology apply``; ``jetfleet dev`` at start) and the others only use them.
    """
    return not settings.nats.credentials


def known_role(name: str) -> Role:
    """``name`` as a role, or a ConfigError listing the roles."""
    for role in ROLE_NAMES:
        if role == name:
            return role
    raise ConfigError(f"unknown role {name!r}: choose one of {', '.join(ROLE_NAMES)}")
