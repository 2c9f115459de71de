"""Stopping a task whose cancel a library swallows: nats-py's ``request`` awaits its
reply with ``asyncio.wait_for``, which on Python 3.11 returns the reply and drops a
cancel that lands as the reply does (CPython gh-86296). The worker's lease keeper, so
cancelled after a job's commit, went on renewing: the lease stayed live, +WPI kept the
delivery from redelivering, the ack never came (the demo saw a committed job counted as
leased too, ``lost -1``)."""

from __future__ import annotations

import asyncio

from jetfleet.task_stop import raise_if_cancel_dropped, stop_task


async def test_a_task_whose_first_cancel_is_swallowed_by_wait_for_is_still_stopped() -> None:
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[asyncio.Future[bool]] = asyncio.Queue()
    rounds = 0

    async def keeper() -> None:
        # A renewal loop as the lease keeper runs it: one request after another.
        nonlocal rounds
        while True:
            reply = loop.create_future()
            await replies.put(reply)
            await asyncio.wait_for(reply, 5.0)  # as nats-py's request does
            rounds += 1

    task = asyncio.create_task(keeper())
    reply = await replies.get()
    await asyncio.sleep(0)  # the keeper is now inside wait_for
    # The reply lands and the cancel comes in the same turn of the loop.
    reply.set_result(True)
    stopping = asyncio.create_task(stop_task(task))
    # Answer whatever the keeper asks next, as the leaser would.
    answering = asyncio.create_task(_answer(replies))
    # asyncio.wait, not a timeout around the await: cancelling the waiter would cancel
    # the task a second time and hide a stop that never ends.
    finished, _ = await asyncio.wait({stopping}, timeout=5.0)
    answering.cancel()
    assert stopping in finished, f"the task ran on through {rounds} renewals after its cancel"
    assert task.cancelled()


async def _answer(replies: asyncio.Queue[asyncio.Future[bool]]) -> None:
    while True:
        reply = await replies.get()
        asyncio.get_running_loop().call_later(0.01, _answered, reply)


def _answered(reply: asyncio.Future[bool]) -> None:
    if not reply.done():
        reply.set_result(True)


async def test_a_loop_that_checks_for_a_dropped_cancel_stops_at_its_next_round() -> None:
    # The lease keeper's way: each round asks whether a cancel was dropped, so it stops
    # at once, not whenever a resend happens to land between replies (resends here come
    # only after 60 s, so only the first cancel can have stopped it).
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[asyncio.Future[bool]] = asyncio.Queue()
    rounds = 0

    async def keeper() -> None:
        nonlocal rounds
        while True:
            raise_if_cancel_dropped()
            reply = loop.create_future()
            await replies.put(reply)
            await asyncio.wait_for(reply, 5.0)
            rounds += 1

    task = asyncio.create_task(keeper())
    reply = await replies.get()
    await asyncio.sleep(0)
    reply.set_result(True)
    stopping = asyncio.create_task(stop_task(task, resend_s=60.0))
    finished, _ = await asyncio.wait({stopping}, timeout=5.0)
    assert stopping in finished, f"the task ran on through {rounds} rounds after its cancel"
    assert task.cancelled()
    assert rounds == 1  # the round whose reply came with the cancel, and no other


async def test_stopping_a_finished_task_returns_at_once() -> None:
    async def done() -> None:
        return None

    task = asyncio.create_task(done())
    await task
    await stop_task(task)
    assert task.done()
