"""A worker's own names, checked at start against the bounds the leaser and the sink
hold every lease call and report to (schemas/names.py): a worker whose id would be
refused in every call must not start and hand its jobs back for ever."""

from __future__ import annotations

import msgspec

from jetfleet.errors import ConfigError
from jetfleet.schemas.names import Name, RequiredName


def check_worker_names(worker_id: str, identity: str, region: str, egress: str = "") -> None:
    """Raise ConfigError naming the setting whose value the services would refuse."""
    for key, value, bound in (
        ("worker.id (or --id)", worker_id, RequiredName),
        ("worker.identity (or --identity)", identity, Name),
        ("worker.region", region, Name),
        ("worker.egress", egress, Name),
    ):
        try:
            msgspec.convert(value, bound)
        except msgspec.ValidationError:
            raise ConfigError(
                f"config: {key} is {value[:80]!r}: set it to 1 to 256 characters (the "
                "identity, region and egress may be empty) without control characters"
            ) from None
