"""The ``browser.page`` handler: visit the job's page in headless Chromium, wait for a
selector, read what the job's extraction spec names, screenshot on request.

Manners as ``http.get`` (docs/browser.md): the worker checked robots.txt before the
handler runs, and takes the first request's rate permit when the page is open and its
document request about to leave (``ctx.ready``): taken before the page opened (a second
under load), permits spaced at the target's rate reached it bunched. The page's document
request is sent
by the handler itself (``route.fetch``), hop by hop, so each redirect is checked against
the target (``redirect-off-target``) and clears robots.txt and a permit of its own, and
it carries the target's identifying User-Agent. Every other request the page would make
(images, scripts, styles, frames, fetch, later navigations), to the target or anywhere
else, is never sent: the document is served to Chromium with a policy forbidding them
(``NO_SUBREQUESTS``), and its route aborts the rest. One permit is one request, as the
target counts them.

A block or challenge answer (403/429/503, a challenge page) is a ``Blocked`` signal: the
page is left as it is, never interacted with, and a challenge discards the identity's
browser cookies for the target (the session is dead; DESIGN I5).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from playwright.async_api import BrowserContext, ConsoleMessage, Page, Route
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeout

from jetfleet import tracing
from jetfleet.admission import BROWSER_HANDLER
from jetfleet.errors import Blocked, PermanentFailure, RetryLater
from jetfleet.schemas import HandlerOutput
from jetfleet.schemas.browser import MAX_VALUES_PER_FIELD, ExtractedValue, PageSpec, PageVisit
from jetfleet.schemas.stored import StoredObject
from jetfleet.worker.block_signal import (
    BLOCK_STATUS,
    CHALLENGE_ID,
    block_kind,
    is_challenge_page,
)
from jetfleet.worker.handlers import HandlerContext, handler
from jetfleet.worker.result_objects import RESULT_TOO_LARGE
from jetfleet.worker.retry_after import retry_after_s
from jetfleet.worker.target_scope import redirect_to

log = logging.getLogger(__name__)

HANDLER = BROWSER_HANDLER
SELECTOR_REMOVED = "selector-removed"
NO_BROWSER = "no-browser"
BROWSER_UNAVAILABLE = "browser-unavailable"
MAX_REDIRECTS = 10
BUDGET_MARGIN_S = 0.25
CSP_HEADER = "content-security-policy"
NO_SUBREQUESTS = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; font-src data:"
)
"""The policy the document is served to Chromium with: no request of any kind beyond the
document (images, scripts, styles, fonts, frames, fetch/XHR, WebSockets, workers);
inline scripts and styles and ``data:`` images still work. Navigations (form posts
included: a ``form-action`` refusal puts Chromium's error page in the page's place) are
the route's to abort. Chromium refuses
these before any request exists, so none can slip past a route being torn down (a page
closing at its deadline continues the requests still waiting in its routes)."""
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
_RETRYABLE_STATUS = frozenset({408, 500, 502, 504})
MAX_READ_CHARS = 1_000_000
"""Characters read from a page in all (outside a worker, which knows its result size)."""
# Reads every match's text (or attribute) in the page, null where an attribute is absent,
# as well-formed strings (a lone surrogate would not encode as UTF-8) and no more than
# ``room`` characters in all: a page can build text without bound, and all of it would
# cross to this process before the result's size is judged. Over: [null, true].
_READ_ALL = """(els, [attr, most, room]) => {
    const found = [];
    for (const e of els.slice(0, most)) {
        let v = attr ? e.getAttribute(attr) : (e.innerText ?? e.textContent ?? "").trim();
        if (v !== null) {
            v = v.toWellFormed();
            room -= v.length;
            if (room < 0) return [null, true];
        }
        found.push(v);
    }
    return [found, false];
}"""
_LOADED = "() => document.readyState === 'complete'"
_TITLE = "() => document.title.toWellFormed()"
_HAS_CHALLENGE = "(id) => document.getElementById(id) !== null"
_CLOSED = "has been closed"
"""What Playwright's errors say when the page's browser went away under a call."""
_CRASHED = "crashed"
"""What Playwright's errors say when the page's renderer crashed under a call."""
_SELECTOR_REFUSED = ("not a valid selector", "SyntaxError", "Unexpected token", "Unknown engine")
"""What Playwright's errors say of a selector the browser cannot parse."""
STARVED_S = 0.5
"""A page that takes longer than this to answer once a wait for its selector ran out
was too busy to judge: the job is tried again (``page-busy``), not dead-lettered
``selector-removed``."""
PAGE_BUSY = "page-busy"


