"""The built-in handlers: ``http.get`` (aiohttp) and ``noop`` (``browser.page`` is in
browser_page.py)."""

from __future__ import annotations

import hashlib

import aiohttp
import msgspec

from jetfleet.errors import Blocked, PermanentFailure, RetryLater
from jetfleet.schemas import HandlerOutput, HttpFetch, NoopOutput
from jetfleet.worker.block_signal import BLOCK_STATUS, block_kind
from jetfleet.worker.handlers import HandlerContext, handler
from jetfleet.worker.result_objects import RESULT_TOO_LARGE
from jetfleet.worker.retry_after import retry_after_s
from jetfleet.worker.target_scope import redirect_to

# Headers worth keeping in a result; the rest is noise for the record.
_KEPT_HEADERS = (
    "content-type",
    "content-length",
    "etag",
    "last-modified",
    "retry-after",
    "cache-control",
    "location",
)
_RETRYABLE_STATUS = {500, 502, 504, 408}
_REDIRECT_STATUS = {301, 302, 303, 307, 308}
# As many hops as aiohttp would follow by itself.
MAX_REDIRECTS = 10


@handler("noop", requests_target=False)
async def noop(ctx: HandlerContext) -> HandlerOutput:
    """Do nothing; for benchmarks and tests of the job path itself."""
    return NoopOutput()


@handler("http.get")
async def http_get(ctx: HandlerContext) -> HandlerOutput:
    """Fetch the job's URL once, politely: identifying User-Agent, timeout, size cap.

    Records status, a few headers and the body's SHA-256; keeps the body only when the job
    asked (``store_body``): inline, or in the result object store when it is larger than
    ``fleet.max_inline_bytes``. A body over the target's ``max_body_bytes`` is a
    permanent ``result-too-large`` (it is read no further). With ``args.expect`` set, a
    page without that text is a permanent ``selector-removed`` failure. 404/410 are
    permanent; 5xx and timeouts are worth a retry; 429/403/503 are back-off signals,
    never obstacles to get around.
    Redirects are followed only under the target's ``base_url`` or to its
    ``redirect_hosts``; one leading elsewhere is a permanent ``redirect-off-target``.
    """
    timeout = aiohttp.ClientTimeout(total=ctx.order.timeout_s)
    headers = {"User-Agent": ctx.user_agent, "X-Jetfleet-Worker": ctx.worker_id}
    url = ctx.order.job.url
    try:
        for hop in range(MAX_REDIRECTS + 1):
            if hop and ctx.another_request is not None:
                # Each hop is a request: robots.txt must allow it, and it takes a permit.
                await ctx.another_request(url)
            # Hop by hop, so each Location is checked before anything is sent there.
            async with ctx.session.get(
                url, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                location = response.headers.get("Location")
                if response.status not in _REDIRECT_STATUS or location is None:
                    body, over_cap = await _read_capped(response, ctx.target.max_body_bytes)
                    fetch = _classify(ctx, response, body, over_cap)
                    return await _with_body(ctx, fetch, body, response.charset)
            url = redirect_to(url, location, ctx.target)
        raise PermanentFailure(
            "too-many-redirects", detail=f"more than {MAX_REDIRECTS} from {ctx.order.job.url}"
        )
    except TimeoutError:
        raise RetryLater("timeout", detail=f"no answer within {ctx.order.timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise RetryLater("network-error", detail=str(exc)) from None


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], True
    return b"".join(chunks), False


def _classify(
    ctx: HandlerContext, response: aiohttp.ClientResponse, body: bytes, over_cap: bool
) -> HttpFetch:
    status = response.status
    retry_after = retry_after_s(response.headers.get("Retry-After"), response.headers.get("Date"))
    if status in (404, 410):
        raise PermanentFailure(f"http-{status}", detail=f"{ctx.order.job.url} answered {status}")
    if status in BLOCK_STATUS:
        # Blocks and challenges are signals to back off (docs/scope.md).
        raise Blocked(block_kind(status, body), retry_after, detail=f"HTTP {status}", status=status)
    if status in _RETRYABLE_STATUS or status >= 500:
        raise RetryLater(f"http-{status}", delay_s=retry_after)
    if over_cap:
        # Cut, it would be a wrong page recorded as the right one; fetched again, it
        # would be as long. One request, then a dead letter that says which cap.
        raise PermanentFailure(
            RESULT_TOO_LARGE,
            detail=f"{ctx.order.job.url}: body over targets.{ctx.order.target}.max_body_bytes "
            f"({ctx.target.max_body_bytes} bytes)",
        )
    expect = ctx.order.job.args.get("expect", "")
    if expect and expect.encode() not in body:
        # The page no longer has what the job extracts: retrying cannot help.
        raise PermanentFailure("selector-removed", detail=f"{expect!r} not in the page")
    kept = {k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS}
    return HttpFetch(
        status=status,
        final_url=str(response.url),
        headers=kept,
        body_sha256=hashlib.sha256(body).hexdigest(),
        body_bytes=len(body),
    )


async def _with_body(
    ctx: HandlerContext, fetch: HttpFetch, body: bytes, charset: str | None
) -> HttpFetch:
    """``fetch`` with the body kept as the job asked: inline when it fits a message,
    otherwise its exact bytes in the result object store."""
    if not ctx.order.job.store_body:
        return fetch
    text = body.decode(charset or "utf-8", errors="replace")
    # Measured as JSON carries it: escapes can make text several times longer.
    if ctx.objects is None or ctx.objects.fits_inline(len(msgspec.json.encode(text))):
        return msgspec.structs.replace(fetch, body=text)
    stored = await ctx.objects.put(ctx.order, "body", body)
    return msgspec.structs.replace(fetch, body_object=stored)
