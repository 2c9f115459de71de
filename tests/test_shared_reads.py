"""The dashboard's shared reads: one computation serves concurrent and recent requests;
a failure reaches every waiter and is not kept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from jetfleet.services.gateway.shared_reads import SharedReads


async def test_concurrent_requests_wait_for_one_computation_and_a_failure_is_not_kept() -> None:
    shared = SharedReads(fresh_s=60.0)
    release = asyncio.Event()
    calls = 0

    async def failing() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        await release.wait()
        raise RuntimeError("NATS away")

    waiters = [asyncio.ensure_future(shared.get("k", failing)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert calls == 1 and all(isinstance(r, RuntimeError) for r in results)

    async def answering() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"n": calls}

    assert await shared.get("k", answering) == {"n": 2}  # tried again, not the failure
    assert await shared.get("k", answering) == {"n": 2}  # fresh: served again
    assert shared.computed == 1


async def test_one_waiter_cancelled_does_not_cancel_the_others() -> None:
    shared = SharedReads()
    release = asyncio.Event()

    async def slow() -> dict[str, Any]:
        await release.wait()
        return {"ok": True}

    first = asyncio.ensure_future(shared.get("k", slow))
    second = asyncio.ensure_future(shared.get("k", slow))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert await second == {"ok": True}
    with pytest.raises(asyncio.CancelledError):
        await first
