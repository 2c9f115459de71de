"""The worker: one pull loop per assigned target, a bounded number of jobs at once.

Life of a delivery (DESIGN.md section 2): decode the work order, run the handler with
heartbeats, publish the outcome event, report to the sink, and only then ack (committed
or suppressed), terminate (dead-lettered) or nak with backoff (retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import aiohttp
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import FetchTimeoutError

import jetfleet
from jetfleet import subjects
from jetfleet.errors import PermanentFailure, RetryLater
from jetfleet.retry import RetryPolicy
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    HandlerOutput,
    Outcome,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from jetfleet.settings import Settings
from jetfleet.worker import builtin as _builtin  # noqa: F401  (registers built-in handlers)
from jetfleet.worker.handlers import HandlerContext, get_handler

log = logging.getLogger(__name__)

_order_decoder = msgspec.json.Decoder(WorkOrder)
_reply_decoder = msgspec.json.Decoder(SinkReply)
_encoder = msgspec.json.Encoder()
FETCH_WAIT_S = 1.0
SINK_TIMEOUT_S = 5.0
SINK_TRIES = 3


class _Verdict(msgspec.Struct, frozen=True):
    """What the handler's attempt came to, before the sink has its say."""

    kind: str  # ok | retryable | permanent
    output: HandlerOutput | None = None
    reason: str = ""
    detail: str = ""
    delay_s: float | None = None


