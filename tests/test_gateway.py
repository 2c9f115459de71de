"""The gateway over real servers: HTTP in, jobs through the fleet, counts back out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from jetfleet.schemas import Rejection
from jetfleet.services.gateway import Gateway
from jetfleet.services.gateway.access import check_write, is_loopback
from jetfleet.services.gateway.batch import MAX_ITEMS, max_body_bytes
from jetfleet.services.gateway.metrics import MAX_UNDECLARED, render_metrics
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.auth.credentials import settings_for_role
from jetfleet.connection import connect_nats
from jetfleet.metrics import OTHER
from jetfleet.ops.status import FIELDS, FleetStatus, TargetCounts
from jetfleet.results import iter_results
from jetfleet.settings import GatewaySettings, Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import wait_for
from tests.prom_text import value
from tests.stack import InProcessStack

OpenGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def open_gateway(settings: Settings, nc: NatsClient) -> AsyncIterator[OpenGateway]:
    """Start gateways on a free port, each on its own NATS connection as in production."""
    started: list[tuple[Gateway, NatsClient]] = []

    async def open_(**gateway: Any) -> Gateway:
        options: dict[str, Any] = {"port": 0, **gateway}
        own = msgspec.structs.replace(settings, gateway=GatewaySettings(**options))
        own = settings_for_role(own, "gateway")
        conn = await connect_nats(settings.nats, "gateway", role="gateway")
        service = Gateway(own, conn)
        started.append((service, conn))
        await service.start()
        return service

    yield open_
    for service, conn in started:
        await service.drain(5.0)
        await conn.close()


@pytest.fixture
async def gateway(open_gateway: OpenGateway) -> Gateway:
    return await open_gateway()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def post(
    http: aiohttp.ClientSession, url: str, body: bytes | Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    async with http.post(url, data=data, headers=headers) as response:
        return response.status, await response.json()


async def wait_totals(
    gateway: Gateway, http: aiohttp.ClientSession, what: str, **expected: int
) -> dict[str, Any]:
    """Poll /v1/status until the totals show ``expected``; return that status."""
    seen: dict[str, Any] = {}

    async def holds() -> bool:
        seen.update(await get_json(http, f"{gateway.url}/v1/status"))
        return all(seen["totals"][k] == v for k, v in expected.items())

    await wait_for(holds, 60, what)
    return seen


async def test_healthz_reports_the_nats_connection(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    assert gateway.url.startswith("http://127.0.0.1:")
    assert await get_json(http, f"{gateway.url}/healthz") == {"ok": True, "nats": "connected"}

    await gateway.nc.close()
    async with http.get(f"{gateway.url}/healthz") as response:
        assert response.status == 503
        assert await response.json() == {"ok": False, "nats": "closed"}
    # A handler that meets the closed connection answers JSON; the gateway keeps serving.
    async with http.get(f"{gateway.url}/v1/status") as response:
        assert response.status == 503
        assert "NATS is unavailable" in (await response.json())["error"]
    async with http.get(f"{gateway.url}/") as response:
        assert response.status == 200


async def test_a_batch_of_relative_urls_is_committed_and_counted(
    gateway: Gateway, stack: InProcessStack, http: aiohttp.ClientSession, nc: NatsClient
) -> None:
    jobs = [{"url": f"/page/{n}"} for n in range(20)]  # no ids: the gateway assigns them

    status, answer = await post(http, f"{gateway.url}/v1/targets/demo/jobs", jobs)

    assert status == 202, answer
    assert answer["rejected"] == []
    assert len(set(answer["accepted"])) == 20
    shown = await wait_totals(gateway, http, "20 commits", committed=20)
    assert shown["totals"] == {
        "submitted": 20,
        "queued": 0,
        "leased": 0,
        "committed": 20,
        "dead": 0,
        "rejected": 0,
    }
    assert shown["targets"]["demo"] == shown["totals"]
    assert shown["admitting"] == 0
    # Same shape and numbers as `jetfleet status --json` (both encode fleet_status);
    # how many reads each took depends on the moment it read.
    cli_status = msgspec.to_builtins(await stack.status())
    assert shown.pop("reads") >= 1 and cli_status.pop("reads") >= 1
    assert shown == cli_status
    # The assigned ids are the jobs' ids, and each relative URL was resolved.
    committed = [r async for r in iter_results(nc.jetstream(), "demo")]
    assert sorted(r.job_id for r in committed) == sorted(answer["accepted"])
    base = gateway.settings.targets["demo"].base_url
    assert sorted(r.url for r in committed) == sorted(f"{base}page/{n}" for n in range(20))


async def test_a_mixed_batch_lists_each_rejection_and_runs_the_rest(
    gateway: Gateway,
    stack: InProcessStack,
    http: aiohttp.ClientSession,
    simulator: TargetSimulator,
) -> None:
    jobs = [
        {"id": "ok-0", "url": "/page/0"},
        {"id": "bad-handler", "url": "/page/1", "handler": "no.such.handler"},
        {"id": "ok-2", "url": f"{simulator.base_url}/page/2"},
        {"id": "elsewhere", "url": "https://example.invalid/page/3"},
        {"id": "ok-4", "url": "page/4"},
    ]

    status, answer = await post(http, f"{gateway.url}/v1/targets/demo/jobs", jobs)

    assert status == 400
    assert answer["accepted"] == ["ok-0", "ok-2", "ok-4"]
    assert [(r["index"], r["job_id"], r["reason"]) for r in answer["rejected"]] == [
        (1, "bad-handler", "unknown-handler"),
        (3, "elsewhere", "url-outside-target"),
    ]
    assert all(r["message"] for r in answer["rejected"])
    shown = await wait_totals(gateway, http, "3 commits and 2 rejections", committed=3, rejected=2)
    assert shown["targets"]["demo"]["submitted"] == 5
    assert shown["totals"]["dead"] == 0


@pytest.mark.parametrize("body", [b"this is {not json", b'"a JSON string"', b"[]"])
async def test_a_body_that_is_not_a_job_is_refused_and_kept(
    gateway: Gateway,
    stack: InProcessStack,
    http: aiohttp.ClientSession,
    nc: NatsClient,
    body: bytes,
) -> None:
    before = (await get_json(http, f"{gateway.url}/v1/status"))["totals"]["rejected"]

    status, answer = await post(http, f"{gateway.url}/v1/targets/demo/jobs", body)

    assert status == 400
    assert answer["error"]
    await wait_totals(gateway, http, "the rejection", rejected=before + 1)
    kept = [
        msgspec.json.decode(m.data, type=Rejection)
        async for m in read_stream(
            nc.jetstream(), subjects.STREAM_REJECTED, subjects.rejected("demo")
        )
    ]
    assert [r.raw for r in kept] == [body]
    assert answer["reason"] == kept[0].reason


async def test_an_unknown_target_is_published_and_rejected_by_name(
    gateway: Gateway, stack: InProcessStack, http: aiohttp.ClientSession
) -> None:
    status, answer = await post(
        http, f"{gateway.url}/v1/targets/nope/jobs", {"id": "j1", "url": "/page/1"}
    )

    assert status == 400
    assert answer["accepted"] == []
    [rejected] = answer["rejected"]
    assert (rejected["index"], rejected["job_id"], rejected["reason"]) == (
        0,
        "j1",
        "unknown-target",
    )
    assert "[targets.nope]" in rejected["message"]
    shown = await wait_totals(gateway, http, "the rejection", rejected=1)
    assert shown["targets"]["nope"]["rejected"] == 1


async def test_a_target_name_that_is_no_subject_token_is_refused_and_kept(
    gateway: Gateway, stack: InProcessStack, http: aiohttp.ClientSession
) -> None:
    status, answer = await post(
        http, f"{gateway.url}/v1/targets/Bad%20Name.x/jobs", {"url": "/page/1"}
    )

    assert status == 400
    assert "not valid" in answer["error"]
    shown = await wait_totals(gateway, http, "the rejection", rejected=1)
    assert shown["targets"][subjects.UNPARSABLE_TARGET]["rejected"] == 1


async def test_oversized_requests_are_refused_with_413(
    gateway: Gateway, nc: NatsClient, http: aiohttp.ClientSession
) -> None:
    url = f"{gateway.url}/v1/targets/demo/jobs"
    limit = max_body_bytes(gateway.settings)

    status, answer = await post(http, url, b"[" + b" " * limit + b"]")
    assert status == 413
    assert str(limit) in answer["error"] and "split" in answer["error"]

    status, answer = await post(http, url, [{}] * (MAX_ITEMS + 1))
    assert status == 413
    assert str(MAX_ITEMS) in answer["error"]


async def test_a_configured_token_is_required_for_posts(
    open_gateway: OpenGateway, stack: InProcessStack, http: aiohttp.ClientSession
) -> None:
    gateway = await open_gateway(token="s3cret")
    url = f"{gateway.url}/v1/targets/demo/jobs"
    job = {"id": "t1", "url": "/page/1"}

    status, answer = await post(http, url, job)
    assert status == 401
    assert "Authorization: Bearer" in answer["error"]
    status, _ = await post(http, url, job, {"Authorization": "Bearer wrong"})
    assert status == 401

    status, answer = await post(http, url, job, {"Authorization": "Bearer s3cret"})
    assert (status, answer["accepted"]) == (202, ["t1"])


async def test_with_a_token_reads_beyond_health_need_it_unless_open_reads(
    open_gateway: OpenGateway, http: aiohttp.ClientSession
) -> None:
    closed = await open_gateway(token="s3cret")
    for path in ("/v1/status", "/metrics"):
        async with http.get(closed.url + path) as response:
            assert response.status == 401, path
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        async with http.get(
            closed.url + path, headers={"Authorization": "Bearer s3cret"}
        ) as response:
            assert response.status == 200, path
    async with http.get(closed.url + "/healthz") as response:
        assert response.status == 200
    opened = await open_gateway(token="s3cret", open_reads=True)
    await get_json(http, f"{opened.url}/v1/status")


async def test_a_request_beyond_the_concurrency_cap_is_answered_503_at_once(
    open_gateway: OpenGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await open_gateway(max_concurrent=1, token="s3cret")
    release = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b'{"id": "slow-1", '  # the first request stays in flight, reading its body
        await release.wait()
        yield b'"url": "/page/1"}'

    auth = {"Authorization": "Bearer s3cret"}
    first = asyncio.ensure_future(
        http.post(f"{gateway.url}/v1/targets/demo/jobs", data=slow_body(), headers=auth)
    )

    async def in_flight() -> bool:
        return gateway._inflight == 1

    await wait_for(in_flight, 10, "the first request in flight")
    async with http.get(f"{gateway.url}/healthz") as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert "gateway.max_concurrent" in (await response.json())["error"]
    release.set()
    async with await first as response:
        assert response.status in (202, 400), await response.text()


async def test_a_request_that_outlasts_its_time_is_answered_504(
    open_gateway: OpenGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await open_gateway(request_timeout_s=1e-9)
    async with http.get(f"{gateway.url}/v1/status") as response:
        assert response.status == 504
        assert "gateway.request_timeout_s" in (await response.json())["error"]


async def test_without_a_token_posts_need_a_loopback_listener(
    open_gateway: OpenGateway, http: aiohttp.ClientSession
) -> None:
    gateway = await open_gateway(host="0.0.0.0")  # every interface, for this test only
    port = gateway.url.rsplit(":", 1)[1]

    status, answer = await post(
        http, f"http://127.0.0.1:{port}/v1/targets/demo/jobs", {"url": "/page/1"}
    )

    assert status == 403
    assert "set gateway.token" in answer["error"]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gateway.internal", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    allowed = check_write(GatewaySettings(host=host), None, "localhost:8080") is None
    assert allowed is loopback


async def test_metrics_are_prometheus_gauges_of_the_status(
    gateway: Gateway, stack: InProcessStack, http: aiohttp.ClientSession
) -> None:
    await post(
        http,
        f"{gateway.url}/v1/targets/demo/jobs",
        [{"url": f"/page/{n}"} for n in range(3)] + [{"url": "/page/9", "handler": "x"}],
    )
    await wait_totals(gateway, http, "3 commits, 1 rejection", committed=3, rejected=1)

    async with http.get(f"{gateway.url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
        lines = text.splitlines()

    assert "# TYPE jetfleet_jobs gauge" in lines
    assert "# TYPE jetfleet_admitting gauge" in lines
    assert any(line.startswith("# HELP jetfleet_jobs ") for line in lines)
    expected = {"submitted": 4, "queued": 0, "leased": 0, "committed": 3, "dead": 0, "rejected": 1}
    for state in FIELDS:
        assert value(text, "jetfleet_jobs", target="demo", state=state) == expected[state]
    assert value(text, "jetfleet_admitting") == 0
    assert value(text, "jetfleet_unaccounted_jobs") == 0
    assert value(text, "jetfleet_ratelimit_ok") == 1


def test_item10_metrics_show_declared_targets_and_fold_a_flood_of_made_up_ones() -> None:
    # Each made-up name costs an attacker one publish to jf.submit.<name>; its refused
    # submissions show in the status, but must not grow /metrics without end.
    targets = {"demo": TargetCounts(submitted=5, committed=5)}
    targets |= {f"junk-{n:05}": TargetCounts(submitted=1, rejected=1) for n in range(5000)}
    status = FleetStatus(totals=TargetCounts(), targets=targets)
    text = render_metrics(status, declared={"demo"})
    series = [line for line in text.splitlines() if line.startswith("jetfleet_jobs{")]
    assert len(series) == (1 + MAX_UNDECLARED + 1) * len(FIELDS)
    assert value(text, "jetfleet_jobs", target="demo", state="committed") == 5
    folded = 5000 - MAX_UNDECLARED
    assert value(text, "jetfleet_jobs", target=OTHER, state="rejected") == folded
    assert value(text, "jetfleet_jobs", target=OTHER, state="submitted") == folded


async def test_the_dashboard_is_one_self_contained_page(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{gateway.url}/") as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        page = await response.text()
    assert "<title>jetfleet</title>" in page
    assert "/v1/status" in page
    assert "src=" not in page and "<link" not in page  # no external assets


async def test_drain_stops_accepting(gateway: Gateway, http: aiohttp.ClientSession) -> None:
    url = gateway.url
    await gateway.drain(5.0)

    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(f"{url}/healthz"):
            pass
    with pytest.raises(RuntimeError):
        _ = gateway.url
    await gateway.drain(5.0)  # a second drain is harmless


async def test_a_cross_site_form_cannot_submit_jobs_through_a_tokenless_loopback_gateway(
    gateway: Gateway, nc: NatsClient, http: aiohttp.ClientSession
) -> None:
    # A page on another site may post a form (no preflight) to 127.0.0.1: the browser
    # names that site in Origin, which no API client (curl, the CLI) sends.
    url = f"{gateway.url}/v1/targets/demo/jobs"
    form = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    status, answer = await post(http, url, b'{"url": "/page/1"}', headers=form)
    assert status == 403, answer
    assert "another origin" in answer["error"]
    status, answer = await post(http, url, b'{"url": "/page/1"}', headers={"Origin": gateway.url})
    assert status == 202, answer
    submitted = [
        m async for m in read_stream(nc.jetstream(), subjects.STREAM_SUBMIT, "jf.submit.>")
    ]
    assert len(submitted) == 1