@dataclass
class _Visit:
    """One job's page: its document request, sent by the handler, and what came back."""

    ctx: HandlerContext
    ends_at: float
    """When (monotonic) the handler's own timeouts end: within the attempt's budget."""
    trace_parent: Context | None = None
    """The page visit span's context: Playwright runs the route in a task of its own,
    so each document request's span names its parent explicitly (None: tracing off)."""
    served: bool = False
    status: int = 0
    final_url: str = ""
    body: bytes = b""
    retry_after: str | None = None
    date: str | None = None
    aborted: int = 0
    """Requests of the page aborted at its route (later navigations, anything the
    policy let through)."""
    refused: int = 0
    """Requests Chromium refused by ``NO_SUBREQUESTS`` (as its console reports them)."""
    failure: BaseException | None = None
    """What stopped the document request (raised by the handler once ``goto`` ends)."""
    ended: bool = False
    """The attempt is over (returned, failed, cancelled): its document request sends no
    further hop. Its route runs apart from the handler (a callback of Playwright's), so
    a cancelled handler (a lost lease, a drain) or a page closed at its deadline would
    otherwise leave it chasing redirects, permits and all, for a job gone elsewhere."""

    async def route(self, route: Route) -> None:
        """Send the job's document request; abort every other request of the page."""
        request = route.request
        if (
            self.served
            or request.resource_type != "document"
            or not request.is_navigation_request()
        ):
            self.aborted += 1
            # A navigation aborted as "aborted" leaves the page as it is; any other error
            # code would put Chromium's error page in its place, to be read as the page.
            code = "aborted" if request.is_navigation_request() else "blockedbyclient"
            with contextlib.suppress(PlaywrightError):  # the page may be closing
                await route.abort(code)
            return
        self.served = True
        try:
            await self._send(route)
        except Exception as exc:
            # Kept for the handler, which raises it once goto ends: a verdict of manners
            # (robots, permit, redirect, size), Playwright's error, or a bug (a crash).
            self.failure = exc
            with contextlib.suppress(PlaywrightError):
                await route.abort()

    async def _send(self, route: Route) -> None:
        ctx = self.ctx
        url = ctx.order.job.url
        headers = {
            **route.request.headers,
            "user-agent": ctx.user_agent,
            "x-jetfleet-worker": ctx.worker_id,
        }
        for hop in range(MAX_REDIRECTS + 1):
            self._still_on()
            if not hop and ctx.ready is not None:
                # The first request's permit, taken now that the page is open and the
                # request about to leave (jetfleet.worker.handlers, permit_when_ready).
                await ctx.ready()
                self._still_on()
            if hop and ctx.another_request is not None:
                # Each hop is a request: robots.txt must allow it, and it takes a permit.
                await ctx.another_request(url)
                self._still_on()
            with tracing.span(
                "GET",
                SpanKind.CLIENT,
                self.trace_parent,
                {"http.request.method": "GET", "url.full": url},
            ) as hop_span:
                response = await route.fetch(
                    url=url, headers=headers, max_redirects=0, timeout=_left_ms(self.ends_at)
                )
                hop_span.set_attribute("http.response.status_code", response.status)
                if response.status >= 400:
                    hop_span.set_status(Status(StatusCode.ERROR, str(response.status)))
            location = response.headers.get("location")
            if response.status in _REDIRECT_STATUS and location:
                url = redirect_to(url, location, ctx.target)
                continue
            self.status, self.final_url = response.status, url
            self.retry_after = response.headers.get("retry-after")
            self.date = response.headers.get("date")
            self.body = await response.body()
            if len(self.body) > ctx.target.max_body_bytes:
                raise PermanentFailure(
                    RESULT_TOO_LARGE,
                    detail=f"{url}: page over targets.{ctx.order.target}.max_body_bytes "
                    f"({ctx.target.max_body_bytes} bytes)",
                )
            await route.fulfill(response=response, headers=_no_subrequests(response.headers))
            return
        raise PermanentFailure(
            "too-many-redirects", detail=f"more than {MAX_REDIRECTS} from {ctx.order.job.url}"
        )

    def _still_on(self) -> None:
        if self.ended or time.monotonic() >= self.ends_at:
            raise RetryLater("timeout", detail="the attempt ended before this request")


