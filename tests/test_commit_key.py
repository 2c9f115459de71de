"""The idempotency key is enforced by the put-if-absent header on the result's subject
(``Nats-Expected-Last-Subject-Sequence: 0``), not by the ``Nats-Msg-Id``: the message id
only dedupes inside the stream's duplicate window, the key must hold for as long as the
record is kept (docs/commit.md, step 3)."""

from __future__ import annotations

import dataclasses

import pytest
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.lease_client import LeaseClient
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import grant_fence, order_for, report
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

# Short enough to wait out in a test; the product's window is at least 120 s.
WINDOW_S = 1.0
WAIT_S = 10 * WINDOW_S + 10


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """A lease TTL that outlasts the wait for the window, so B still holds its job."""
    return make_settings(
        nats_url, redis_url, {"demo": sim_target(simulator)}, lease_ttl_s=WAIT_S + 20
    )


async def shrink_duplicate_window(nc: NatsClient) -> None:
    js = nc.jetstream()
    config = (await js.stream_info(subjects.STREAM_RESULTS)).config
    await js.update_stream(dataclasses.replace(config, duplicate_window=WINDOW_S))


PROBE_SUBJECT = "jf.results.window-probe.probe"
PROBE_ID = "window-probe"


async def publish_probe(nc: NatsClient) -> bool:
    """Publish the window probe; whether the stream stored it, i.e. had forgotten its
    message id. Sent first just after the commit, it is forgotten no sooner than the
    commit's own, older, id. (It cannot probe the key's subject itself: this server runs
    the put-if-absent check before the duplicate check.)"""
    ack = await nc.jetstream().publish(PROBE_SUBJECT, b"probe", headers={"Nats-Msg-Id": PROBE_ID})
    return not ack.duplicate


async def test_a_second_commit_of_a_key_after_the_duplicate_window_is_suppressed(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    await shrink_duplicate_window(nc)
    client = LeaseClient(nc)
    # Two jobs, one unit of work: both granted (nothing is committed yet).
    first = order_for(settings, "/page/1", idempotency_key="k-1")
    second = order_for(settings, "/page/1", idempotency_key="k-1")
    assert first.key == second.key
    f1 = await grant_fence(client, first, "A")
    f2 = await grant_fence(client, second, "B")
    assert (await report(nc, first, f1, "A")).status == "committed"
    assert await publish_probe(nc)

    await wait_for(
        lambda: publish_probe(nc),
        WAIT_S,
        "the results stream to forget the commit's message id",
    )
    answer = await report(nc, second, f2, "B")
    assert (answer.status, answer.committed_by) == ("suppressed:duplicate-key", first.job.id)

    records = [r async for r in iter_results(nc.jetstream(), first.target)]
    assert [(r.job_id, r.key) for r in records] == [(first.job.id, first.key)]
    subject = subjects.result_key(first.target, first.key)
    assert await count_messages(nc.jetstream(), subjects.STREAM_RESULTS, subject) == 1
