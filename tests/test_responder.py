"""The services' request/reply loop (jetfleet/responder.py) on a real nats-server: a full
replica answers ``busy`` at once, a malformed request gets its reason, a drain finishes
what is in hand and takes nothing new."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetfleet.errors import ConfigError
from jetfleet.responder import (
    BUSY_RETRY_AFTER_S,
    UNAVAILABLE_RETRY_AFTER_S,
    Refusals,
    Responder,
    Route,
)
from jetfleet.settings import load_settings
from tests.conftest import wait_for

SUBJECT = "test.responder"


class Ask(msgspec.Struct, frozen=True):
    n: int


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    status: str
    n: int = 0
    retry_after_s: float = 0.0
    detail: str = ""


REFUSALS = Refusals[Answer](
    malformed=lambda error: Answer(status="malformed", detail=error),
    busy=lambda wait, why: Answer(status="busy", retry_after_s=wait, detail=why),
    failed=lambda exc: Answer(status="failed", detail=str(exc)),
)
_decode = msgspec.json.Decoder(Answer).decode


class HeldAnswers:
    """A handler whose answers wait until the test lets them go."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def answer(self, ask: Ask) -> Answer:
        self.started += 1
        await self.release.wait()
        return Answer(status="ok", n=ask.n)


async def _ask(nc: NatsClient, payload: bytes) -> Answer:
    return _decode((await nc.request(SUBJECT, payload, timeout=30.0)).data)


async def _serving(nc: NatsClient, limit: int, held: HeldAnswers) -> Responder:
    responder = Responder(nc, "test", "test-queue", limit)
    await responder.serve(Route(SUBJECT, msgspec.json.Decoder(Ask), held.answer, REFUSALS))
    await nc.flush()
    return responder


async def test_a_full_responder_answers_busy_at_once_and_takes_requests_again_when_one_ends(
    nc: NatsClient,
) -> None:
    held = HeldAnswers()
    responder = await _serving(nc, 2, held)
    first = [asyncio.create_task(_ask(nc, b'{"n": %d}' % n)) for n in (1, 2)]

    async def both_in_hand() -> bool:
        return held.started == 2

    await wait_for(both_in_hand, 5, "two requests in hand")
    busy = await _ask(nc, b'{"n": 3}')  # answered although the other two still wait
    assert busy == Answer(
        status="busy", retry_after_s=BUSY_RETRY_AFTER_S, detail="the test is full"
    )
    assert held.started == 2, "a busy request must not reach the handler"
    assert responder.refused.get(subject=SUBJECT, reason="busy") == 1
    held.release.set()
    assert [a.n for a in await asyncio.gather(*first)] == [1, 2]
    assert await _ask(nc, b'{"n": 4}') == Answer(status="ok", n=4)
    assert responder.in_hand == 0
    await responder.drain(5.0)


async def test_a_malformed_request_is_answered_with_what_is_wrong_and_serving_goes_on(
    nc: NatsClient,
) -> None:
    held = HeldAnswers()
    held.release.set()
    responder = await _serving(nc, 4, held)
    bad = await _ask(nc, b'{"n": "seven"}')
    assert bad.status == "malformed"
    assert "Expected `int`, got `str`" in bad.detail and "$.n" in bad.detail, bad.detail
    assert (await _ask(nc, b"not json")).status == "malformed"
    assert held.started == 0
    assert await _ask(nc, b'{"n": 5}') == Answer(status="ok", n=5)
    assert responder.refused.get(subject=SUBJECT, reason="malformed") == 2
    await responder.drain(5.0)


async def test_a_handler_that_raises_is_answered_failed_and_counted(nc: NatsClient) -> None:
    async def broken(ask: Ask) -> Answer:
        raise RuntimeError(f"store unreachable for {ask.n}")

    responder = Responder(nc, "test", "test-queue", 4)
    await responder.serve(Route(SUBJECT, msgspec.json.Decoder(Ask), broken, REFUSALS))
    await nc.flush()
    assert await _ask(nc, b'{"n": 6}') == Answer(status="failed", detail="store unreachable for 6")
    assert responder.refused.get(subject=SUBJECT, reason="failed") == 1
    await responder.drain(5.0)