def _no_subrequests(headers: dict[str, str]) -> dict[str, str]:
    """The document's headers with ``NO_SUBREQUESTS`` added to its own policy (if any):
    policies combine, each can only forbid more."""
    kept = {k: v for k, v in headers.items() if k.lower() != CSP_HEADER}
    own = next((v for k, v in headers.items() if k.lower() == CSP_HEADER), "")
    kept[CSP_HEADER] = f"{own}, {NO_SUBREQUESTS}" if own else NO_SUBREQUESTS
    return kept


def _count_refusal(visit: _Visit, message: ConsoleMessage) -> None:
    if message.type == "error" and "Content Security Policy" in message.text:
        visit.refused += 1


@handler(HANDLER, permit_when_ready=True)
async def browser_page(ctx: HandlerContext) -> HandlerOutput:
    """Visit the job's URL in the identity's browser context and read it (docs/browser.md).

    Fails permanently with ``selector-removed`` when ``wait_for`` never shows on a page
    that loaded (2xx), ``http-404``/``http-410``, ``redirect-off-target``,
    ``result-too-large`` (page or screenshot over its cap) or ``bad-selector``; retries
    on 5xx, timeouts and network errors; 403/429/503 and challenge pages are block
    signals, never solved.
    """
    if ctx.browser is None:
        raise RetryLater(NO_BROWSER, detail="this worker has no browser (worker.browser)")
    spec = ctx.order.job.page or PageSpec()
    # The handler's own timeouts end a little before the attempt's budget, so it says
    # what ran out (the worker's deadline would only say handler-timeout).
    ends_at = time.monotonic() + max(0.1, _budget_s(ctx) - BUDGET_MARGIN_S)
    try:
        context = await ctx.browser.acquire(ctx.identity)
    except PlaywrightError as exc:
        raise RetryLater(BROWSER_UNAVAILABLE, detail=_first_line(exc)) from None
    with tracing.span("page visit", SpanKind.CLIENT, attributes={"url.full": ctx.order.job.url}):
        visit = _Visit(ctx, ends_at, otel_context.get_current() if tracing.tracing_on() else None)
        return await _visit(ctx, context, spec, visit)


async def _visit(
    ctx: HandlerContext, context: BrowserContext, spec: PageSpec, visit: _Visit
) -> HandlerOutput:
    """One page visit in ``context`` (its browser context, acquired), released after."""
    assert ctx.browser is not None
    page: Page | None = None
    try:
        try:
            page = await context.new_page()
        except PlaywrightError as exc:
            # Its browser died: the pool forgets it (it closed), the next attempt opens anew.
            raise RetryLater(BROWSER_UNAVAILABLE, detail=_first_line(exc)) from None
        await _navigate(ctx, page, visit)
        await _judge_answer(ctx, context, visit)
        if 200 <= visit.status < 300 and is_challenge_page(visit.body):
            # A challenge served as 200: a block signal, never waited out.
            await _blocked(
                ctx, context, "challenged", visit, f"HTTP {visit.status}, challenge page"
            )
        try:
            return await _read_page(ctx, context, page, spec, visit)
        except PlaywrightError as exc:
            if page.is_closed() or _CLOSED in str(exc):
                # Its browser died under the visit: worth another attempt, in a new one.
                raise RetryLater(BROWSER_UNAVAILABLE, detail=_first_line(exc)) from None
            raise
    finally:
        visit.ended = True
        if page is not None:
            # A browser that went away left nothing of the page to close.
            with contextlib.suppress(PlaywrightError):
                await page.close()
        ctx.browser.release(ctx.identity, context)


async def _read_page(
    ctx: HandlerContext, context: BrowserContext, page: Page, spec: PageSpec, visit: _Visit
) -> PageVisit:
    await _wait_for(ctx, context, page, spec, visit)
    if await _shows_challenge(page):
        # One its inline script put up: as much a challenge as one served.
        await _blocked(ctx, context, "challenged", visit, f"HTTP {visit.status}, challenge page")
    room = ctx.objects.max_output_bytes if ctx.objects is not None else MAX_READ_CHARS
    values: dict[str, ExtractedValue] = {}
    for name, ex in spec.extract.items():
        values[name], size = await _read(page, name, ex.selector, ex.attr, ex.all, room)
        room -= size
    shot = await _screenshot(ctx, page) if spec.screenshot else None
    return PageVisit(
        status=visit.status,
        final_url=visit.final_url,
        title=await page.evaluate(_TITLE),
        values=values,
        screenshot=shot,
        blocked_requests=visit.aborted + visit.refused,
    )


