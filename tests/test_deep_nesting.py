"""A document nested thousands deep is refused with a reason wherever jetfleet decodes
what others send. msgspec's nesting limit raises ``RecursionError``, not a
``MsgspecError``: found by tests/test_fuzz_wire.py, where the leaser left such a lease
call unanswered (the caller saw only a timeout) and the other decoders let it escape."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import LeaseRefusal, LeaseReply, Rejection
from jetfleet.services.gateway.batch import InvalidBody, parse_batch
from jetfleet.services.gateway.controls import PauseBody, decode_body
from jetfleet.services.gateway.refusal import Refused
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.outcome_events import read_outcome
from jetfleet.settings import Settings
from tests.stack import InProcessStack

DEEP_OBJECT = b'{"a":' * 3000 + b"1" + b"}" * 3000
"""An unknown field whose value is nested 3000 deep: every Struct decoder recurses into it."""
DEEP_ARRAY = b"[" * 5000 + b"]" * 5000
SMALL_DEEP = b'{"x":' + b"[" * 2000 + b"]" * 2000 + b"}"
"""Nested deep enough (4 KB) to pass an outcome event's 8 KiB cap."""


def test_a_deeply_nested_submission_is_rejected_as_invalid_json(settings: Settings) -> None:
    verdict = admit(subjects.submit("demo"), DEEP_OBJECT, settings)
    assert isinstance(verdict, Rejection)
    assert verdict.reason == "invalid-json"
    assert "nested too deeply" in verdict.message


def test_a_deeply_nested_outcome_event_is_skipped_with_a_reason() -> None:
    why = read_outcome(subjects.outcome("demo", "j1"), SMALL_DEEP)
    assert isinstance(why, str) and "does not decode" in why


@pytest.mark.parametrize("body", [DEEP_OBJECT, DEEP_ARRAY], ids=["object", "array"])
def test_a_deeply_nested_gateway_body_is_a_400_not_a_500(settings: Settings, body: bytes) -> None:
    with pytest.raises((InvalidBody, Refused)):
        parse_batch(body)
    with pytest.raises(Refused) as refused:
        decode_body(body, PauseBody)
    assert refused.value.status == 400


async def test_a_deeply_nested_lease_call_is_answered_malformed(
    nc: NatsClient, services: InProcessStack
) -> None:
    answer = await nc.request(subjects.LEASE, DEEP_OBJECT, timeout=5)
    reply = msgspec.json.decode(answer.data, type=LeaseReply)
    assert isinstance(reply, LeaseRefusal)
    assert reply.reason == "malformed-request"
    assert "recursion" in reply.detail
    # And the leaser still answers the next call on its merits.
    valid = msgspec.json.encode({"type": "renew", "job_id": "j1", "fence": 1})
    again = msgspec.json.decode((await nc.request(subjects.LEASE, valid, timeout=5)).data)
    assert again["reason"] == "lease-lost"
