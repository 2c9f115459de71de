"""Stopping a task whose cancel a library swallows: nats-py's ``request`` awaits its
reply with ``asyncio.wait_for``, which on Python 3.11 returns the reply and drops a
cancel that lands as the reply does (CPython gh-86296). The worker's lease keeper, so
cancelled after a job's commit, went on renewing: the lease stayed live, +WPI kept the
delivery from redelivering, the ack never came (the demo saw a committed job counted as
leased too, ``lost -1``)."""

from __future__ import annotations

import asyncio

from jetfleet.task_stop import raise_if_cancel_dropped, stop_task


class _Keeper:
    """A renewal loop as the lease keeper runs it: one request after another, each reply
    awaited with ``wait_for`` as nats-py's request does; ``checks`` adds the keeper's
    per-round check for a dropped cancel."""

    def __init__(self, checks: bool) -> None:
        self.checks = checks
        self.rounds = 0
        self.replies: asyncio.Queue[asyncio.Future[bool]] = asyncio.Queue()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.checks:
                raise_if_cancel_dropped()
            reply = loop.create_future()
            await self.replies.put(reply)
            await asyncio.wait_for(reply, 5.0)
            self.rounds += 1

    async def cancelled_as_answered(self, resend_s: float = 0.05) -> asyncio.Task[None]:
        """Start the loop; answer its first request and start stopping it in the same
        turn of the loop, so wait_for drops that cancel. Returns the stopping task."""
        task = asyncio.create_task(self.run())
        self.task = task
        reply = await self.replies.get()
        await asyncio.sleep(0)  # deliberate: one turn, so the loop is inside wait_for
        reply.set_result(True)
        return asyncio.create_task(stop_task(task, resend_s))


async def test_a_task_whose_first_cancel_is_swallowed_by_wait_for_is_still_stopped() -> None:
    keeper = _Keeper(checks=False)
    stopping = await keeper.cancelled_as_answered()
    replies, task = keeper.replies, keeper.task
    # Answer whatever the keeper asks next, as the leaser would.
    answering = asyncio.create_task(_answer(replies))
    # asyncio.wait, not a timeout around the await: cancelling the waiter would cancel
    # the task a second time and hide a stop that never ends.
    finished, _ = await asyncio.wait({stopping}, timeout=5.0)
    answering.cancel()
    assert stopping in finished, (
        f"the task ran on through {keeper.rounds} renewals after its cancel"
    )
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
    keeper = _Keeper(checks=True)
    stopping = await keeper.cancelled_as_answered(resend_s=60.0)
    finished, _ = await asyncio.wait({stopping}, timeout=5.0)
    assert stopping in finished, f"the task ran on through {keeper.rounds} rounds after its cancel"
    assert keeper.task.cancelled()
    assert keeper.rounds == 1  # the round whose reply came with the cancel, and no other


async def test_stopping_a_finished_task_returns_at_once() -> None:
    async def done() -> None:
        return None

    task = asyncio.create_task(done())
    await task
    await stop_task(task)
    assert task.done()