async def _shows_challenge(page: Page) -> bool:
    """Whether the page as it stands carries the challenge marker (read in the page: its
    text may hold lone surrogates, which no UTF-8 copy of it could)."""
    return bool(await page.evaluate(_HAS_CHALLENGE, CHALLENGE_ID))


def _first_line(exc: BaseException) -> str:
    """Playwright's messages run to a call log of many lines: the first says what."""
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


def _budget_s(ctx: HandlerContext) -> float:
    return ctx.order.timeout_s or ctx.target.timeout_s


def _left_ms(ends_at: float) -> float:
    """Milliseconds until ``ends_at``, as Playwright's timeouts take them (at least 1:
    0 would mean no timeout at all)."""
    return max(1.0, (ends_at - time.monotonic()) * 1000)


async def _navigate(ctx: HandlerContext, page: Page, visit: _Visit) -> None:
    ends_at = visit.ends_at
    page.on("console", lambda message: _count_refusal(visit, message))
    await page.route("**/*", visit.route)
    try:
        # Committed, then loaded: a page that starts a navigation while it is parsed (a
        # script's click, a form post) would hold a goto waiting for its load for ever,
        # that navigation being aborted (the page stays as it was served).
        await page.goto(ctx.order.job.url, wait_until="commit", timeout=_left_ms(ends_at))
        # Asked of the document itself: Playwright's own load tracking waits for the
        # aborted navigation's instead.
        await page.wait_for_function(_LOADED, timeout=_left_ms(ends_at))
    except PlaywrightTimeout:
        if visit.failure is None:
            raise RetryLater("timeout", detail=f"no page within {_budget_s(ctx):g} s") from None
    except PlaywrightError as exc:
        if page.is_closed() or _CLOSED in str(exc):
            raise RetryLater(BROWSER_UNAVAILABLE, detail=_first_line(exc)) from None
        if visit.failure is None:
            raise RetryLater("network-error", detail=_first_line(exc)) from None
    if visit.failure is not None and not isinstance(visit.failure, PlaywrightError):
        raise visit.failure  # a manners verdict (robots, permit, redirect), or a crash
    if visit.failure is not None:
        detail = _first_line(visit.failure)
        if "Timeout" in type(visit.failure).__name__ or "imeout" in detail:
            raise RetryLater("timeout", detail=detail)
        raise RetryLater("network-error", detail=detail)


async def _judge_answer(ctx: HandlerContext, context: BrowserContext, visit: _Visit) -> None:
    """Raise what the document's status says, as ``http.get`` judges it."""
    status = visit.status
    if status in (404, 410):
        raise PermanentFailure(f"http-{status}", detail=f"{visit.final_url} answered {status}")
    if status in BLOCK_STATUS:
        kind = block_kind(status, visit.body)
        await _blocked(ctx, context, kind, visit, f"HTTP {status}")
    if status in _RETRYABLE_STATUS or status >= 500:
        raise RetryLater(f"http-{status}", delay_s=retry_after_s(visit.retry_after, visit.date))


async def _blocked(
    ctx: HandlerContext, context: BrowserContext, kind: str, visit: _Visit, detail: str
) -> None:
    """Raise the block signal, first discarding a challenged session's cookies."""
    if kind == "challenged":
        host = urlsplit(ctx.target.base_url).hostname or ""
        # The challenged session is dead: its cookies go, the job is requeued.
        await context.clear_cookies(domain=host)
    raise Blocked(
        kind,
        retry_after_s(visit.retry_after, visit.date),
        detail=f"{detail} (browser; left as it is, not solved)",
        status=visit.status,
    )


async def _wait_for(
    ctx: HandlerContext,
    context: BrowserContext,
    page: Page,
    spec: PageSpec,
    visit: _Visit,
) -> None:
    ends_at = visit.ends_at
    if spec.wait_for is None:
        return
    assert ctx.browser is not None
    wait_s = spec.wait_timeout_s or ctx.browser.settings.wait_timeout_s
    # Cut short by the attempt's budget, a wait proves nothing of the page.
    whole = wait_s * 1000 <= _left_ms(ends_at)
    try:
        await page.wait_for_selector(
            spec.wait_for, state="attached", timeout=min(wait_s * 1000, _left_ms(ends_at))
        )
    except PlaywrightTimeout:
        await _after_the_wait_ran_out(ctx, context, page, spec.wait_for, visit, wait_s, whole)
    except PlaywrightError as exc:
        _bad_selector(page, exc)


