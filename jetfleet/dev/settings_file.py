"""Writing settings back out as ``jetfleet.toml`` (for ``jetfleet dev``, tests, tools)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from jetfleet.settings import Settings


def toml_value(value: Any) -> str:
    """One TOML value: booleans, numbers, strings, lists and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def toml_tables(tables: dict[str, dict[str, Any]]) -> str:
    """``{"nats": {...}, "targets.demo": {...}}`` as TOML tables."""
    lines: list[str] = []
    for name, body in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in body.items()]
        lines.append("")
    return "\n".join(lines)


def settings_toml(settings: Settings) -> str:
    """``settings`` as a complete jetfleet.toml that loads back to the same settings."""
    raw = msgspec.to_builtins(settings)
    tables = {name: body for name, body in raw.items() if name not in ("targets", "identities")}
    tables.update({f"targets.{name}": body for name, body in raw["targets"].items()})
    # An identity's name is free text: quoted, it is one TOML key whatever it holds.
    tables.update(
        {f"identities.{json.dumps(name)}": body for name, body in raw["identities"].items()}
    )
    return toml_tables(tables)
