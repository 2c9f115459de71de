"""The tests never touch a user's data: with REDIS_URL set they use a database of their
own on that server, and with NATS_URL set they refuse a server that already has jetfleet
streams and delete only what they created (tests/user_servers.py)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

from jetfleet.settings import Settings
from jetfleet.topology import declare
from tests.user_servers import (
    REDIS_MARKER,
    TEST_REDIS_DB,
    claim_redis_db,
    jetfleet_streams,
    redis_test_url,
    refuse_a_used_nats,
    remove_test_streams,
    user_nats,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6390", "redis://127.0.0.1:6390/15"),
        ("redis://127.0.0.1:6390/0", "redis://127.0.0.1:6390/15"),
        ("redis://:pw@cache.example:6390/3?db=4&ssl_cert_reqs=none",
         "redis://:pw@cache.example:6390/15?ssl_cert_reqs=none"),
        ("rediss://cache.example/0", "rediss://cache.example/15"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=15"),
    ],
)  # fmt: skip
def test_the_tests_redis_database_is_never_the_one_the_url_names(url: str, expected: str) -> None:
    assert redis_test_url(url) == expected


async def test_the_redis_fixtures_use_the_tests_database_not_database_0(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    assert redis_url.endswith(f"/{TEST_REDIS_DB}")
    assert redis_client.connection_pool.connection_kwargs["db"] == TEST_REDIS_DB
    assert await redis_client.exists(REDIS_MARKER)  # flushed, and still marked as the tests'


async def test_a_redis_database_holding_someone_elses_keys_is_refused_and_left_alone(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    await redis_client.delete(REDIS_MARKER)
    await redis_client.set("orders:42", "a user's data")
    try:
        with pytest.raises(pytest.fail.Exception, match=f"database {TEST_REDIS_DB}.*1 key"):
            await claim_redis_db(redis_url)
        assert await redis_client.get("orders:42") == b"a user's data"
        assert not await redis_client.exists(REDIS_MARKER)
    finally:
        await redis_client.delete("orders:42")
    await claim_redis_db(redis_url)  # empty now: the tests may take it
    assert await redis_client.exists(REDIS_MARKER)


async def test_a_nats_with_jetfleet_streams_is_refused_and_only_jetfleets_are_removed(
    nats_url: str, nc: NatsClient
) -> None:
    """``nc`` declared the topology, as a running fleet would have."""
    js = nc.jetstream()
    bystander = "JETFLEET_TESTS_BYSTANDER"  # a stream of the user's own, not jetfleet's
    await js.add_stream(js_api.StreamConfig(name=bystander, subjects=["bystander.>"]))
    try:
        declared = await jetfleet_streams(nats_url)
        assert {"JF_WORK", "JF_RESULTS", "KV_jf-leases", "KV_jf-fences"} <= set(declared)
        with pytest.raises(pytest.fail.Exception, match="already has jetfleet streams"):
            await refuse_a_used_nats(nats_url)

        await remove_test_streams(nats_url)
        assert await jetfleet_streams(nats_url) == []
        assert bystander in [s.config.name for s in await js.streams_info()]
        await refuse_a_used_nats(nats_url)  # nothing of jetfleet's left: no refusal
    finally:
        await js.delete_stream(bystander)


async def test_a_test_on_the_users_nats_is_refused_beside_jetfleet_streams_and_cleans_up(
    nats_url: str, nc: NatsClient, settings: Settings
) -> None:
    """What the ``nats_url`` fixture does with NATS_URL set, on this test's server."""
    with (
        pytest.raises(pytest.fail.Exception, match="already has jetfleet streams"),
        user_nats(nats_url),
    ):
        raise AssertionError("a test ran beside a fleet's streams")
    assert await jetfleet_streams(nats_url) != []  # refused: nothing of theirs touched

    await remove_test_streams(nats_url)
    with user_nats(nats_url):
        await declare(nc.jetstream(), settings)  # what a test creates
        assert await jetfleet_streams(nats_url) != []
    assert await jetfleet_streams(nats_url) == []
