"""The built-in handlers: ``http.get`` (aiohttp) and ``noop``."""

from __future__ import annotations

import hashlib

import aiohttp

from jetfleet.errors import Blocked, PermanentFailure, RetryLater
from jetfleet.schemas import HandlerOutput, HttpFetch, NoopOutput
from jetfleet.worker.handlers import HandlerContext, handler
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
_BLOCK_STATUS = {403, 429, 503}


@handler("noop")
async def noop(ctx: HandlerContext) -> HandlerOutput:
    """Do nothing; for benchmarks and tests of the job path itself."""
    return NoopOutput()


@handler("http.get")
async def http_get(ctx: HandlerContext) -> HandlerOutput:
    """Fetch the job's URL once, politely: identifying User-Agent, timeout, size cap.

    Records status, a few headers and the body's SHA-256; keeps the body only when the job
    asked (``store_body``). With ``args.expect`` set, a page without that text is a
    permanent ``selector-removed`` failure. 404/410 are permanent; 5xx and timeouts are
    worth a retry; 429/403/503 are back-off signals, never obstacles to get around.
    Redirects are followed only under the target's ``base_url`` or to its
    ``redirect_hosts``; one leading elsewhere is a permanent ``redirect-off-target``.
    """
    timeout = aiohttp.ClientTimeout(total=ctx.order.timeout_s)
    headers = {"User-Agent": ctx.user_agent, "X-Jetfleet-Worker": ctx.worker_id}
    url = ctx.order.job.url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            # Hop by hop, so each Location is checked before anything is sent there.
            async with ctx.session.get(
                url, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                location = response.headers.get("Location")
                if response.status not in _REDIRECT_STATUS or location is None:
                    body, truncated = await _read_capped(response, ctx.target.max_body_bytes)
                    return _classify(ctx, response, body, truncated)
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
    ctx: HandlerContext, response: aiohttp.ClientResponse, body: bytes, truncated: bool
) -> HandlerOutput:
    status = response.status
    retry_after = retry_after_s(response.headers.get("Retry-After"), response.headers.get("Date"))
    if status in (404, 410):
        raise PermanentFailure(f"http-{status}", detail=f"{ctx.order.job.url} answered {status}")
    if status in _BLOCK_STATUS:
        # Blocks and challenges are signals to back off (docs/scope.md).
        raise Blocked(_block_kind(status, body), retry_after, detail=f"HTTP {status}")
    if status in _RETRYABLE_STATUS or status >= 500:
        raise RetryLater(f"http-{status}", delay_s=retry_after)
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
        body=body.decode(response.charset or "utf-8", errors="replace")
        if ctx.order.job.store_body
        else None,
        truncated=truncated,
    )


def _block_kind(status: int, body: bytes) -> str:
    if status == 429:
        return "rate-limited"
    if b'id="challenge"' in body or b"challenge" in body[:4096].lower():
        return "challenged"
    return "blocked" if status == 403 else "rate-limited"
