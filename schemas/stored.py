"""A reference to bytes kept in a JetStream object store instead of a message."""

from __future__ import annotations

import msgspec


class StoredObject(msgspec.Struct, frozen=True, omit_defaults=True):
    """Bytes too large for a message, kept in a JetStream object store bucket as long as
    the result that refers to them (a body, later a screenshot)."""

    bucket: str
    name: str
    size: int
    sha256: str
    """SHA-256 of the stored bytes, hex: what a reader checks them against."""
