"""What JetStream's API error codes mean to jetfleet, in one place."""

from __future__ import annotations

from nats.js.errors import APIError

# 10071: "wrong last sequence" on a stream publish with Nats-Expected-Last-Subject-Sequence;
# 10164: the same refusal from a KV write (update or delete with ``last=``). Both say a
# compare-and-set lost: someone else wrote the subject first.
WRONG_LAST_SEQUENCE_CODES = frozenset({10071, 10164})


def is_wrong_last_sequence(exc: APIError) -> bool:
    """Whether ``exc`` is a compare-and-set that lost (the subject moved since it was read)."""
    return exc.err_code in WRONG_LAST_SEQUENCE_CODES
