"""publish_durably rides out a stream without a leader for longer than a leader election
takes, gives up, saying so, only after its time budget, and turns a repeat racing its
own first try on a replicated stream into that try's ack (real nats-servers)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import PubAck, StreamConfig

from jetfleet import publish, subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.errors import SubmitError
from jetfleet.js_publish import publish_js
from jetfleet.publish import publish_durably
from jetfleet.settings import NatsSettings
from jetfleet.topology import declare
from tests.conftest import admin_url, make_settings
from tests.queueing.helpers import target

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


async def test_repeats_of_one_message_id_racing_on_a_replicated_stream_all_get_its_ack(
    nats_cluster: EmbeddedCluster,
) -> None:
    # On an R3 stream a repeat that arrives while the first copy is being replicated is
    # refused with 10158 ("duplicate message id is in process"), as a retry after a lost
    # PubAck is during an election; it must be tried again, not fail the caller.
    nc = await connect_nats(NatsSettings(url=admin_url(nats_cluster.url)), "race-test")
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="RACE", subjects=["race.>"], num_replicas=3))
        for n in range(10):
            acks = await asyncio.gather(
                *(publish_durably(js, "race.x", b"1", msg_id=f"race-{n}") for _ in range(3))
            )
            assert len({a.seq for a in acks}) == 1, acks
            assert sum(not a.duplicate for a in acks) == 1, acks
        assert (await js.stream_info("RACE")).state.messages == 10
    finally:
        await nc.close()


async def test_a_submission_whose_first_answer_was_lost_is_published_not_a_duplicate(
    nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = target("http://127.0.0.1:9/")
    settings = make_settings(nats_url, redis_url, {"demo": sim, "news": sim})
    nc = await nats.connect(nats_url)
    lose_next = [True]

    async def answer_lost(*args: Any, **kwargs: Any) -> PubAck:
        ack = await publish_js(*args, **kwargs)  # stored (or refused) by the real server
        if lose_next[0]:
            lose_next[0] = False
            raise NatsTimeoutError  # ... and its answer lost on the way back
        return ack

    try:
        js = nc.jetstream()
        await declare(js, settings)
        monkeypatch.setattr(publish, "publish_js", answer_lost)
        [job] = jobs_for("demo", settings, ["/a"])
        [first] = await submit_jobs(js, settings, "demo", [job])
        # Its own first try was stored: the retry's duplicate answer is that try's.
        assert (first.published, first.duplicate) == (True, False)
        assert (await js.stream_info(subjects.STREAM_SUBMIT)).state.messages == 1
        # The same job submitted again is a duplicate, lost answer or not ...
        [again] = await submit_jobs(js, settings, "demo", [job])
        assert (again.published, again.duplicate) == (False, True)
        # ... and so is other work under the same id whose (refused) try went unanswered.
        lose_next[0] = True
        [other] = jobs_for("demo", settings, ["/b"])
        other = msgspec.structs.replace(other, id=job.id)
        [clash] = await submit_jobs(js, settings, "demo", [other])
        assert not lose_next[0]  # its first answer was lost
        assert (clash.published, clash.duplicate) == (False, True)
        # ... and the same bytes under the same id for another target: not stored there.
        lose_next[0] = True
        [elsewhere] = await submit_jobs(js, settings, "news", [job])
        assert not lose_next[0]
        assert (elsewhere.published, elsewhere.duplicate) == (False, True)
        assert (await js.stream_info(subjects.STREAM_SUBMIT)).state.messages == 1
    finally:
        await nc.close()
