"""Tests for the target simulator, against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from multidict import CIMultiDictProxy

from jetfleet.simulator import Arrival, SimulatorConfig, TargetSimulator, most_in_any_window
from jetfleet.simulator.counters import MAX_PATHS, MAX_WINDOWS, RequestCounters
from jetfleet.simulator.pages import ROBOTS_TXT
from jetfleet.simulator.routes import WORKER_HEADER, parse_delay, parse_retry_after, parse_times

CONTENT_DIV = '<div id="content">'


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[TargetSimulator]:
    async with TargetSimulator(SimulatorConfig()) as simulator:
        yield simulator


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={WORKER_HEADER: "w-test"}) as client:
        yield client


async def _get(
    session: aiohttp.ClientSession, url: str, **kwargs: Any
) -> tuple[int, str, CIMultiDictProxy[str]]:
    async with session.get(url, **kwargs) as resp:
        return resp.status, await resp.text(), resp.headers


async def _wait_until(condition: Callable[[], bool], within_s: float = 2.0) -> None:
    # Polls a real condition; the sleep only yields to the server between checks.
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


# --- lifecycle and config ----------------------------------------------------------


@pytest.mark.asyncio
async def test_start_returns_base_url_on_free_port_and_stop_is_idempotent() -> None:
    simulator = TargetSimulator(SimulatorConfig())
    with pytest.raises(RuntimeError):
        _ = simulator.base_url
    url = await simulator.start()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    assert simulator.base_url == url
    assert not url.endswith(":0")
    with pytest.raises(RuntimeError):
        await simulator.start()
    await simulator.stop()
    await simulator.stop()
    with pytest.raises(RuntimeError):
        _ = simulator.base_url


def test_config_is_frozen_and_validated() -> None:
    config = SimulatorConfig()
    assert (config.latency_s, config.pages) == (0.0, 1_000_000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.latency_s = 1.0  # type: ignore[misc]
    for bad in (
        {"latency_s": -0.1},
        {"latency_s": math.nan},
        {"latency_s": math.inf},
        {"pages": -1},
    ):
        with pytest.raises(ValueError):
            SimulatorConfig(**bad)


# --- routes ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_page_is_deterministic_html_with_content_and_links(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    status, body, headers = await _get(session, f"{sim.base_url}/page/42")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert "<title>Page 42" in body
    assert CONTENT_DIV in body
    assert body.count("<p>") >= 2
    assert re.search(r'<a href="/page/\d+">', body)
    _, again, _ = await _get(session, f"{sim.base_url}/page/42")
    _, other, _ = await _get(session, f"{sim.base_url}/page/43")
    assert again == body
    assert other != body


@pytest.mark.asyncio
async def test_pages_exist_only_below_configured_count(session: aiohttp.ClientSession) -> None:
    async with TargetSimulator(SimulatorConfig(pages=10)) as simulator:
        status, body, _ = await _get(session, f"{simulator.base_url}/page/9")
        assert status == 200
        assert all(int(k) < 10 for k in re.findall(r'href="/page/(\d+)"', body))
        status, _, _ = await _get(session, f"{simulator.base_url}/page/10")
        assert status == 404


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "status", "marker"),
    [
        ("/missing/1", 404, "Not found"),
        ("/blocked/1", 403, "Access denied"),
        ("/challenge/1", 503, '<div id="challenge">'),
        ("/error/1", 500, "Error 500"),
        ("/noselector/1", 200, "<title>Page 1"),
    ],
)
async def test_failure_routes_answer_status_and_html(
    sim: TargetSimulator, session: aiohttp.ClientSession, path: str, status: int, marker: str
) -> None:
    got, body, headers = await _get(session, sim.base_url + path)
    assert got == status
    assert headers["Content-Type"].startswith("text/html")
    assert marker in body


@pytest.mark.asyncio
async def test_noselector_page_lacks_content_div(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    _, body, _ = await _get(session, f"{sim.base_url}/noselector/5")
    assert CONTENT_DIV not in body
    assert "<p>" in body


@pytest.mark.asyncio
async def test_ratelimited_sends_retry_after(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    status, _, headers = await _get(session, f"{sim.base_url}/ratelimited/1")
    assert (status, headers["Retry-After"]) == (429, "2")
    status, _, headers = await _get(session, f"{sim.base_url}/ratelimited/1?retry_after=7")
    assert (status, headers["Retry-After"]) == (429, "7")
    status, _, _ = await _get(session, f"{sim.base_url}/ratelimited/1?retry_after=soon")
    assert status == 400


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "status"), [("blocked", 403), ("challenge", 503)])
async def test_block_pages_send_retry_after_only_when_asked(
    sim: TargetSimulator, session: aiohttp.ClientSession, kind: str, status: int
) -> None:
    got, _, headers = await _get(session, f"{sim.base_url}/{kind}/1")
    assert (got, headers.get("Retry-After")) == (status, None)
    got, _, headers = await _get(session, f"{sim.base_url}/{kind}/1?retry_after=7")
    assert (got, headers["Retry-After"]) == (status, "7")
    got, _, _ = await _get(session, f"{sim.base_url}/{kind}/1?retry_after=soon")
    assert got == 400


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "status"), [("blocked", 403), ("challenge", 503)])
async def test_block_pages_with_times_refuse_only_the_first_requests_to_a_path(
    sim: TargetSimulator, session: aiohttp.ClientSession, kind: str, status: int
) -> None:
    statuses = [(await _get(session, f"{sim.base_url}/{kind}/1?times=2"))[0] for _ in range(3)]
    assert statuses == [status, status, 200]
    assert (await _get(session, f"{sim.base_url}/{kind}/2?times=x"))[0] == 400


@pytest.mark.asyncio
async def test_slow_waits_at_least_delay(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    started = time.monotonic()
    status, body, _ = await _get(session, f"{sim.base_url}/slow/1?delay=0.1")
    assert time.monotonic() - started >= 0.1
    assert status == 200
    assert CONTENT_DIV in body
    status, _, _ = await _get(session, f"{sim.base_url}/slow/1?delay=-1")
    assert status == 400


def test_query_parsing_defaults_caps_and_rejects() -> None:
    assert parse_delay(None) == 1.0
    assert parse_delay("0.25") == 0.25
    assert parse_delay("1000") == 60.0
    for bad in ("nan", "inf", "-1", "x"):
        with pytest.raises(ValueError):
            parse_delay(bad)
    assert parse_retry_after(None) == 2
    assert parse_retry_after("0") == 0
    for bad in ("-1", "1.5", "x"):
        with pytest.raises(ValueError):
            parse_retry_after(bad)


@pytest.mark.asyncio
async def test_hang_never_answers_before_client_gives_up(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await _get(session, f"{sim.base_url}/hang/1", timeout=aiohttp.ClientTimeout(total=0.2))
    assert sim.counts()["by_path_kind"]["hang"] == 1


@pytest.mark.asyncio
async def test_stop_drops_hanging_request_promptly(session: aiohttp.ClientSession) -> None:
    simulator = TargetSimulator(SimulatorConfig())
    await simulator.start()
    pending = asyncio.create_task(_get(session, f"{simulator.base_url}/hang/1"))
    await _wait_until(lambda: simulator.counts()["by_path_kind"].get("hang", 0) == 1)
    started = time.monotonic()
    await simulator.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(pending, timeout=2.0)


@pytest.mark.asyncio
async def test_release_hung_answers_the_hung_requests_and_later_ones_hang_again(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    hung = [asyncio.create_task(_get(session, f"{sim.base_url}/hang/{n}")) for n in range(2)]
    await _wait_until(lambda: sim.in_flight("hang") == 2)
    assert sim.release_hung() == 2
    answers = await asyncio.wait_for(asyncio.gather(*hung), timeout=2.0)
    assert [status for status, _, _ in answers] == [504, 504]
    assert sim.in_flight() == 0
    later = asyncio.create_task(_get(session, f"{sim.base_url}/hang/3"))
    await _wait_until(lambda: sim.in_flight("hang") == 1)
    assert not later.done()
    assert sim.release_hung() == 1
    assert (await asyncio.wait_for(later, timeout=2.0))[0] == 504


@pytest.mark.asyncio
async def test_robots_txt_disallows_private_only(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    status, body, headers = await _get(session, f"{sim.base_url}/robots.txt")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert "User-agent: *" in body
    assert [line for line in body.splitlines() if line.startswith("Disallow")] == [
        "Disallow: /private/"
    ]


# --- counting ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_counts_per_client_and_kind_excluding_sim_routes(sim: TargetSimulator) -> None:
    base = sim.base_url
    async with aiohttp.ClientSession() as plain:
        await _get(plain, f"{base}/page/1", headers={WORKER_HEADER: "w-1"})
        await _get(plain, f"{base}/page/2", headers={WORKER_HEADER: "w-1"})
        await _get(plain, f"{base}/error/1", headers={WORKER_HEADER: "w-2"})
        await _get(plain, f"{base}/robots.txt", headers={"User-Agent": "agent/1.0"})
        await _get(plain, f"{base}/nowhere")
        await _get(plain, f"{base}/__sim/config")
    async with aiohttp.ClientSession(skip_auto_headers=["User-Agent"]) as anonymous:
        await _get(anonymous, f"{base}/page/3")
        async with anonymous.get(f"{base}/__sim/counts") as resp:
            served = await resp.json()

    counts = sim.counts()
    assert served == counts
    assert counts["total"] == 6
    assert counts["by_client"]["w-1"] == 2
    assert counts["by_client"]["w-2"] == 1
    assert counts["by_client"]["agent/1.0"] == 1
    assert counts["by_client"]["127.0.0.1"] == 1
    assert sum(counts["by_client"].values()) == 6
    assert counts["by_path_kind"] == {"page": 3, "error": 1, "robots": 1, "other": 1}
    assert sim.requests_by_path() == {
        "/page/1": 1, "/page/2": 1, "/page/3": 1, "/error/1": 1, "/robots.txt": 1, "/nowhere": 1
    }  # fmt: skip
    # aiohttp's own User-Agent for every request but two; none at all from "anonymous".
    agents = counts["by_user_agent"]
    assert (agents["agent/1.0"], agents[""], sum(agents.values())) == (1, 1, 6)


@pytest.mark.asyncio
async def test_max_in_flight_counts_requests_handled_at_the_same_moment(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    await _get(session, f"{sim.base_url}/page/1")
    assert sim.counts()["max_in_flight"] == {"page": 1, "*": 1}
    # Three slow requests at once, plus one page while they wait.
    slow = [
        asyncio.create_task(_get(session, f"{sim.base_url}/slow/{n}?delay=0.5")) for n in range(3)
    ]
    await _wait_until(lambda: sim.counts()["by_path_kind"].get("slow", 0) == 3)
    assert (sim.in_flight("slow"), sim.in_flight()) == (3, 3)
    await _get(session, f"{sim.base_url}/page/2")
    await asyncio.gather(*slow)
    assert sim.in_flight() == 0
    assert sim.counts()["max_in_flight"] == {"page": 1, "slow": 3, "*": 4}
    sim.reset()
    assert sim.counts()["max_in_flight"] == {}


@pytest.mark.asyncio
async def test_windows_and_max_in_any_window(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    for n in range(5):
        await _get(session, f"{sim.base_url}/page/{n}")
    counts = sim.counts()
    assert sum(counts["windows"].values()) == 5
    assert all(abs(int(second) - time.time()) < 60 for second in counts["windows"])
    assert 1 <= counts["max_per_second"] <= 5
    assert sim.max_in_any_window(3600) == 5
    with pytest.raises(ValueError):
        sim.max_in_any_window(0)


def test_max_in_any_window_uses_half_open_sliding_windows() -> None:
    now = [0.0]
    counters = RequestCounters(clock=lambda: now[0], wall_clock=lambda: 1_000 + now[0])
    for stamp in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 5.0):
        now[0] = stamp
        counters.record("w", "page")
    assert counters.max_in_any_window(1.0) == 5
    assert counters.max_in_any_window(1.01) == 6
    assert counters.max_in_any_window(0.1) == 1
    assert counters.max_in_any_window(100) == 7
    snapshot = counters.snapshot()
    assert snapshot["windows"] == {"1000": 5, "1001": 1, "1005": 1}
    assert snapshot["max_per_second"] == 5


def test_arrivals_keep_when_kind_and_path_and_windows_count_them_merged() -> None:
    now = [0.0]
    counters = RequestCounters(clock=lambda: now[0])
    for stamp, path in ((0.0, "/page/1"), (0.5, "/error/2"), (2.0, "/page/1")):
        now[0] = stamp
        counters.record("w", path.split("/")[1], path=path)
    assert counters.arrivals() == [
        Arrival(0.0, "page", "/page/1"),
        Arrival(0.5, "error", "/error/2"),
        Arrival(2.0, "page", "/page/1"),
    ]
    # Two simulators' arrivals together: [0, 1) holds three of them.
    merged = [a.at for a in counters.arrivals()] + [0.9]
    assert most_in_any_window(merged, 1.0) == 3
    assert most_in_any_window([], 1.0) == 0
    with pytest.raises(ValueError):
        most_in_any_window(merged, 0)
    counters.reset()
    assert counters.arrivals() == []


@pytest.mark.asyncio
async def test_times_fails_only_the_first_requests_to_a_path_until_reset(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    base = sim.base_url
    statuses = [(await _get(session, f"{base}/error/1?times=1"))[0] for _ in range(3)]
    assert statuses == [500, 200, 200]
    assert (await _get(session, f"{base}/error/2?times=1"))[0] == 500  # per path
    assert (await _get(session, f"{base}/error/3"))[0] == 500  # without times: always
    challenged = [(await _get(session, f"{base}/challenge/1?times=1"))[0] for _ in range(2)]
    assert challenged == [503, 200]
    limited = [await _get(session, f"{base}/ratelimited/1?retry_after=3&times=2") for _ in range(3)]
    assert [status for status, _, _ in limited] == [429, 429, 200]
    assert limited[0][2]["Retry-After"] == "3"
    assert (await _get(session, f"{base}/error/1?times=-1"))[0] == 400
    sim.reset()
    assert (await _get(session, f"{base}/error/1?times=1"))[0] == 500  # fails again
    assert parse_times(None) is None and parse_times("0") == 0


@pytest.mark.asyncio
async def test_rate_limit_next_answers_one_request_429_whatever_its_path(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    sim.rate_limit_next(3)
    status, _, headers = await _get(session, f"{sim.base_url}/page/1")
    assert (status, headers["Retry-After"]) == (429, "3")
    assert (await _get(session, f"{sim.base_url}/page/1"))[0] == 200
    assert [a.kind for a in sim.arrivals()] == ["ratelimited", "page"]
    with pytest.raises(ValueError):
        sim.rate_limit_next(-1)


def test_requests_by_path_counts_paths_until_too_many_are_distinct() -> None:
    counters = RequestCounters()
    for path in ("/page/1", "/page/1", "/error/2"):
        counters.record("w", "page", path=path)
    assert counters.requests_by_path() == {"/page/1": 2, "/error/2": 1}
    for n in range(MAX_PATHS - 2):
        counters.record("w", "page", path=f"/p/{n}")
    assert len(counters.requests_by_path()) == MAX_PATHS  # exactly full: still whole
    counters.record("w", "page", path="/one-too-many")
    with pytest.raises(OverflowError):
        counters.requests_by_path()
    counters.reset()
    assert counters.requests_by_path() == {}


def test_windows_keep_only_the_latest() -> None:
    now = [0.0]
    counters = RequestCounters(clock=lambda: now[0], wall_clock=lambda: now[0])
    for second in range(MAX_WINDOWS + 50):
        now[0] = float(second)
        counters.record("w", "page")
    windows = counters.snapshot()["windows"]
    assert len(windows) == MAX_WINDOWS
    assert min(int(key) for key in windows) == 50
    assert counters.snapshot()["total"] == MAX_WINDOWS + 50


@pytest.mark.asyncio
async def test_reset_zeroes_counters(sim: TargetSimulator, session: aiohttp.ClientSession) -> None:
    await _get(session, f"{sim.base_url}/page/1")
    async with session.post(f"{sim.base_url}/__sim/reset") as resp:
        assert resp.status == 200
    zero = {
        "total": 0,
        "by_client": {},
        "by_user_agent": {},
        "by_path_kind": {},
        "max_in_flight": {},
        "windows": {},
        "max_per_second": 0,
    }
    assert sim.counts() == zero
    assert sim.max_in_any_window(60) == 0
    await _get(session, f"{sim.base_url}/page/1")
    sim.reset()
    assert sim.counts() == zero


# --- runtime config ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_runtime_latency_change_delays_pages(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    async with session.get(f"{sim.base_url}/__sim/config") as resp:
        assert await resp.json() == {
            "latency_s": 0.0,
            "pages": 1_000_000,
            "robots_txt": ROBOTS_TXT,
            "robots_status": 200,
            "storm_s": 0.0,
            "storm_retry_after_s": 2,
        }
    async with session.post(f"{sim.base_url}/__sim/config", json={"latency_s": 0.15}) as resp:
        assert resp.status == 200
        assert (await resp.json())["latency_s"] == 0.15
    assert sim.config.latency_s == 0.15

    started = time.monotonic()
    status, _, _ = await _get(session, f"{sim.base_url}/page/1")
    assert status == 200
    assert time.monotonic() - started >= 0.15


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        '{"latency_s": -1}',
        '{"latency_s": "1"}',
        '{"latency_s": true}',
        '{"pages": 3}',
        '{"robots_status": 99}',
        '{"robots_status": "503"}',
        '{"robots_txt": 1}',
        "[]",
        "{",
    ],
)
async def test_config_post_rejects_bad_bodies(
    sim: TargetSimulator, session: aiohttp.ClientSession, body: str
) -> None:
    async with session.post(
        f"{sim.base_url}/__sim/config", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
    assert sim.config.latency_s == 0.0
    assert sim.config.robots_status == 200


@pytest.mark.asyncio
async def test_robots_txt_body_and_status_change_at_runtime(
    sim: TargetSimulator, session: aiohttp.ClientSession
) -> None:
    body = {"robots_txt": "User-agent: *\nDisallow: /\n", "robots_status": 503}
    async with session.post(f"{sim.base_url}/__sim/config", json=body) as resp:
        assert resp.status == 200
    status, text, _ = await _get(session, f"{sim.base_url}/robots.txt")
    assert (status, text) == (503, "User-agent: *\nDisallow: /\n")
    sim.set_robots(status=404)
    status, text, _ = await _get(session, f"{sim.base_url}/robots.txt")
    assert (status, text) == (404, "User-agent: *\nDisallow: /\n")


async def test_a_flagged_session_is_challenged_and_others_are_served() -> None:
    # unsafe: keep the cookies of a site addressed by IP, as the worker's jar does.
    jar = aiohttp.CookieJar(unsafe=True)
    async with TargetSimulator() as sim, aiohttp.ClientSession(cookie_jar=jar) as client:
        status, _, _ = await _get(client, f"{sim.base_url}/session/1")
        [token] = sim.sessions_issued()
        sim.challenge_session(token)
        status, body, _ = await _get(client, f"{sim.base_url}/session/2")
        assert status == 503 and 'id="challenge"' in body
        async with aiohttp.ClientSession() as fresh:  # another client, without the cookie
            status, _, _ = await _get(fresh, f"{sim.base_url}/session/3")
        assert status == 200
        assert [t for _, t in sim.sessions_presented()] == ["", token, ""]
        sim.reset()
        status, _, _ = await _get(client, f"{sim.base_url}/session/4")
        assert status == 200, "a reset forgets the flagged sessions"
