"""Running the tests against servers a user named (``NATS_URL``, ``REDIS_URL``) without
touching the user's data.

- Redis: the tests use database ``TEST_REDIS_DB`` of that server, never the database in
  the URL. They flush it between tests, so they claim it first: it must be empty or carry
  the tests' marker key (left by an earlier run). Anything else is somebody's data, and
  the tests refuse to run.
- NATS: jetfleet's stream and bucket names are fixed, so the tests cannot have streams
  of their own beside a real fleet's. Each test therefore starts only on a server with no
  jetfleet streams or buckets at all (refusing otherwise, naming what it found) and
  deletes the ones it created when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import nats
import pytest
import redis.asyncio as aioredis
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

TEST_REDIS_DB = 15
REDIS_MARKER = "jetfleet-tests:this-database-belongs-to-the-tests"
# Streams behind jetfleet's streams (JF_*), KV buckets (KV_jf-*) and object stores.
JETFLEET_STREAM = re.compile(r"JF_.*|KV_jf-.*|OBJ_jf-.*")


def redis_test_url(url: str) -> str:
    """``url`` with its database replaced by the tests' own (``TEST_REDIS_DB``)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"]
    if parts.scheme == "unix":
        query.append(("db", str(TEST_REDIS_DB)))
        # urlunsplit would drop the empty host and its "//".
        return f"unix://{parts.netloc}{parts.path}?{urlencode(query)}"
    return urlunsplit(parts._replace(path=f"/{TEST_REDIS_DB}", query=urlencode(query)))


async def claim_redis_db(url: str) -> None:
    """Make the tests' database on the server of ``url`` theirs, or fail saying why."""
    client = aioredis.from_url(url)
    try:
        try:
            size = await client.dbsize()
        except aioredis.ResponseError as exc:
            pytest.fail(
                f"REDIS_URL: the tests use database {TEST_REDIS_DB} of that server and "
                f"cannot select it ({exc}); unset REDIS_URL and they start a redis-server "
                "of their own",
                pytrace=False,
            )
        if size and not await client.exists(REDIS_MARKER):
            pytest.fail(
                f"REDIS_URL: database {TEST_REDIS_DB} of that server holds {size} key(s) the "
                "tests did not write; they flush the database they use, so they will not "
                f"use this one. Empty database {TEST_REDIS_DB} or unset REDIS_URL.",
                pytrace=False,
            )
        await client.set(REDIS_MARKER, "1")
    finally:
        await client.aclose()


async def flush_test_db(client: aioredis.Redis) -> None:
    """Empty the tests' database, keeping it marked as theirs."""
    await client.flushdb()
    await client.set(REDIS_MARKER, "1")


async def _jetfleet_names(js: JetStreamContext) -> list[str]:
    names = [info.config.name or "" for info in await js.streams_info()]
    return sorted(name for name in names if JETFLEET_STREAM.fullmatch(name))


async def jetfleet_streams(url: str) -> list[str]:
    """The jetfleet streams and buckets on the NATS server at ``url``."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        return await _jetfleet_names(nc.jetstream())
    finally:
        await nc.close()


async def refuse_a_used_nats(url: str) -> None:
    """Fail the test if the server at ``url`` already has jetfleet streams or buckets."""
    found = await jetfleet_streams(url)
    if found:
        pytest.fail(
            f"NATS_URL={url} already has jetfleet streams or buckets {found} that this "
            "test did not create. The tests delete what they create, so they will not run "
            "beside them: unset NATS_URL (the tests start their own nats-server) or point "
            "it at a server for tests only. If an interrupted test run left them, delete "
            "them (nats stream rm).",
            pytrace=False,
        )


async def remove_test_streams(url: str) -> None:
    """Delete the jetfleet streams and buckets a test created on the server at ``url``."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        for name in await _jetfleet_names(js):
            with contextlib.suppress(NotFoundError):  # gone already
                await js.delete_stream(name)
    finally:
        await nc.close()


def blocking(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to its end from sync code (on a thread: no running loop is borrowed)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, work).result()


@contextlib.contextmanager
def user_nats(url: str) -> Iterator[str]:
    """One test's use of the user's server at ``url``: refused if it has jetfleet streams
    already, and every jetfleet stream gone again when the test ends."""
    blocking(refuse_a_used_nats(url))
    try:
        yield url
    finally:
        blocking(remove_test_streams(url))
