"""A connection whose URL carries its user keeps working when its seed node dies.

nats-py presents a URL's user only to that URL's server; servers it learns from the
cluster are added without one. A process given one seed (``nats://user:pw@node-1``) whose
node then goes away could reconnect only to those, and each refused it ("Authorization
Violation"), for as long as the seed stayed down. ``connect_nats`` gives the URL's user
to every server (jetfleet/connection.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet.auth.bundle import Bundle
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.settings import NatsSettings
from tests.conftest import admin_url, wait_for

pytestmark = pytest.mark.timeout(90)


async def test_a_connection_given_one_seed_with_its_user_reconnects_to_another_node(
    nats_cluster: EmbeddedCluster, auth_bundle: Bundle | None
) -> None:
    if auth_bundle is None:  # NATS_URL/REDIS_URL set: the session's servers have no users
        pytest.skip("needs the session's auth (the cluster has no users without it)")
    seed = nats_cluster.nodes[0]
    nc = await connect_nats(NatsSettings(url=admin_url(seed.url)), "one-seed")
    try:
        await nc.flush(5)
        assert nc.connected_url is not None and nc.connected_url.port == _port(seed.url)
        await asyncio.to_thread(nats_cluster.kill, 0)
        try:

            async def on_another_node() -> bool:
                url = nc.connected_url
                return nc.is_connected and url is not None and url.port != _port(seed.url)

            await wait_for(on_another_node, 30.0, "a reconnect to a node other than the seed")
            # The session's own user, on a node the client only learned of: a round trip
            # through the server (core NATS: JetStream may still be electing a leader).
            echo = await nc.subscribe("one-seed.echo", cb=_echo(nc))
            reply = await nc.request("one-seed.echo", b"ping", timeout=10)
            assert reply.data == b"ping"
            await echo.unsubscribe()
        finally:
            await asyncio.to_thread(nats_cluster.restart, 0, 30.0)
    finally:
        await nc.close()


def _echo(nc: NatsClient) -> Callable[[Msg], Awaitable[None]]:
    async def answer(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    return answer


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])
