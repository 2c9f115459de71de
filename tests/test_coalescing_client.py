"""The write-coalescing NATS client (jetfleet/coalescing_client.py) keeps nats-py's
flusher contract: every publish reaches the server, ``flush()`` returns once written,
requests are answered; and what one loop pass publishes goes out in a few writes."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetfleet.coalescing_client import CoalescingClient
from jetfleet.event_loop import loop_factory
from jetfleet.settings import Settings
from tests.conftest import wait_for


async def test_every_publish_of_one_pass_arrives_in_a_few_writes(
    nc: NatsClient, settings: Settings
) -> None:
    assert isinstance(nc, CoalescingClient)
    got: list[bytes] = []

    async def keep(msg: Msg) -> None:
        got.append(msg.data)

    listener = await nc.subscribe("tests.coalesce", cb=keep)
    await nc.flush()
    before = nc.write_count
    await asyncio.gather(*(nc.publish("tests.coalesce", str(n).encode()) for n in range(2000)))
    await nc.flush()  # returns once every publish before it is written

    async def all_in() -> bool:
        return len(got) == 2000

    await wait_for(all_in, 10.0, "2000 publishes to arrive")
    assert sorted(int(d) for d in got) == list(range(2000))
    # 2000 publishes in one pass, plus the flush's ping: a handful of writes, not 2000.
    assert nc.write_count - before <= 5
    await listener.unsubscribe()


async def test_a_publish_made_while_a_write_drains_is_written_too(nc: NatsClient) -> None:
    got: list[bytes] = []

    async def keep(msg: Msg) -> None:
        got.append(msg.data)

    listener = await nc.subscribe("tests.trickle", cb=keep)
    await nc.flush()
    # One publish per loop pass, never two in the same one: each must still be written
    # without a later publish to carry it.
    for n in range(50):
        await nc.publish("tests.trickle", str(n).encode())
        await asyncio.sleep(0)

    async def all_in() -> bool:
        return len(got) == 50

    await wait_for(all_in, 10.0, "50 trickled publishes to arrive")
    await listener.unsubscribe()


async def test_requests_are_answered_concurrently(nc: NatsClient) -> None:
    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    responder = await nc.subscribe("tests.echo", cb=echo)
    await nc.flush()
    replies = await asyncio.gather(
        *(nc.request("tests.echo", str(n).encode(), timeout=5.0) for n in range(300))
    )
    assert [r.data for r in replies] == [str(n).encode() for n in range(300)]
    await responder.unsubscribe()


def test_the_asyncio_choice_uses_asyncio_s_loop() -> None:
    assert loop_factory("asyncio") is None
    factory = loop_factory("auto")
    assert factory is not None  # uvloop is a dependency on Linux
    loop = factory()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


async def test_requests_get_their_own_answers_time_out_and_cancel_as_nats_pys_do(
    nc: NatsClient,
) -> None:
    assert isinstance(nc, CoalescingClient)

    async def echo(msg: Msg) -> None:
        # Answered out of order: each reply must reach the request that asked.
        await asyncio.sleep(0.001 * (int(msg.data) % 7))
        await msg.respond(b"re:" + msg.data)

    responder = await nc.subscribe("tests.echo", cb=echo)
    await nc.flush()
    answers = await asyncio.gather(
        *(nc.request("tests.echo", str(n).encode(), timeout=5) for n in range(500))
    )
    assert [a.data for a in answers] == [b"re:%d" % n for n in range(500)]
    with pytest.raises(NoRespondersError):
        await nc.request("tests.nobody", b"x", timeout=5)
    # No timeout: waits for the answer, as nats-py's wait_for(future, None) does.
    untimed = await nc._request_new_style("tests.echo", b"9", timeout=None)
    assert untimed.data == b"re:9"

    async def silent(msg: Msg) -> None:
        return None

    mute = await nc.subscribe("tests.silent", cb=silent)
    await nc.flush()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NatsTimeoutError):
        await nc.request("tests.silent", b"x", timeout=0.3)
    assert 0.25 <= loop.time() - started < 3.0
    asking = asyncio.create_task(nc.request("tests.silent", b"x", timeout=30))

    async def asked() -> bool:
        return bool(nc._resp_map)

    await wait_for(asked, 5.0, "the request to be pending")
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    # Nothing is left waiting: answered, timed-out and cancelled requests are all gone.
    assert nc._resp_map == {}
    await responder.unsubscribe()
    await mute.unsubscribe()
