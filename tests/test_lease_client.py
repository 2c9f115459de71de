"""What the worker makes of the leaser's answers to renew and release: only
``lease-lost`` means the lease is gone; a leaser that failed or did not answer leaves
it unknown, so a passing error does not cancel a healthy job. A stand-in leaser answers
on a real nats-server, so each answer can be chosen."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas.lease import LEASE_LOST, LeaseGrant, LeaseRefusal, LeaseReply
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.lease_client import LeaseClient


async def _answering(nc: NatsClient, reply: LeaseReply) -> None:
    async def answer(msg: Msg) -> None:
        await nc.publish(msg.reply, msgspec.json.encode(reply))

    await nc.subscribe(subjects.LEASE, queue=subjects.QUEUE_LEASER, cb=answer)
    await nc.flush()


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (LeaseGrant(fence=7, ttl_s=30.0), True),
        (LeaseRefusal(reason=LEASE_LOST), False),
        (LeaseRefusal(reason="leaser-error", retry_after_s=1.0, detail="timeout"), None),
    ],
)
async def test_renew_and_release_read_only_lease_lost_as_lost(
    nc: NatsClient, reply: LeaseReply, expected: bool | None
) -> None:
    await _answering(nc, reply)
    client = LeaseClient(nc)
    assert await client.renew("job-1", 7) is expected
    assert await client.release("job-1", 7) is expected


async def test_no_leaser_leaves_the_lease_unknown(nc: NatsClient) -> None:
    client = LeaseClient(nc)
    assert await client.renew("job-1", 7) is None
    assert await client.release("job-1", 7) is None
