"""A job's avoid list: the workers and identities it is not granted to for a while.

An entry is added when the target challenged or blocked the job there (the holder's
release says so) or when the scope was quarantined while it held the job (the revoke).
The entries live on the job's ledger entry in ``jf-fences`` (``JobLeaseHistory.avoid``),
so every leaser replica sees them with the history each grant reads anyway; each one
holds while its marker in ``jf-control`` lives, a key with a per-key TTL of
``fleet.avoid_s``, so the NATS server's clock says when it lapses
(docs/leases.md#the-avoid-list). Pure functions only.
"""

from __future__ import annotations

import hashlib

from jetfleet import subjects
from jetfleet.schemas.lease import AVOID_MAX, AvoidEntry


def with_entry(entries: list[AvoidEntry], entry: AvoidEntry) -> list[AvoidEntry]:
    """``entries`` with ``entry`` added last (it replaces one naming the same scope and
    name), keeping at most ``AVOID_MAX``, the newest."""
    kept = [e for e in entries if (e.scope, e.name) != (entry.scope, entry.name)]
    return [*kept, entry][-AVOID_MAX:]


def naming(entries: list[AvoidEntry], worker: str, identity: str) -> list[AvoidEntry]:
    """The entries that name ``worker`` (scope worker) or ``identity`` (scope identity;
    an empty identity is named by none)."""
    return [
        e
        for e in entries
        if (e.scope == "worker" and e.name == worker)
        or (e.scope == "identity" and bool(identity) and e.name == identity)
    ]


def marker_key(job_id: str, entry: AvoidEntry) -> str:
    """The ``jf-control`` key of the entry's marker (a digest: job ids and names may hold
    characters a key may not)."""
    digest = hashlib.sha256(f"{job_id}\n{entry.scope}\n{entry.name}".encode()).hexdigest()
    return f"{subjects.AVOID_PREFIX}.{digest[:40]}"