class Worker:
    """Pulls jobs of its targets and runs them; ``drain()`` stops it gracefully."""

    def __init__(
        self,
        settings: Settings,
        nc: NatsClient,
        worker_id: str,
        targets: Iterable[str] = (),
        identity: str = "",
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.worker_id = worker_id
        self.identity = identity
        self.targets = tuple(targets) or tuple(sorted(settings.targets))
        self.policy = RetryPolicy.from_settings(settings.fleet)
        self._slots = asyncio.Semaphore(settings.worker.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self.processed = 0

    async def start(self) -> None:
        """Bind to each target's durable consumer and start pulling."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.settings.worker.concurrency * 2)
        )
        for target in self.targets:
            self._loops.append(asyncio.create_task(self._pull_loop(target)))
        log.info("worker %s pulling %s", self.worker_id, ", ".join(self.targets))

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop pulling, let in-flight jobs finish (release them after ``timeout_s``)."""
        self._stopping.set()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()  # _process naks a cancelled job so it is retried at once
            await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _pull_loop(self, target: str) -> None:
        sub = None
        while not self._stopping.is_set():
            try:
                if sub is None:
                    sub = await self.js.pull_subscribe_bind(
                        subjects.work_consumer(target), stream=subjects.STREAM_WORK
                    )
                await self._slots.acquire()
                free = 1 + self._take_free_slots(9)
                try:
                    msgs = await sub.fetch(free, timeout=FETCH_WAIT_S)
                except (FetchTimeoutError, NatsTimeoutError):
                    msgs = []
                for _ in range(free - len(msgs)):
                    self._slots.release()
                for msg in msgs:
                    self._spawn(self._run_and_release(msg, target))
            except Exception:  # keep pulling through reconnects and leader changes
                log.exception("pull loop for %s failed; rebinding", target)
                sub = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)

    def _take_free_slots(self, most: int) -> int:
        taken = 0
        while taken < most and not self._slots.locked():
            self._slots._value -= 1  # non-blocking acquire of an idle slot
            taken += 1
        return taken

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_and_release(self, msg: Msg, target: str) -> None:
        try:
            await self._process(msg, target)
        finally:
            self._slots.release()
            self.processed += 1

    # The one long core path of the worker: every branch ends in exactly one of
    # ack, term, nak, or (when the sink is unreachable) nak for a later redelivery.
    async def _process(self, msg: Msg, target: str) -> None:
        try:
            order = _order_decoder.decode(msg.data)
        except msgspec.MsgspecError as exc:
            log.error("undecodable work order on %s: %s", msg.subject, exc)
            await self._term(msg, f"malformed-work-order: {exc}")
            return
        attempt = msg.metadata.num_delivered
        handler_version = ""
        started = time.monotonic()
        try:
            if attempt > order.max_attempts:
                # Delivered again after a crash with no verdict recorded: do not run it again.
                verdict = _Verdict(
                    "permanent",
                    reason="attempts-exhausted",
                    detail=f"delivered {attempt} times without a verdict",
                )
            else:
                fn, handler_version = get_handler(order.job.handler)
                verdict = await self._attempt(msg, order, attempt, fn)
        except KeyError:
            verdict = _Verdict(
                "permanent",
                reason="unknown-handler",
                detail=f"no handler {order.job.handler!r} in worker",
            )
        except asyncio.CancelledError:
            await msg.nak()  # released by a drain: someone else may take it now
            raise
        duration = time.monotonic() - started
        versions = Versions(
            jetfleet=jetfleet.__version__, handler=f"{order.job.handler}@{handler_version}"
        )
        if verdict.kind == "retryable" and attempt >= order.max_attempts:
            verdict = _Verdict(
                "permanent",
                reason="attempts-exhausted",
                detail=f"last: {verdict.reason} {verdict.detail}".strip(),
            )
        await self._publish_outcome(order, attempt, verdict, duration, versions)
        if verdict.kind == "retryable":
            await msg.nak(delay=self.policy.delay_s(attempt, verdict.delay_s))
            return
        reply = await self._report(order, attempt, verdict, duration, versions)
        if reply is None:
            await msg.nak(delay=self.policy.delay_s(1))  # sink unreachable: try again later
        elif reply.status in ("committed", "suppressed:duplicate-key"):
            await msg.ack()
        elif reply.status == "dead-lettered":
            await self._term(msg, verdict.reason)
        else:
            log.warning("sink answered %s for %s: %s", reply.status, order.job.id, reply.detail)

    async def _attempt(self, msg: Msg, order: WorkOrder, attempt: int, fn: object) -> _Verdict:
        assert self._session is not None
        target = self.settings.targets[order.target]
        ctx = HandlerContext(
            order=order,
            target=target,
            attempt=attempt,
            worker_id=self.worker_id,
            identity=self.identity,
            user_agent=target.user_agent or self.settings.fleet.user_agent,
            session=self._session,
        )
        beat = asyncio.create_task(self._heartbeat(msg))
        try:
            output = await fn(ctx)  # type: ignore[operator]
            return _Verdict("ok", output=output)
        except PermanentFailure as exc:
            return _Verdict("permanent", reason=exc.reason, detail=exc.detail)
        except RetryLater as exc:
            return _Verdict("retryable", reason=exc.reason, detail=exc.detail, delay_s=exc.delay_s)
        except Exception as exc:  # a handler bug: retried, and logged as the crash it is
            log.exception("handler %s crashed on job %s", order.job.handler, order.job.id)
            return _Verdict(
                "retryable", reason="handler-crashed", detail=f"{type(exc).__name__}: {exc}"
            )
        finally:
            beat.cancel()

    async def _heartbeat(self, msg: Msg) -> None:
        # +WPI resets the visibility timer, so a long job is not redelivered mid-run.
        interval = self.settings.fleet.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            await msg.in_progress()

    async def _report(
        self, order: WorkOrder, attempt: int, verdict: _Verdict, duration: float, versions: Versions
    ) -> SinkReply | None:
        report: Success | Failure
        if verdict.kind == "ok":
            assert verdict.output is not None
            report = Success(
                order=order,
                worker=self.worker_id,
                attempt=attempt,
                duration_s=duration,
                output=verdict.output,
                versions=versions,
                identity=self.identity,
            )
        else:
            record = AttemptRecord(
                attempt=attempt,
                worker=self.worker_id,
                identity=self.identity,
                duration_s=duration,
                outcome=verdict.kind,
                reason=verdict.reason,
            )
            report = Failure(
                order=order,
                worker=self.worker_id,
                reason=verdict.reason,
                detail=verdict.detail,
                history=[record],
                versions=versions,
                identity=self.identity,
            )
        payload = _encoder.encode(report)
        for try_no in range(SINK_TRIES):
            try:
                answer = await self.nc.request(
                    subjects.sink_report(order.target), payload, timeout=SINK_TIMEOUT_S
                )
                return _reply_decoder.decode(answer.data)
            except (NoRespondersError, NatsTimeoutError) as exc:
                log.warning(
                    "sink did not answer for job %s (%s); retrying",
                    order.job.id,
                    type(exc).__name__,
                )
                await asyncio.sleep(0.5 * 2**try_no)
        return None

    async def _publish_outcome(
        self, order: WorkOrder, attempt: int, verdict: _Verdict, duration: float, versions: Versions
    ) -> None:
        event = Outcome(
            job_id=order.job.id,
            target=order.target,
            worker=self.worker_id,
            attempt=attempt,
            kind=verdict.kind,  # type: ignore[arg-type]
            duration_s=duration,
            versions=versions,
            identity=self.identity,
            reason=verdict.reason,
        )
        await self.nc.publish(subjects.outcome(order.target), _encoder.encode(event))

    async def _term(self, msg: Msg, reason: str) -> None:
        # nats-py's term() sends a bare +TERM; the reason needs the raw frame.
        await self.nc.publish(msg.reply, b"+TERM " + reason.encode()[:200])