async def test_drain_answers_the_requests_in_hand_and_takes_no_new_one(nc: NatsClient) -> None:
    held = HeldAnswers()
    responder = await _serving(nc, 4, held)
    in_hand = asyncio.create_task(_ask(nc, b'{"n": 7}'))

    async def started() -> bool:
        return held.started == 1

    await wait_for(started, 5, "the request in hand")
    draining = asyncio.create_task(responder.drain(10.0))

    async def unsubscribed() -> bool:
        # A probe the drain's unsubscribe has not yet overtaken is answered malformed at
        # once, without reaching the handler; after it, nobody answers. A probe the
        # server delivered just as the subscription went (nats-py drops a message that
        # arrives after the drain's flush) goes unanswered: not taken either.
        try:
            await nc.request(SUBJECT, b"probe", timeout=1.0)
        except (NoRespondersError, NatsTimeoutError):
            return True
        return False

    await wait_for(unsubscribed, 5, "the drained responder to stop taking requests")
    assert not draining.done(), "drain returned with a request still in hand"
    held.release.set()
    await asyncio.wait_for(draining, 5)
    assert await in_hand == Answer(status="ok", n=7)
    assert held.started == 1


@pytest.mark.parametrize("value", ["0", "-3", "100001"])
def test_item7_service_concurrency_out_of_range_names_the_key_and_the_range(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(f"[fleet]\nservice_concurrency = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert "fleet.service_concurrency" in str(info.value)
    assert "1 to 100000" in str(info.value)
    assert load_settings(None, {}).fleet.service_concurrency == 512


async def test_a_handler_jetstream_did_not_answer_in_time_is_answered_busy_not_failed(
    nc: NatsClient,
) -> None:
    # A caller counts a failure against the job; a timeout of the service's own JetStream
    # calls (an election, the service stalled past its timeouts) must not cost that.
    async def timed_out(ask: Ask) -> Answer:
        raise NatsTimeoutError  # what nats-py raises when JetStream does not answer

    responder = Responder(nc, "test", "test-queue", 4)
    await responder.serve(Route(SUBJECT, msgspec.json.Decoder(Ask), timed_out, REFUSALS))
    await nc.flush()
    reply = await _ask(nc, b'{"n": 9}')
    assert reply.status == "busy" and reply.retry_after_s == UNAVAILABLE_RETRY_AFTER_S, reply
    assert "JetStream did not answer the test in time (TimeoutError)" in reply.detail
    assert responder.refused.get(subject=SUBJECT, reason="unavailable") == 1
    await responder.drain(5.0)


async def test_item10_a_request_over_the_routes_bound_is_refused_unread_with_its_size(
    nc: NatsClient,
) -> None:
    held = HeldAnswers()
    held.release.set()
    responder = Responder(nc, "test", "test-queue", 4)
    worded = Refusals[Answer](
        malformed=REFUSALS.malformed,
        busy=REFUSALS.busy,
        failed=REFUSALS.failed,
        too_large=lambda why: Answer(status="too-large", detail=why),
    )
    decoder = msgspec.json.Decoder(Ask)
    await responder.serve(Route(SUBJECT, decoder, held.answer, worded, max_bytes=64))
    # Without its own wording, a route says it with the malformed one.
    await responder.serve(Route(SUBJECT + "2", decoder, held.answer, REFUSALS, max_bytes=64))
    await nc.flush()
    padded = b'{"n": 1' + b" " * 100 + b"}"  # valid, only too long
    reply = await _ask(nc, padded)
    assert reply.status == "too-large", reply
    assert reply.detail == (
        f"the request is {len(padded)} bytes, over the 64 bytes the test reads on "
        f"{SUBJECT}: send a smaller one"
    )
    # Refused before it is decoded: garbage that long is not answered malformed.
    assert (await _ask(nc, b"x" * 65)).status == "too-large"
    assert held.started == 0
    assert responder.refused.get(subject=SUBJECT, reason="too-large") == 2
    answer = await nc.request(SUBJECT + "2", padded, timeout=5.0)
    assert _decode(answer.data).status == "malformed"
    assert await _ask(nc, b'{"n": 2}') == Answer(status="ok", n=2)
    await responder.drain(5.0)


async def test_item10_a_request_the_routes_check_refuses_gets_that_refusal_not_the_handler(
    nc: NatsClient,
) -> None:
    held = HeldAnswers()
    held.release.set()

    def odd_only(_: object, ask: Ask) -> Answer | None:
        return None if ask.n % 2 else Answer(status="refused", detail=f"{ask.n} is even")

    responder = Responder(nc, "test", "test-queue", 4)
    route = Route(SUBJECT, msgspec.json.Decoder(Ask), held.answer, REFUSALS, check=odd_only)
    await responder.serve(route)
    await nc.flush()
    assert await _ask(nc, b'{"n": 4}') == Answer(status="refused", detail="4 is even")
    assert held.started == 0
    assert responder.refused.get(subject=SUBJECT, reason="invalid") == 1
    assert await _ask(nc, b'{"n": 3}') == Answer(status="ok", n=3)
    await responder.drain(5.0)
