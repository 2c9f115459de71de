"""The gateway service: HTTP API, the dashboard and its routes, Prometheus ``/metrics``.

It keeps no state of its own: submissions are published to ``jf.submit.<target>`` by
the same code the CLI uses, and every count is read from JetStream when asked, so any
number of replicas can run behind a load balancer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from jetfleet.services.gateway import controls, fleet_reads
from jetfleet.services.gateway.access import Denial, check_origin, check_read, check_write
from jetfleet.services.gateway.batch import (
    BODY_FACTOR,
    InvalidBody,
    TooManyJobs,
    max_body_bytes,
    parse_batch,
)
from jetfleet.services.gateway.dashboard import DASHBOARD_HTML
from jetfleet.services.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from jetfleet.services.gateway.metrics import FleetGauges, queue_depths
from jetfleet.services.gateway.outcome_tail import OutcomeTail
from jetfleet.services.gateway.refusal import Refused as _Refused
from jetfleet.services.gateway.shared_reads import SharedReads
from nats.aio.client import Client as NatsClient
from opentelemetry.trace import SpanKind, Status, StatusCode

from jetfleet import subjects, tracing
from jetfleet.client import SubmitResult, submit_raw
from jetfleet.js_errors import UNAVAILABLE
from jetfleet.metrics import CounterFamily
from jetfleet.ops.status import confirmed_status
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

log = logging.getLogger(__name__)

# After drain's own wait, how long aiohttp gives stragglers before cancelling them.
_CLOSE_GRACE_S = 1.0

# Failures that mean "NATS is unreachable or busy right now", not a bug: answered 503 so
# a client or load balancer retries instead of reporting a gateway fault.
_NATS_UNAVAILABLE = UNAVAILABLE


class Gateway:
    """The HTTP face of the fleet.

    Args:
        settings: the fleet settings; ``settings.gateway`` gives host, port and token.
        nc: a connected NATS client. The gateway uses it but does not close it.
    """

    name = "gateway"

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        # The gateway's numbers are the fleet's (GET /metrics on its own port).
        self.metrics: list[CounterFamily] = []
        self.fleet_gauges = FleetGauges(settings.targets)
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self._draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # The dashboard's outcome tallies: a cache of JF_OUTCOMES, read again at start.
        self.clock = ServerClock(nc)
        self.outcomes = OutcomeTail(self.js, self.clock)
        # Every open tab polls the dashboard's reads: one answer serves them all a while.
        self.shared = SharedReads()

    @property
    def url(self) -> str:
        """The base URL served, e.g. ``http://127.0.0.1:8080`` (the bound port if 0).

        Raises:
            RuntimeError: if the gateway has not been started.
        """
        if self._url is None:
            raise RuntimeError("gateway not started: call start() first")
        return self._url

    async def start(self) -> None:
        """Bind ``settings.gateway.host``/``port`` and start serving.

        Raises:
            RuntimeError: if already started.
            OSError: if the address cannot be bound.
        """
        if self._runner is not None:
            raise RuntimeError("gateway already started")
        self._draining = False
        runner = web.AppRunner(self._build_app(), shutdown_timeout=_CLOSE_GRACE_S)
        await runner.setup()
        try:
            await web.TCPSite(
                runner, self.settings.gateway.host, self.settings.gateway.port
            ).start()
        except BaseException:
            await runner.cleanup()
            raise
        host, port = runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        self._runner = runner
        self._url = f"http://{shown}:{port}"
        self.outcomes.start()
        log.info("gateway serving on %s", self._url)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``timeout_s``), clean up.

        Safe to call when not started or already drained. The NATS connection is left
        open: it belongs to the caller.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._draining = True
        await self.outcomes.stop()
        for site in list(runner.sites):
            await site.stop()  # no new connections from here on
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning(
                "gateway drain: %d requests still running after %g s; cancelling",
                self._inflight,
                timeout_s,
            )
        await runner.cleanup()
        self._url = None

    def _build_app(self) -> web.Application:
        # client_max_size makes aiohttp refuse an oversized body while reading it, even
        # when it comes chunked without a Content-Length.
        app = web.Application(
            middlewares=[self._guard], client_max_size=max_body_bytes(self.settings)
        )
        app.router.add_get("/", self._dashboard)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/targets/{target}/jobs", self._submit)
        # The dashboard's reads and control actions (docs/dashboard.md).
        app.router.add_get("/v1/targets", self._targets)
        app.router.add_get("/v1/workers", self._workers)
        app.router.add_get("/v1/versions/series", self._versions)
        app.router.add_get("/v1/dead-letters", self._dead_letters)
        app.router.add_post("/v1/pause", self._pause)
        app.router.add_post("/v1/resume", self._resume)
        app.router.add_post("/v1/proposals/{id}/{action}", self._proposal)
        app.router.add_post("/v1/dead-letters/{id}/replay", self._replay)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Trace a submission (a SERVER span), then ``_guarded``."""
        if request.method != "POST" or not tracing.tracing_on():
            return await self._guarded(request, handler)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        attributes = {"http.request.method": "POST", "http.route": route, "url.path": request.path}
        with tracing.span(
            f"POST {route}", SpanKind.SERVER, tracing.extract(request.headers), attributes
        ) as span:
            response = await self._guarded(request, handler)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR, str(response.status)))
            return response

    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Count in-flight requests for drain, and turn every failure into JSON."""
        if self._draining:
            return _json(
                {"error": "the gateway is shutting down; retry on another replica"},
                503,
                headers={"Connection": "close", "Retry-After": "1"},
            )
        gateway = self.settings.gateway
        if self._inflight >= gateway.max_concurrent:
            # Bounded cost: past the cap a request is answered at once, not queued.
            return _json(
                {
                    "error": f"the gateway is serving {gateway.max_concurrent} requests "
                    "(gateway.max_concurrent); retry shortly"
                },
                503,
                headers={"Retry-After": "1"},
            )
        self._inflight += 1
        self._idle.clear()
        try:
            return await asyncio.wait_for(handler(request), gateway.request_timeout_s)
        except TimeoutError:
            log.warning(
                "%s %s: no answer within %g s",
                request.method,
                request.path,
                gateway.request_timeout_s,
            )
            return _json(
                {
                    "error": f"no answer within {gateway.request_timeout_s:g} s "
                    "(gateway.request_timeout_s); retry later"
                },
                504,
            )
        except _Refused as refusal:
            return _json(
                {"error": refusal.message, **refusal.extra}, refusal.status, headers=refusal.headers
            )
        except web.HTTPException:
            raise  # aiohttp's own answers (404, 405) are correct as they are
        except _NATS_UNAVAILABLE as exc:
            log.warning("%s %s: NATS unavailable: %r", request.method, request.path, exc)
            return _json(
                {"error": f"NATS is unavailable ({type(exc).__name__}: {exc}); retry shortly"},
                503,
                headers={"Retry-After": "1"},
            )
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return _json(
                {"error": f"internal error ({type(exc).__name__}: {exc}); see the gateway log"}, 500
            )
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _dashboard(self, request: web.Request) -> web.Response:
        return web.Response(text=DASHBOARD_HTML, content_type="text/html")

    async def _healthz(self, request: web.Request) -> web.Response:
        state = _connection_state(self.nc)
        return _json(
            {"ok": state == "connected", "nats": state}, 200 if state == "connected" else 503
        )

    def _require_read(self, request: web.Request) -> None:
        authorization, host = request.headers.get("Authorization"), request.headers.get("Host")
        denial = check_read(self.settings.gateway, authorization, host)
        _raise_denial(denial)

    async def _status(self, request: web.Request) -> web.Response:
        self._require_read(request)
        status = await confirmed_status(self.js, self.settings)
        return web.Response(body=msgspec.json.encode(status), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        self._require_read(request)
        # Read again while the counts do not add up, as `jetfleet status` does: under a
        # steady flow most single reads catch a job between two counts, and the
        # conservation gauge must not be non-zero scrape after scrape for that.
        status, queue = await asyncio.gather(
            confirmed_status(self.js, self.settings), queue_depths(self.js, self.settings.targets)
        )
        body = self.fleet_gauges.render(status, queue)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _targets(self, request: web.Request) -> web.Response:
        self._require_read(request)
        series = self.outcomes.series
        return _json(
            await self.shared.get(
                "targets",
                lambda: fleet_reads.targets_doc(self.js, self.settings, series, self.clock),
            )
        )

    async def _workers(self, request: web.Request) -> web.Response:
        self._require_read(request)
        series = self.outcomes.series
        return _json(
            await self.shared.get(
                "workers", lambda: fleet_reads.actors_doc(self.js, series, self.clock)
            )
        )

    async def _versions(self, request: web.Request) -> web.Response:
        self._require_read(request)
        series = self.outcomes.series
        return _json(
            await self.shared.get(
                "versions", lambda: fleet_reads.versions_doc(self.js, series, self.clock)
            )
        )

    async def _dead_letters(self, request: web.Request) -> web.Response:
        self._require_read(request)
        query = request.query
        target = query.get("target") or None
        if target is not None and not subjects.TARGET_NAME_RE.match(target):
            raise _Refused(400, f"target {target!r} is not a target name")
        text = query.get("limit", str(fleet_reads.DEFAULT_LETTERS))
        if not text.isdigit() or not 1 <= int(text) <= fleet_reads.MAX_LETTERS:
            raise _Refused(400, f"limit {text!r}: give 1 to {fleet_reads.MAX_LETTERS}")
        reason = query.get("reason") or None
        key = msgspec.json.encode(["dead-letters", target, reason, int(text)]).decode()
        return _json(
            await self.shared.get(
                key, lambda: fleet_reads.dead_letters_doc(self.js, target, reason, int(text))
            )
        )

    def _require_write(self, request: web.Request) -> None:
        authorization, host = request.headers.get("Authorization"), request.headers.get("Host")
        denial = check_write(self.settings.gateway, authorization, host)
        _raise_denial(denial or check_origin(request.headers.get("Origin"), host))

    async def _pause(self, request: web.Request) -> web.Response:
        return await self._pause_or_resume(request, resume=False)

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._pause_or_resume(request, resume=True)

    def _require_control(self, request: web.Request) -> None:
        """A control action: the write check (token, Host, Origin), then JSON only."""
        self._require_write(request)
        controls.require_json(request)

    async def _pause_or_resume(self, request: web.Request, resume: bool) -> web.Response:
        self._require_control(request)
        body = controls.decode_body(await self._read_body(request), controls.PauseBody)
        return _json(await controls.pause(self.nc, self.settings, body, resume))

    async def _proposal(self, request: web.Request) -> web.Response:
        self._require_control(request)
        action = request.match_info["action"]
        if action not in ("approve", "reject"):
            raise _Refused(404, f"no action {action!r} on a proposal: approve or reject")
        body = controls.decode_body(await self._read_body(request), controls.ProposalBody)
        proposal = request.match_info["id"]
        answer = controls.answer_proposal(
            self.nc, self.settings, proposal, "approve" if action == "approve" else "reject", body
        )
        return _json(await answer)

    async def _replay(self, request: web.Request) -> web.Response:
        self._require_control(request)
        body = controls.decode_body(await self._read_body(request), controls.ReplayBody)
        letter = request.match_info["id"]
        return _json(await controls.replay_letter(self.nc, self.settings, letter, body))

    async def _submit(self, request: web.Request) -> web.Response:
        self._require_write(request)
        target = request.match_info["target"]
        body = await self._read_body(request)
        if not subjects.TARGET_NAME_RE.match(target):
            # Never put the route's text into a subject (a space or '*' would corrupt the
            # publish); keep the body under the catch-all target instead.
            kept = await self._keep(subjects.UNPARSABLE_TARGET, body)
            raise _Refused(
                400,
                f"target name {target!r} is not valid: use lowercase letters, "
                "digits, '-' or '_' (at most 64)",
                reason=_reason(kept),
            )
        try:
            batch = parse_batch(body)
        except TooManyJobs as exc:
            raise _Refused(413, str(exc)) from None
        except InvalidBody as exc:
            # Bad input loses nothing: the scheduler files the raw body on jf.rejected.
            kept = await self._keep(target, body)
            raise _Refused(400, str(exc), reason=_reason(kept)) from None
        # A caller that sent its trace context gets its jobs in its trace; else each job
        # is a trace of its own, linked to this request's span.
        tracing.annotate({tracing.TARGET: target, "jetfleet.jobs": len(batch.payloads)})
        joined = tracing.extract(request.headers) is not None
        results = await submit_raw(
            self.js,
            self.settings,
            target,
            batch.payloads,
            batch.msg_ids,
            own_traces=not joined,
        )
        answer = batch.answer(results)
        # Every item was published either way; 400 says some need fixing by the client.
        return web.Response(
            body=msgspec.json.encode(answer),
            content_type="application/json",
            status=400 if answer.rejected else 202,
        )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = max_body_bytes(self.settings)
        too_large = _Refused(
            413,
            f"request body is larger than {limit} bytes ({BODY_FACTOR} x "
            "fleet.max_job_bytes); split the batch into several requests",
        )
        # Refuse on the declared length before reading anything.
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def _keep(self, target: str, body: bytes) -> SubmitResult:
        [result] = await submit_raw(self.js, self.settings, target, [body])
        return result


def _raise_denial(denial: Denial | None) -> None:
    if denial is not None:
        headers = {"WWW-Authenticate": 'Bearer realm="jetfleet"'} if denial.status == 401 else None
        raise _Refused(denial.status, denial.message, headers)


def _reason(result: SubmitResult) -> str | None:
    return result.rejection.reason if result.rejection is not None else None


def _connection_state(nc: NatsClient) -> str:
    if nc.is_closed:
        return "closed"
    if nc.is_draining:
        return "draining"
    if nc.is_reconnecting:
        return "reconnecting"
    if nc.is_connecting:
        return "connecting"
    if nc.is_connected:
        return "connected"
    return "disconnected"


def _json(
    data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data),
        status=status,
        content_type="application/json",
        headers=headers,
    )
