"""A nats-py client that sends what a loop pass publishes in one socket write, and
makes its requests' reply subjects and timeouts cheaply.

nats-py queues each publish and wakes its flusher task, which writes everything queued
so far. Under load the flusher wakes once per loop pass, often for the one or two
requests the tasks ahead of it made, so a service makes many small writes: on a
2-core machine the write syscalls (and the server wake-ups each one causes) were a
third of each service's CPU. This flusher waits two more loop passes before it writes,
so the requests, replies and acks made by every task those passes run go out together:
one write and one server wake-up instead of several. A pass takes microseconds when idle
and up to milliseconds under load; nothing waits longer than two of them. (Two passes
against one: 655-696 -> 712-717 jobs/s on the full path, CPU per job 2.6-2.7 -> 2.5 ms;
a third pass gained nothing, docs/benchmarks.md.)

It overrides nats-py's private ``Client._flusher`` (nats-py is pinned to 2.16.x in
pyproject.toml); tests/test_coalescing_client.py checks the contract it keeps: every
publish is written, ``flush()`` returns once the data is written, and many publishes
made in one pass reach the server as one write.

Requests: nats-py names each request's reply subject by a fresh NUID plus two bytes
from ``os.urandom`` and waits with ``asyncio.wait_for``: 10 to 15 % of a service's CPU
under load. Here the reply subject is the connection's random request prefix (nats-py's
own, a NUID) and a counter, and the timeout is one timer. The prefix is what no other
client can guess (a reply subject is seen only by the responder, which sees the prefix
as well); the counter keeps every reply subject of the connection's life apart.
tests/test_coalescing_client.py checks that answers, timeouts and cancellation behave
as nats-py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats import errors
from nats.aio.client import Client
from nats.aio.msg import Msg


class CoalescingClient(Client):
    """``nats.aio.client.Client`` whose flusher writes a whole loop pass's publishes at
    once, and whose requests are lighter."""

    write_count: int = 0
    """Socket writes made so far (tests and benchmarks read it)."""
    _requests_made: int = 0

    async def _request_new_style(
        self,
        subject: str,
        payload: bytes,
        timeout: float | None = 1,  # noqa: ASYNC109 (nats-py's signature, overridden)
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        # Mirrors nats-py 2.16's Client._request_new_style: the same reply subject shape
        # (``_request_sub_callback`` reads the token after the prefix) and errors.
        if self.is_draining_pubs:
            raise errors.ConnectionDrainingError
        if not self._resp_sub_prefix:
            await self._init_request_sub()
        assert self._resp_sub_prefix
        self._requests_made += 1
        token = format(self._requests_made, "x")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._resp_map[token] = future
        try:
            await self.publish(
                subject, payload, reply=self._resp_sub_prefix.decode() + token, headers=headers
            )
            # None waits as long as it takes, as nats-py's wait_for(future, None).
            timer = None if timeout is None else loop.call_later(timeout, _time_out, future)
            try:
                return await future
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            self._resp_map.pop(token, None)

    async def _flusher(self) -> None:
        # Mirrors nats-py 2.16's Client._flusher, plus the two passes of waiting. Every
        # future queued before the write is answered by it; a publish made while the
        # write drains finds the queue empty and queues a future of its own.
        while True:
            if not self.is_connected or self.is_connecting:
                break
            assert self._flush_queue is not None and self._transport is not None
            waiting = [await self._flush_queue.get()]
            try:
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                while not self._flush_queue.empty():
                    waiting.append(self._flush_queue.get_nowait())
                if self._pending_data_size > 0:
                    self._transport.writelines(self._pending[:])
                    self._pending = []
                    self._pending_data_size = 0
                    self.write_count += 1
                    await self._transport.drain()  # type: ignore[no-untyped-call]
            except OSError as exc:
                await self._error_cb(exc)
                await self._process_op_err(exc)
                break
            except RuntimeError as exc:
                if self.is_closed or self.is_connecting or self.is_reconnecting:
                    break  # the loop or the client is closing (as nats-py's flusher)
                # uvloop raises this ("the handler is closed") where asyncio raises an
                # OSError for a connection the peer reset: a dead connection all the same,
                # so reconnect rather than end the flusher silently.
                await self._error_cb(exc)
                await self._process_op_err(exc)
                break
            except (asyncio.CancelledError, AttributeError):
                break
            finally:
                for future in waiting:
                    if not future.done():
                        future.set_result(None)


def _time_out(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(errors.TimeoutError())
