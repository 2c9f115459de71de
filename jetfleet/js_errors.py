"""What JetStream's errors mean to jetfleet, in one place: API error codes, and which
exceptions say "not reachable now" rather than "refused"."""

from __future__ import annotations

from nats.errors import (
    ConnectionClosedError,
    ConnectionDrainingError,
    ConnectionReconnectingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from jetfleet.errors import SubmitError

# 10071: "wrong last sequence" on a stream publish with Nats-Expected-Last-Subject-Sequence;
# 10164: the same refusal from a KV write (update or delete with ``last=``). Both say a
# compare-and-set lost: someone else wrote the subject first.
WRONG_LAST_SEQUENCE_CODES = frozenset({10071, 10164})


# 10158: "duplicate message id is in process": a publish carrying the Nats-Msg-Id of one
# the stream is still storing (replicating), as a retry after a lost PubAck meets on a
# clustered stream. Asked again a moment later, it is answered as a duplicate.
MSG_ID_IN_PROCESS_CODE = 10158


def is_msg_id_in_process(exc: APIError) -> bool:
    """Whether ``exc`` says the same message id is being stored right now."""
    return exc.err_code == MSG_ID_IN_PROCESS_CODE


def is_wrong_last_sequence(exc: APIError) -> bool:
    """Whether ``exc`` is a compare-and-set that lost (the subject moved since it was read)."""
    return exc.err_code in WRONG_LAST_SEQUENCE_CODES


UNAVAILABLE: tuple[type[Exception], ...] = (
    TimeoutError,  # nats.errors.TimeoutError too: JetStream did not answer in time
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ConnectionClosedError,
    ConnectionReconnectingError,
    ConnectionDrainingError,
    StaleConnectionError,
    OutboundBufferLimitError,
    SubmitError,  # publish_durably's retries all timed out
)
"""Failures that mean "NATS or JetStream is unreachable or busy right now", not a bug."""


def is_unavailable(exc: Exception) -> bool:
    """Whether ``exc`` says JetStream could not be reached or did not answer in time (an
    election, a reconnect, a caller stalled past its own timeouts), as opposed to a
    refusal of what was asked: the same call may be made again as it was."""
    return isinstance(exc, UNAVAILABLE)
