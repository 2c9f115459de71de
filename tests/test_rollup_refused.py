"""Every KV bucket and the result object store refuse ``Nats-Rollup`` (docs/security.md).

nats-server grants publishes by subject, not header, so a role allowed one key or chunk
subject could otherwise empty a whole bucket with a rollup. A deployment declared before
this must get it from ``jetfleet topology apply``.
"""

from __future__ import annotations

import dataclasses

import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError

from jetfleet import subjects
from jetfleet.settings import Settings
from jetfleet.topology import bucket_ttls, declare


def _backing_streams(settings: Settings) -> list[str]:
    return [f"KV_{b}" for b in bucket_ttls(settings)] + [f"OBJ_{subjects.OBJECTS_RESULTS}"]


async def _allow_rollups(js: JetStreamContext, stream: str) -> None:
    """Put a stream back as nats-py makes it (as an older jetfleet left it)."""
    config = (await js.stream_info(stream)).config
    await js.update_stream(dataclasses.replace(config, allow_rollup_hdrs=True))


async def test_topology_apply_turns_rollups_off_on_an_older_deployment(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    streams = _backing_streams(settings)
    for stream in streams:
        assert not (await js.stream_info(stream)).config.allow_rollup_hdrs
        await _allow_rollups(js, stream)
    control = await js.key_value(subjects.BUCKET_CONTROL)
    await control.put("rollup-victim", b"kept")

    found = await declare(js, settings)  # `jetfleet topology show`: reports, changes nothing
    assert sorted(d.what for d in found if d.field == "allow_rollup_hdrs") == sorted(
        f"stream {s}" for s in streams
    )
    for stream in streams:
        assert (await js.stream_info(stream)).config.allow_rollup_hdrs

    await declare(js, settings, update=True)  # `jetfleet topology apply`
    for stream in streams:
        assert not (await js.stream_info(stream)).config.allow_rollup_hdrs
    with pytest.raises(APIError, match="rollup not permitted"):
        await js.publish(f"$KV.{subjects.BUCKET_CONTROL}.x", b"", headers={"Nats-Rollup": "all"})
    assert (await control.get("rollup-victim")).value == b"kept"
    assert not [d for d in await declare(js, settings) if d.field == "allow_rollup_hdrs"]


async def test_keys_are_still_put_created_updated_deleted_and_watched(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    watcher = await control.watch("rollup-check.>")
    try:
        revision = await control.create("rollup-check.a", b"1")
        revision = await control.update("rollup-check.a", b"2", last=revision)
        await control.put("rollup-check.b", b"3")
        await control.delete("rollup-check.a", last=revision)
        # Read back by key, not through kv.keys(): its watcher can end before the first
        # key under concurrent writes (nats.py issue 842; it failed a loaded CI run here).
        assert (await control.get("rollup-check.b")).value == b"3"
        with pytest.raises(KeyNotFoundError):  # deleted: nats-py says not found
            await control.get("rollup-check.a")
        seen = []
        async for entry in watcher:
            if entry is not None:
                seen.append(entry.key)
                if entry.key == "rollup-check.b":
                    break
        assert seen == ["rollup-check.a", "rollup-check.a", "rollup-check.b"]
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py is untyped here
