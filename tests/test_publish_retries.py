"""publish_durably rides out a stream without a leader for longer than a leader election
takes, and gives up, saying so, only after its time budget (a real nats-server)."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import StreamConfig

from jetfleet.errors import SubmitError
from jetfleet.publish import publish_durably

# Beyond the ~5.1 s of waits after which the earlier budget of six tries gave up, and
# within an election's 4-9 s.
LEADERLESS_S = 6.0


async def test_a_publish_is_stored_once_when_its_stream_answers_only_after_six_seconds(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        began = time.monotonic()
        # No stream listens yet: every try gets "no responders", as in an election.
        publishing = asyncio.ensure_future(
            publish_durably(js, "late.x", b"1", msg_id="late-1", timeout_s=1.0)
        )
        await asyncio.sleep(LEADERLESS_S)  # the leaderless time itself, not a wait for a condition
        assert not publishing.done(), publishing
        await js.add_stream(StreamConfig(name="LATE", subjects=["late.>"]))
        ack = await asyncio.wait_for(publishing, 10.0)
        assert ack.stream == "LATE" and not ack.duplicate
        assert (await js.stream_info("LATE")).state.messages == 1
        assert time.monotonic() - began >= LEADERLESS_S
    finally:
        await nc.close()


async def test_a_publish_gives_up_after_its_budget_naming_it(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        began = time.monotonic()
        with pytest.raises(SubmitError, match=r"nowhere\.x within 0\.5 s \(\d+ tries\)"):
            await publish_durably(nc.jetstream(), "nowhere.x", b"1", None, retry_for_s=0.5)
        assert time.monotonic() - began < 2.0
    finally:
        await nc.close()
