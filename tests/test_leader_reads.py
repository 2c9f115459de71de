"""Item 8 of issue 8: the reads a safety decision rests on are answered by the stream
leader, never by a replica that may lag it.

A direct get (``$JS.API.DIRECT.GET``) may be answered by any replica of the stream; a
message get (``$JS.API.STREAM.MSG.GET``) only by its leader. A wire watcher on the real
server sees which one each read of a grant, a commit and a dead letter used.
"""

from __future__ import annotations

from collections import Counter

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings
from tests.leasing import ask, granted, order_for, refused, report, report_failure
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

READ_ON_THIS_PATH = {
    f"KV_{subjects.BUCKET_LEASES}",
    f"KV_{subjects.BUCKET_FENCES}",
    subjects.STREAM_RESULTS,
}
"""What grants and commits read: the live lease, the job's history, the key's result. A
dead job is answered from its seal in the history: no grant reads JF_DLQ."""
SAFETY_STREAMS = {*READ_ON_THIS_PATH, subjects.STREAM_DLQ}
"""Never read by direct get where a decision rests on it (the backstop reads JF_DLQ)."""


async def test_item8_fence_lease_committed_and_dead_letter_reads_go_to_the_stream_leader(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    direct: Counter[str] = Counter()
    leader: Counter[str] = Counter()

    async def seen(msg: Msg) -> None:
        tokens = msg.subject.split(".")
        if tokens[2] == "DIRECT":
            direct[tokens[4]] += 1
        else:
            leader[tokens[5]] += 1

    watchers = [
        await nc.subscribe("$JS.API.DIRECT.GET.>", cb=seen),
        await nc.subscribe("$JS.API.STREAM.MSG.GET.>", cb=seen),
    ]
    await nc.flush()
    client = LeaseClient(nc)
    done, dead = order_for(settings, "/page/81"), order_for(settings, "/page/82")
    fence = (await granted(client, ask(done, worker="w-a"))).fence
    assert (await report(nc, done, fence, "w-a")).status == "committed"
    fence = (await granted(client, ask(dead, worker="w-a"))).fence
    assert (await report_failure(nc, dead, fence, "w-a")).status == "dead-lettered"
    # The lost ack and the lost term: the next grants meet the settled jobs.
    assert (await client.grant(ask(done, worker="w-b"))) is not None
    assert (await refused(client, ask(dead, worker="w-b"))).reason == "dead-lettered"
    await nc.flush()
    for watcher in watchers:
        await watcher.unsubscribe()

    stale = {stream: n for stream, n in direct.items() if stream in SAFETY_STREAMS}
    assert stale == {}, f"safety reads answered by any replica (direct gets): {stale}"
    assert set(leader) >= READ_ON_THIS_PATH, f"leader reads seen: {dict(leader)}"