async def _after_the_wait_ran_out(
    ctx: HandlerContext,
    context: BrowserContext,
    page: Page,
    selector: str,
    visit: _Visit,
    wait_s: float,
    whole: bool,
) -> None:
    """Return if ``selector`` is on the page after all (the wait was starved: the page's
    scripts or a loaded machine held its thread past it); else raise what its absence
    says. ``selector-removed`` is permanent, so it is said only of a page that answered
    within ``STARVED_S``, whose scripts had their turn."""
    try:
        asked = time.monotonic()
        challenged = await _shows_challenge(page)
        # The worker's own event-loop lag counts too (not the page's clock: the worker
        # never reads the wall clock, I9): a worker that slow cannot judge either.
        busy_s = time.monotonic() - asked
        found = not challenged and await page.query_selector(selector) is not None
    except PlaywrightError as exc:
        _asked_again_failed(page, exc)
    if challenged:
        # A challenge served as 200: still a block signal, never solved.
        await _blocked(ctx, context, "challenged", visit, f"HTTP {visit.status}, challenge page")
    if found:
        return
    if not whole:
        raise RetryLater("timeout", detail=f"the attempt's budget ran out waiting for {selector!r}")
    if busy_s > STARVED_S:
        raise RetryLater(
            PAGE_BUSY,
            detail=f"{selector!r} not on {visit.final_url} within {wait_s:g} s, and the page "
            f"too busy to judge (it took {busy_s:.1f} s to answer)",
        )
    raise PermanentFailure(
        SELECTOR_REMOVED, detail=f"{selector!r} not on {visit.final_url} within {wait_s:g} s"
    )


def _asked_again_failed(page: Page, exc: PlaywrightError) -> NoReturn:
    """What an error of the question asked after a wait ran out says: the wait took the
    selector, so its syntax is to blame only when the browser says so (a starved page
    may not have parsed it yet); a page gone or crashed is retried in a new one, and
    anything else (a navigation under the question) is retried."""
    text = str(exc)
    if page.is_closed() or _CLOSED in text or _CRASHED in text:
        raise RetryLater(BROWSER_UNAVAILABLE, detail=_first_line(exc)) from None
    if any(word in text for word in _SELECTOR_REFUSED):
        raise PermanentFailure("bad-selector", detail=_first_line(exc)) from None
    raise RetryLater("timeout", detail=_first_line(exc)) from None


def _bad_selector(page: Page, exc: PlaywrightError) -> NoReturn:
    """Raise ``bad-selector`` for a selector Chromium refused, or ``exc`` itself when the
    page's browser went away under the call (not the job's fault: retried)."""
    if page.is_closed() or _CLOSED in str(exc):
        raise exc
    raise PermanentFailure("bad-selector", detail=_first_line(exc)) from None


async def _read(
    page: Page, name: str, selector: str, attr: str, every: bool, room: int
) -> tuple[ExtractedValue, int]:
    """Field ``name``'s value and its size in characters, within ``room`` of them."""
    try:
        found, over = await page.eval_on_selector_all(
            selector, _READ_ALL, [attr, MAX_VALUES_PER_FIELD if every else 1, max(0, room)]
        )
    except PlaywrightError as exc:
        _bad_selector(page, exc)
    if over:
        raise PermanentFailure(
            RESULT_TOO_LARGE,
            detail=f"extract field {name!r} ({selector!r}) reads more text than a result "
            f"carries ({room} characters were left of it)",
        )
    size = sum(len(value) for value in found if value is not None)
    if every:
        return [value for value in found if value is not None], size
    return (found[0] if found else None), size


async def _screenshot(ctx: HandlerContext, page: Page) -> StoredObject | None:
    """The viewport as PNG, kept in the result object store (None outside a worker,
    which has no store)."""
    assert ctx.browser is not None
    data = await page.screenshot(type="png")
    cap = ctx.browser.settings.max_screenshot_bytes
    if len(data) > cap:
        raise PermanentFailure(
            RESULT_TOO_LARGE,
            detail=f"screenshot of {len(data)} bytes, over worker.browser.max_screenshot_bytes "
            f"({cap})",
        )
    if ctx.objects is None:
        return None
    return await ctx.objects.put(ctx.order, "screenshot.png", data)
