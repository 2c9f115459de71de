"""A connection whose URL carries its user keeps working when its seed node dies.

nats-py presents a URL's user only to that URL's server; servers it learns from the
cluster are added without one. A process given one seed (``nats://user:pw@node-1``) whose
node then goes away could reconnect only to those, and each refused it ("Authorization
Violation"), for as long as the seed stayed down. ``connect_nats`` gives the URL's user
to every server (jetfleet/connection.py).
"""

from __future__ import annotations

import asyncio

import pytest

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
            # The session's own user, on a node the client only learned of.
            reply = await nc.request("$JS.API.INFO", b"", timeout=10)
            assert b"jetstream" in reply.data or b"memory" in reply.data, reply.data
        finally:
            await asyncio.to_thread(nats_cluster.restart, 0, 30.0)
    finally:
        await nc.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])
