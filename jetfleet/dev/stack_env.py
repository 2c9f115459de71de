"""The ``env`` file a running dev stack writes, so a CLI in another shell finds it.

It holds ``KEY=VALUE`` lines (``NATS_URL``, ``REDIS_URL``, ``JETFLEET_CONFIG``,
``JETFLEET_GATEWAY_URL``, ``JETFLEET_TARGET_URL``); ``set -a; . DIR/env`` loads it in a shell.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

DEFAULT_STACK_DIR = Path(".jetfleet")


def write_env(path: Path, values: Mapping[str, str]) -> None:
    """Write ``values`` as an env file (atomically, so a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    tmp.replace(path)


def read_env(path: Path) -> dict[str, str]:
    """Read an env file written by ``write_env``; empty if it does not exist."""
    if not path.is_file():
        return {}
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            values[key.strip()] = value.strip()
    return values


def effective_env(environ: Mapping[str, str], stack_dir: Path | None = None) -> dict[str, str]:
    """The process environment, completed from a running dev stack's env file.

    Variables already set win; the stack is ``stack_dir``, else ``JETFLEET_STACK``, else
    ``./.jetfleet`` when it exists.
    """
    env = dict(environ)
    directory = stack_dir or Path(env.get("JETFLEET_STACK", DEFAULT_STACK_DIR))
    for key, value in read_env(directory / "env").items():
        env.setdefault(key, value)
    return env
