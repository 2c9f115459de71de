"""A worker's ack survives a consumer election (jetfleet/worker/settle_confirm.py).

On a 3-node cluster, deliveries of an R3 work-queue consumer are acked right after the
node leading the consumer is SIGKILLed: a plain ``+ACK`` sent then reaches no consumer
and is dropped (the messages stay pending until ack_wait, then are delivered again). The
worker's confirmed settles are answered by the new leader once it is elected, so no
message stays pending and none is delivered again.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig

from jetfleet.connection import connect_nats
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.settings import NatsSettings
from jetfleet.worker.ack_timer import AckTimer
from jetfleet.worker.settle_confirm import SettleConfirmations
from tests.conftest import admin_url, wait_for

pytestmark = pytest.mark.timeout(120)

ACK_WAIT_S = 60.0
JOBS = 20


async def test_acks_sent_while_the_consumer_has_no_leader_are_taken_once_it_has_one(
    nats_cluster: EmbeddedCluster,
) -> None:
    # jetfleet's own connection: it presents the URL's user to every node, also to those
    # it learns from the cluster (a plain nats.connect is refused by those on reconnect).
    nc = await connect_nats(NatsSettings(url=admin_url(nats_cluster.url)), "settle-test")
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name="SETTLE",
                subjects=["settle.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                num_replicas=3,
            )
        )
        await js.add_consumer(
            "SETTLE",
            ConsumerConfig(durable_name="w", ack_wait=ACK_WAIT_S, num_replicas=3),
        )
        for n in range(JOBS):
            await js.publish("settle.job", str(n).encode())
        sub = await js.pull_subscribe_bind("w", "SETTLE")
        msgs: list[Msg] = []
        while len(msgs) < JOBS:  # a fetch may hand over fewer than asked for
            msgs += await sub.fetch(JOBS - len(msgs), timeout=10)
        leader = (await js.consumer_info("SETTLE", "w")).cluster
        assert leader is not None and leader.leader
        killed = nats_cluster.node_named(leader.leader).index
        await asyncio.to_thread(nats_cluster.kill, killed)
        try:
            stats: Counter[str] = Counter()
            settles = SettleConfirmations(nc, stats)
            for msg in msgs:
                settles.send(msg, b"", AckTimer(ACK_WAIT_S))

            async def all_answered() -> bool:
                return stats["ack-confirmed"] + stats["ack-unconfirmed"] == JOBS

            await wait_for(all_answered, 60.0, "every ack confirmed or given up")
            assert stats["ack-confirmed"] == JOBS, stats
            # Some were sent while no node led the consumer: they were sent again.
            assert stats["ack-resent"] > 0, stats

            async def consumer_info_read() -> bool:
                try:
                    info = await js.consumer_info("SETTLE", "w")
                except Exception:  # the new leader's first answers
                    return False
                consumer_info_read.pending = info.num_ack_pending  # type: ignore[attr-defined]
                return True

            await wait_for(consumer_info_read, 30.0, "the consumer's info")
            assert consumer_info_read.pending == 0  # type: ignore[attr-defined]
        finally:
            await asyncio.to_thread(nats_cluster.restart, killed, 30.0)
            await js.delete_stream("SETTLE")
    finally:
        await nc.close()
