"""The gateway's reader of ``JF_OUTCOMES``: it follows the stream with an ephemeral,
unacked consumer of its own (nothing durable, so replicas need no coordination) and feeds
every event that ``read_outcomes`` accepts into an ``OutcomeSeries``.

It starts ``window_s`` back by the server's clock, so a restarted gateway draws the same
recent chart; if its consumer is lost (NATS restarted, the consumer idled out) it opens a
new one after the last sequence it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging

from jetfleet.services.gateway.outcome_series import BUCKET_S, BUCKETS, OutcomeSeries
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError

from jetfleet import subjects
from jetfleet.outcome_events import read_outcomes
from jetfleet.server_clock import ServerClock

log = logging.getLogger(__name__)
BATCH = 256
FETCH_WAIT_S = 1.0
RETRY_S = 2.0
INACTIVE_S = 30.0
"""The server drops our consumer this long after we stop fetching (we died)."""


class OutcomeTail:
    """Follow ``JF_OUTCOMES`` into ``series`` until stopped."""

    def __init__(self, js: JetStreamContext, clock: ServerClock) -> None:
        self.js = js
        self.clock = clock
        self.series = OutcomeSeries()
        self.window_s = BUCKET_S * BUCKETS
        self._last_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.skipped = 0
        """Events ``read_outcomes`` refused (logged at debug)."""

    def start(self) -> None:
        """Start following in the background."""
        if self._task is None:
            self._stopped = False
            self._task = asyncio.create_task(self._follow(), name="gateway-outcome-tail")

    async def stop(self) -> None:
        """Stop following."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopped = True
        # nats-py's next_msg (under fetch) awaits a task of its own running wait_for on
        # the pending queue; a cancel that lands as a message arrives is passed to that
        # task, whose Python 3.11 wait_for returns the message instead, so the cancel is
        # lost. Under a flood that is most cancels, and a loop that ran until cancelled
        # never ended (tests/test_dashboard_tail.py). The flag ends the loops then, and
        # the cancel is sent again until the task is done.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError):
            task.result()

    async def _follow(self) -> None:
        failing = False
        while not self._stopped:
            try:
                await self._read_from(await self._config())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away, stream missing: try again shortly
                if not failing:
                    log.warning("reading %s failed (%r); retrying", subjects.STREAM_OUTCOMES, exc)
                failing = True
                await asyncio.sleep(RETRY_S)
            else:
                failing = False

    async def _config(self) -> js_api.ConsumerConfig:
        config = js_api.ConsumerConfig(
            ack_policy=js_api.AckPolicy.NONE,
            filter_subject=f"{subjects.PREFIX}.outcome.>",
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
        )
        if self._last_seq:
            config.deliver_policy = js_api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._last_seq + 1
            return config
        now = await self.clock.now() or datetime.datetime.now(datetime.UTC)
        config.deliver_policy = js_api.DeliverPolicy.BY_START_TIME
        config.opt_start_time = now - datetime.timedelta(seconds=self.window_s)
        return config

    async def _read_from(self, config: js_api.ConsumerConfig) -> None:
        info = await self.js.add_consumer(subjects.STREAM_OUTCOMES, config)
        sub = await self.js.pull_subscribe_bind(info.name, stream=subjects.STREAM_OUTCOMES)
        try:
            while not self._stopped:
                try:
                    msgs = await sub.fetch(BATCH, timeout=FETCH_WAIT_S)
                except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                    continue  # nothing new: fetch again (this also keeps the consumer alive)
                for msg in msgs:
                    self._last_seq = msg.metadata.sequence.stream
                    at_s = msg.metadata.timestamp.timestamp()
                    for event in read_outcomes(msg.subject, msg.data, msg.headers):
                        if isinstance(event, str):
                            self.skipped += 1
                            log.debug("skipped outcome event %d: %s", self._last_seq, event)
                            continue
                        self.series.add(event, at_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(subjects.STREAM_OUTCOMES, info.name)
