"""Egress proposals in ``jf-control``: their ids, keys, reads and writes, shared by the
quarantine service (which proposes), the leaser (which approves or rejects) and the
status views (docs/quarantine.md#egress-proposals)."""

from __future__ import annotations

import hashlib

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.schemas.lease import QuarantineProposal

PREFIX = subjects.QUARANTINE_PROPOSAL_PREFIX
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(QuarantineProposal)


def proposal_id(subnet: str, target: str) -> str:
    """The id of the proposal for (subnet, target): one at a time per pair, so a later
    firing with new evidence replaces a pending one instead of adding another."""
    return hashlib.sha256(f"{target}\0{subnet}".encode()).hexdigest()[:16]


def proposal_key(id_: str) -> str:
    """The ``jf-control`` key of proposal ``id_``."""
    return f"{PREFIX}.{id_}"


def decode_proposal(data: bytes) -> QuarantineProposal:
    """A stored proposal."""
    return _decoder.decode(data)


async def read_proposal(control: KeyValue, id_: str) -> QuarantineProposal | None:
    """The proposal ``id_`` while it lasts (not approved, not lapsed), else None."""
    try:
        entry = await control.get(proposal_key(id_))
    except KeyNotFoundError:
        return None
    return decode_proposal(entry.value) if entry.value else None


async def write_proposal(js: JetStreamContext, proposal: QuarantineProposal, ttl_s: float) -> None:
    """Store ``proposal`` (replacing the pair's earlier one); the server removes it after
    ``ttl_s``, so a proposal nobody answers lapses by the server's clock."""
    await js.publish(
        f"$KV.{subjects.BUCKET_CONTROL}.{proposal_key(proposal.id)}",
        _encoder.encode(proposal),
        msg_ttl=ttl_whole_seconds(ttl_s),
    )


async def drop_proposal(control: KeyValue, id_: str) -> None:
    """Remove proposal ``id_`` (it was approved)."""
    await control.delete(proposal_key(id_))
