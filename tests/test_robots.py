"""Issue 9, robots.txt: fetched, cached and obeyed per target (Protego), Crawl-delay as a
rate cap, RFC 9309's 4xx and 5xx rules, and ``obey_robots = false`` only with a reason.

Real servers: a fresh nats-server, the tests' redis-server, the target simulator (which
counts every request on arrival, robots.txt included), and scheduler + ratelimit +
leaser + sink + one worker in this process. The pure rules are tested at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import DeadLetter
from jetfleet.schemas.targets import MAX_ROBOTS_CHARS, RobotsRecord
from jetfleet.services.ratelimit.target_limits import TargetLimitBook
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.errors import ConfigError
from jetfleet.settings import DEFAULT_USER_AGENT, Settings, TargetSettings, load_settings
from jetfleet.simulator import TargetSimulator
from jetfleet.simulator.pages import ROBOTS_TXT
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from jetfleet.worker.manners import names_contact, start_warnings
from jetfleet.worker.robots_fetch import within_target
from jetfleet.worker.robots_rules import (
    ROBOTS_DISALLOWED,
    RobotsRules,
    record_of_answer,
    record_of_failure,
    robots_url,
)
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, dead, submit_paths
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(90)

SITE = "site"
UA = "jetfleet-tests (+loopback only)"  # what make_settings sends
ROBOTS_PATH = "/robots.txt"


@dataclass
class Env:
    settings: Settings
    js: JetStreamContext
    sim: TargetSimulator

    def pages_asked(self) -> int:
        return int(self.sim.counts()["by_path_kind"].get("page", 0))

    def robots_asked(self) -> int:
        return int(self.sim.counts()["by_path_kind"].get("robots", 0))

    async def letters(self) -> list[DeadLetter]:
        decoder = msgspec.json.Decoder(DeadLetter)
        return [
            decoder.decode(m.data)
            async for m in read_stream(self.js, subjects.STREAM_DLQ, "jf.dlq.>")
        ]

    async def robots_record(self) -> RobotsRecord:
        kv = await self.js.key_value(subjects.BUCKET_ROBOTS)
        entry = await kv.get(SITE)
        assert entry.value is not None
        return msgspec.json.decode(entry.value, type=RobotsRecord)

    async def wait_committed(self, n: int, timeout_s: float = 30.0) -> None:
        async def done() -> bool:
            return await committed(self.js, SITE) >= n

        await wait_for(done, timeout_s, f"{n} committed jobs")


def robots_settings(
    nats_url: str, redis_url: str, sim: TargetSimulator, **fleet: object
) -> Settings:
    """One target on the simulator that obeys robots.txt, its rate far above any
    Crawl-delay (1000/s, burst 100), so only robots.txt can slow it."""
    return make_settings(nats_url, redis_url, {SITE: sim_target(sim, obey_robots=True)}, **fleet)


@pytest.fixture
async def env(
    nats_url: str, redis_url: str, simulator: TargetSimulator, request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    fleet = getattr(request, "param", {})
    settings = robots_settings(nats_url, redis_url, simulator, **fleet)
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        yield Env(settings, stack.connections[0].jetstream(), simulator)
    finally:
        await stack.stop()


async def test_a_url_robots_txt_disallows_is_dead_lettered_permanently_and_never_requested(
    env: Env,
) -> None:
    # The simulator's robots.txt: "User-agent: *", "Disallow: /private/".
    await submit_paths(env.js, env.settings, SITE, ["/page/1", "/private/1", "/page/2"], "r")

    async def ended() -> bool:
        return await committed(env.js, SITE) == 2 and await dead(env.js, SITE) == 1

    await wait_for(ended, 30, "two commits and one dead letter")
    (letter,) = await env.letters()
    assert letter.reason == ROBOTS_DISALLOWED, letter
    assert letter.order.job.url.endswith("/private/1"), letter.order.job.url
    assert [a.outcome for a in letter.history] == ["permanent"], letter.history
    assert "nothing was sent" in letter.detail, letter.detail
    asked = env.sim.requests_by_path()
    assert "/private/1" not in asked, asked
    # robots.txt once (then cached), each allowed page once; all with the fleet's agent.
    assert asked == {ROBOTS_PATH: 1, "/page/1": 1, "/page/2": 1}, asked
    assert env.sim.counts()["by_user_agent"] == {UA: 3}
    record = await env.robots_record()
    assert (record.status, record.body, record.fetched_by) == (200, ROBOTS_TXT, "w-0")


async def test_crawl_delay_2_caps_the_target_at_one_request_per_2_s(env: Env) -> None:
    env.sim.set_robots("User-agent: *\nCrawl-delay: 2\n")
    # The first job fetches robots.txt; its record reaches the ratelimit service (KV).
    await submit_paths(env.js, env.settings, SITE, ["/page/0"], "warm")
    await env.wait_committed(1)
    assert (await env.robots_record()).crawl_delay_s == 2.0
    env.sim.reset()
    started = time.monotonic()
    await submit_paths(env.js, env.settings, SITE, [f"/page/{n}" for n in range(1, 5)], "cd")
    await env.wait_committed(5, timeout_s=60)
    took = time.monotonic() - started
    assert env.sim.counts()["by_path_kind"] == {"page": 4}
    # Small tolerance for the trip from permit to target; at the configured rate (1000/s,
    # burst 100) all five would arrive within milliseconds.
    assert env.sim.max_in_any_window(1.9) <= 1, env.sim.counts()
    assert took >= 3 * 1.9, took
    print(f"4 pages under Crawl-delay 2 took {took:.1f} s (ideal 6 s after the first)")


async def test_a_robots_txt_answering_404_allows_everything(env: Env) -> None:
    env.sim.set_robots("User-agent: *\nDisallow: /\n", status=404)
    await submit_paths(env.js, env.settings, SITE, ["/page/1", "/page/2"], "nf")
    await env.wait_committed(2)
    assert await dead(env.js, SITE) == 0
    assert env.sim.requests_by_path() == {ROBOTS_PATH: 1, "/page/1": 1, "/page/2": 1}
    record = await env.robots_record()
    assert (record.status, record.body) == (404, "")  # a 4xx body is not rules


@pytest.mark.parametrize("env", [{"robots_error_hold_s": 1.0}], indirect=True)
async def test_a_robots_txt_answering_503_holds_the_target_then_jobs_run(env: Env) -> None:
    env.sim.set_robots(status=503)
    await submit_paths(env.js, env.settings, SITE, ["/page/1", "/page/2", "/page/3"], "u")

    async def robots_asked(n: int) -> bool:
        return env.robots_asked() >= n

    await wait_for(lambda: robots_asked(1), 15, "a first robots.txt fetch")
    first = time.monotonic()
    await wait_for(lambda: robots_asked(3), 15, "robots.txt tried again twice")
    # Tried again only after each hold (1 s), not by every job that came along.
    assert time.monotonic() - first >= 1.8
    assert env.pages_asked() == 0, env.sim.requests_by_path()
    assert await dead(env.js, SITE) == 0 and await committed(env.js, SITE) == 0
    env.sim.set_robots(ROBOTS_TXT, status=200)
    await env.wait_committed(3)
    assert await dead(env.js, SITE) == 0
    assert env.pages_asked() == 3


async def test_a_robots_txt_that_cannot_be_reached_holds_its_jobs(
    nats_url: str, redis_url: str
) -> None:
    # Nothing listens on port 9 of loopback: every fetch fails (status 0).
    target = TargetSettings(base_url="http://127.0.0.1:9/", rate=1000, burst=100, timeout_s=1.0)
    settings = make_settings(nats_url, redis_url, {SITE: target}, robots_error_hold_s=1.0)
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        js = stack.connections[0].jetstream()
        await submit_paths(js, settings, SITE, ["/page/1"], "down")
        worker = stack.workers[0]

        async def held_twice() -> bool:
            labels = {"worker": "w-0", "target": SITE, "reason": "robots-unavailable"}
            return worker.hand_backs.get(**labels) >= 2

        await wait_for(held_twice, 15, "the job handed back as robots-unavailable twice")
        assert await dead(js, SITE) == 0 and await committed(js, SITE) == 0
        kv = await js.key_value(subjects.BUCKET_ROBOTS)
        entry = await kv.get(SITE)
        assert entry.value is not None
        record = msgspec.json.decode(entry.value, type=RobotsRecord)
        assert record.status == 0 and "127.0.0.1:9" in record.error, record
    finally:
        await stack.stop()


async def test_jobs_judged_without_a_request_take_no_rate_permit(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    # Room for one request now and the next in 100 s (a fresh limiter state allows no
    # burst). robots.txt is in the bucket already, so fetching it takes no permit.
    site = msgspec.structs.replace(sim_target(simulator, obey_robots=True), rate=0.01, burst=1)
    settings = make_settings(nats_url, redis_url, {SITE: site})
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        js = stack.connections[0].jetstream()
        text = b"User-agent: *\nDisallow: /private/\n"
        record = record_of_answer(SITE, 200, text, UA, "w-0")
        await js.publish(f"$KV.{subjects.BUCKET_ROBOTS}.{SITE}", msgspec.json.encode(record))
        await submit_paths(js, settings, SITE, ["/page/1"], "first", handler="http.get")

        async def first_done() -> bool:
            return await committed(js, SITE) == 1

        await wait_for(first_done, 20, "the job that takes the one permit")
        # A URL robots.txt disallows and a job whose handler calls nobody end at once;
        # a job that would send a request waits its 100 s for the next permit.
        await submit_paths(js, settings, SITE, ["/private/1"], "ruled", handler="http.get")
        await submit_paths(js, settings, SITE, ["/page/2"], "quiet", handler="noop")
        await submit_paths(js, settings, SITE, ["/page/3"], "waits", handler="http.get")
        worker = stack.workers[0]

        async def settled() -> bool:
            return (
                await committed(js, SITE) == 2
                and await dead(js, SITE) == 1
                and worker.stats["refused:rate-limited"] >= 1
            )

        await wait_for(settled, 20, "the noop committed, the disallowed URL dead")
        assert int(simulator.counts()["by_path_kind"].get("page", 0)) == 1
        assert int(simulator.counts()["by_path_kind"].get("robots", 0)) == 0
    finally:
        await stack.stop()


async def test_request_rate_and_crawl_delay_cap_the_target_by_the_stricter(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = robots_settings(nats_url, redis_url, simulator)
    nc: NatsClient = await connect_nats(settings.nats, "robots-test")
    try:
        js = nc.jetstream()
        await declare(js, settings)
        text = b"User-agent: *\nCrawl-delay: 2\nRequest-rate: 1/5s\n"
        record = record_of_answer(SITE, 200, text, UA, "w-0")
        assert (record.crawl_delay_s, record.request_interval_s) == (2.0, 5.0)
        await js.publish(f"$KV.{subjects.BUCKET_ROBOTS}.{SITE}", msgspec.json.encode(record))
        book = TargetLimitBook(settings, js)
        await book.start()
        try:
            limits = book.effective(SITE)
            assert (limits.target_rate, limits.target_burst) == (0.2, 1)
        finally:
            await book.stop()
    finally:
        await nc.close()


def test_obey_robots_false_without_a_reason_is_refused_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "jetfleet.toml"
    config.write_text(
        '[targets.shop]\nbase_url = "https://shop.example/"\nobey_robots = false\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"targets\.shop\.robots_off_reason"):
        load_settings(config, env={})
    config.write_text(
        '[targets.shop]\nbase_url = "https://shop.example/"\nobey_robots = false\n'
        'robots_off_reason = "our own staging site"\n',
        encoding="utf-8",
    )
    assert not load_settings(config, env={}).targets["shop"].obey_robots


# --- the pure rules ---------------------------------------------------------------------


def test_robots_txt_is_at_the_hosts_root_whatever_the_base_urls_path() -> None:
    assert (
        robots_url("https://shop.example:8443/catalog/") == "https://shop.example:8443/robots.txt"
    )


def test_a_group_for_the_fleets_agent_replaces_the_star_group() -> None:
    text = (
        b"User-agent: *\nDisallow: /private/\nCrawl-delay: 3\n\n"
        b"User-agent: jetfleet-tests\nDisallow: /no-tests/\nCrawl-delay: 1\n"
    )
    ours = RobotsRules.of(record_of_answer(SITE, 200, text, UA, "w"))
    assert ours.record.crawl_delay_s == 1.0
    assert ours.allows("http://h/private/x", UA)
    assert not ours.allows("http://h/no-tests/x", UA)
    other = "OtherBot/2 (+https://other.example)"
    assert not ours.allows("http://h/private/x", other)
    assert record_of_answer(SITE, 200, text, other, "w").crawl_delay_s == 3.0


@pytest.mark.parametrize(
    ("status", "allowed"), [(200, False), (301, True), (401, True), (404, True), (500, False)]
)
def test_rfc9309_2xx_is_obeyed_4xx_allows_all_5xx_disallows_all(status: int, allowed: bool) -> None:
    rules = RobotsRules.of(record_of_answer(SITE, status, b"User-agent: *\nDisallow: /\n", UA, "w"))
    assert rules.allows("http://h/page/1", UA) is allowed
    assert rules.unreachable is (status >= 500)


def test_no_answer_disallows_all_and_keeps_the_error_within_the_record() -> None:
    record = record_of_failure(SITE, "x" * 5000, "w")
    assert RobotsRules.of(record).unreachable
    msgspec.json.decode(msgspec.json.encode(record), type=RobotsRecord)  # still valid


def test_a_robots_txt_over_500_kib_is_cut_there() -> None:
    rule = b"User-agent: *\nDisallow: /late/\n"
    body = b"#" * MAX_ROBOTS_CHARS + b"\n" + rule
    record = record_of_answer(SITE, 200, body, UA, "w")
    assert len(record.body) == MAX_ROBOTS_CHARS
    assert RobotsRules.of(record).allows("http://h/late/1", UA)  # the rule past the cut


def test_robots_redirects_are_followed_only_within_the_target() -> None:
    target = TargetSettings(
        base_url="https://shop.example/catalog/", redirect_hosts=("cdn.example",)
    )
    assert within_target("https://shop.example/robots-2.txt", target)
    assert within_target("https://cdn.example/shop/robots.txt", target)
    assert not within_target("http://shop.example/robots.txt", target)  # another scheme
    assert not within_target("https://elsewhere.example/robots.txt", target)


def test_a_user_agent_names_a_contact_by_url_or_e_mail() -> None:
    assert names_contact("acme-crawler/1.0 (+https://acme.example/bot)")
    assert names_contact("acme-crawler/1.0 (ops@acme.example)")
    assert not names_contact("acme-crawler/1.0")
    assert not names_contact(DEFAULT_USER_AGENT)


def test_a_worker_warns_of_robots_off_and_of_an_agent_without_contact(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    lines = start_warnings(settings, ["demo"])
    assert any("targets.demo: robots.txt is NOT obeyed" in line for line in lines), lines
    assert any("names no contact" in line and "fleet.user_agent" in line for line in lines)
    placeholder = msgspec.structs.replace(
        settings, fleet=msgspec.structs.replace(settings.fleet, user_agent=DEFAULT_USER_AGENT)
    )
    assert any("placeholder" in line for line in start_warnings(placeholder, ["demo"]))


async def test_a_worker_logs_the_reason_robots_is_off_once_at_start(
    nats_url: str, redis_url: str, simulator: TargetSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    stack = InProcessStack(settings)
    with caplog.at_level(logging.WARNING, logger="jetfleet.worker.runtime"):
        await stack.start(workers=1)
        await stack.stop()
    off = [r.getMessage() for r in caplog.records if "robots.txt is NOT obeyed" in r.getMessage()]
    assert off == [
        "worker w-0: targets.demo: robots.txt is NOT obeyed (obey_robots = false): "
        + settings.targets["demo"].robots_off_reason
    ], off


async def test_without_a_permit_robots_txt_is_not_fetched_and_the_job_waits(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = robots_settings(nats_url, redis_url, simulator)
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        assert stack.ratelimit is not None
        await stack.ratelimit.drain(5.0)  # no replica answers: no permit for anything
        js = stack.connections[0].jetstream()
        await submit_paths(js, settings, SITE, ["/page/1"], "np")
        worker = stack.workers[0]

        async def handed_back() -> bool:
            labels = {"worker": "w-0", "target": SITE, "reason": "ratelimit-unavailable"}
            return worker.hand_backs.get(**labels) >= 2

        await wait_for(handed_back, 15, "the job handed back for want of a permit")
        assert simulator.counts()["total"] == 0  # not even robots.txt
        await stack.start_ratelimit()

        async def done() -> bool:
            return await committed(js, SITE) == 1

        await wait_for(done, 30, "the job to commit once permits are back")
        assert simulator.requests_by_path() == {ROBOTS_PATH: 1, "/page/1": 1}
        assert await dead(js, SITE) == 0
    finally:
        await stack.stop()


async def test_a_target_the_leaser_refuses_gets_no_robots_txt_request_either(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    # Closed for the next 23 hours (UTC, by the server's clock): the leaser refuses
    # every grant, so the worker asks nothing of the site, robots.txt included, though
    # it has no robots.txt record yet. The window opens an hour before the server's now.
    hour = (time.gmtime().tm_hour - 1) % 24
    span = f"{hour:02d}:00-{hour:02d}:30"
    site = msgspec.structs.replace(
        sim_target(simulator, obey_robots=True), active_hours=(span,), timezone="UTC"
    )
    settings = make_settings(nats_url, redis_url, {SITE: site})
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        js = stack.connections[0].jetstream()
        await submit_paths(js, settings, SITE, ["/page/1", "/page/2"], "closed")
        worker = stack.workers[0]

        async def refused() -> bool:
            return worker.stats["refused:outside-window"] > 0

        await wait_for(refused, 20, "an outside-window refusal")
        assert simulator.counts()["total"] == 0, simulator.counts()
        assert await committed(js, SITE) == 0
    finally:
        await stack.stop()
