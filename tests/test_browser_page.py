"""Issue 12, the ``browser.page`` handler: real Chromium (/usr/bin/chromium) through
Playwright, against the target simulator's shop pages, run by the real worker runtime
over real nats-server and redis-server (scheduler, ratelimit, leaser, sink in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, DeadLetter, Job, Outcome
from jetfleet.schemas.browser import Extract, PageSpec, PageVisit
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.auth.credentials import settings_for_role
from jetfleet.client import submit_jobs
from jetfleet.errors import ConfigError
from jetfleet.outcome_events import read_outcomes
from jetfleet.results import iter_results, stored_bytes
from jetfleet.settings import BrowserSettings, Settings, WorkerSettings, load_settings
from jetfleet.simulator import TargetSimulator
from jetfleet.simulator.pages import THIRD_PARTY_PIXEL
from jetfleet.stream_reader import read_stream
from jetfleet.version_tuple import config_hash, local_tuple
from jetfleet.worker import Worker
from jetfleet.worker.browser_contexts import BrowserContexts, profile_folder
from jetfleet.worker.browser_executable import chromium_path
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

CHROMIUM = "/usr/bin/chromium"
RATE = 2.0
SHOP = "shop"
ITEM = PageSpec(
    wait_for="h1.title",
    extract={
        "title": Extract(selector="h1.title"),
        "price": Extract(selector=".price"),
        "currency": Extract(selector=".price", attr="data-currency"),
        "related": Extract(selector="ul.related a", attr="href", all=True),
        "visitor": Extract(selector="#visitor"),
    },
)


@dataclass
class Env:
    settings: Settings
    stack: InProcessStack
    js: JetStreamContext
    sim: TargetSimulator
    profiles: Path

    async def submit(self, *jobs: Job) -> None:
        results = await submit_jobs(self.js, self.settings, SHOP, list(jobs))
        assert all(r.published and r.rejection is None for r in results), results

    async def results(self) -> dict[str, CommittedResult]:
        return {r.job_id: r async for r in iter_results(self.js, SHOP)}

    async def letters(self) -> list[DeadLetter]:
        decoder = msgspec.json.Decoder(DeadLetter)
        return [
            decoder.decode(m.data)
            async for m in read_stream(self.js, subjects.STREAM_DLQ, "jf.dlq.>")
        ]

    async def outcomes(self) -> list[Outcome]:
        events = []
        async for m in read_stream(self.js, subjects.STREAM_OUTCOMES, "jf.outcome.>"):
            for event in read_outcomes(m.subject, m.data, m.headers):
                assert not isinstance(event, str), event
                events.append(event)
        return events

    async def committed(self, *job_ids: str, timeout_s: float = 60.0) -> dict[str, PageVisit]:
        async def done() -> bool:
            return set(job_ids) <= set(await self.results())

        await wait_for(done, timeout_s, f"commits of {job_ids}")
        found = await self.results()
        visits = {}
        for job_id in job_ids:
            output = found[job_id].output
            assert isinstance(output, PageVisit), output
            visits[job_id] = output
        return visits

    async def dead_letter(self, job_id: str, timeout_s: float = 60.0) -> DeadLetter:
        """The dead letter of ``job_id``, once there is one."""

        async def lettered() -> bool:
            return any(d.order.job.id == job_id for d in await self.letters())

        await wait_for(lettered, timeout_s, f"the dead letter of {job_id}")
        return next(d for d in await self.letters() if d.order.job.id == job_id)

    def asked(self, kind: str) -> int:
        return int(self.sim.counts()["by_path_kind"].get(kind, 0))


def browser_settings(base: Settings, profiles: Path, obey_robots: bool = False) -> Settings:
    target = msgspec.structs.replace(
        base.targets["demo"],
        timeout_s=15.0,
        obey_robots=obey_robots,
        robots_off_reason="" if obey_robots else base.targets["demo"].robots_off_reason,
    )
    return msgspec.structs.replace(
        base,
        targets={SHOP: target},
        worker=WorkerSettings(
            concurrency=4,
            browser=BrowserSettings(
                enabled=True, executable=CHROMIUM, profiles_dir=str(profiles), wait_timeout_s=2.0
            ),
        ),
    )


@contextlib.asynccontextmanager
async def shop_env(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path, **target: object
) -> AsyncIterator[Env]:
    """An in-process stack (no worker yet) whose shop target has ``target``'s changes."""
    base = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    settings = browser_settings(base, tmp_path / "profiles")
    shop = msgspec.structs.replace(settings.targets[SHOP], **target)
    settings = msgspec.structs.replace(settings, targets={SHOP: shop})
    stack = InProcessStack(settings)
    await stack.start(workers=0)
    try:
        yield Env(settings, stack, stack.connections[0].jetstream(), simulator, tmp_path)
    finally:
        await stack.stop()


async def _env(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path, robots: bool
) -> AsyncIterator[Env]:
    base = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    profiles = tmp_path / "profiles"
    settings = browser_settings(base, profiles, obey_robots=robots)
    stack = InProcessStack(settings)
    await stack.start(workers=0)
    try:
        yield Env(settings, stack, stack.connections[0].jetstream(), simulator, profiles)
        # Whatever the test did, no page's sub-resource ever reached the target.
        assert simulator.counts()["by_path_kind"].get("shop-img", 0) == 0
    finally:
        await stack.stop()


@pytest.fixture
async def env(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> AsyncIterator[Env]:
    async for made in _env(nats_url, redis_url, simulator, tmp_path, robots=False):
        yield made


@pytest.fixture
async def robots_env(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> AsyncIterator[Env]:
    async for made in _env(nats_url, redis_url, simulator, tmp_path, robots=True):
        yield made


def page_job(job_id: str, path: str, spec: PageSpec = ITEM, **kw: object) -> Job:
    return Job(id=job_id, url=path, handler="browser.page", page=spec, **kw)  # type: ignore[arg-type]


async def test_a_browser_job_commits_the_text_and_attributes_it_extracted(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("item-3", "/shop/item/3"))
    visit = (await env.committed("item-3"))["item-3"]

    assert visit.status == 200
    assert visit.final_url == env.sim.base_url + "/shop/item/3"
    assert visit.title.startswith("Item 3: ")
    assert visit.values["title"] == visit.title
    price = visit.values["price"]
    assert isinstance(price, str) and price.replace(".", "").isdigit()
    assert visit.values["currency"] == "EUR"
    related = visit.values["related"]
    assert isinstance(related, list) and related
    assert all(href.startswith("/shop/item/") for href in related)
    # The page asked for its image and a third-party pixel: neither was sent.
    assert visit.blocked_requests >= 2
    assert env.asked("shop-img") == 0
    assert env.asked("shop-item") == 1
    # The identifying User-Agent, never the browser's own.
    assert set(env.sim.counts()["by_user_agent"]) == {env.settings.fleet.user_agent}
    assert THIRD_PARTY_PIXEL.startswith("http://tracker.example.invalid/")


async def test_I4_browser_jobs_hold_the_targets_cap_at_the_target_redirect_hops_included(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    base = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    settings = browser_settings(base, tmp_path / "profiles")
    # One attempt each: a permit that says wait once the page is open (the handler's
    # ready) must end the attempt unrun and refunded, or the job would end dead.
    slow = msgspec.structs.replace(settings.targets[SHOP], rate=RATE, burst=1, max_attempts=1)
    settings = msgspec.structs.replace(settings, targets={SHOP: slow})
    stack = InProcessStack(settings)
    await stack.start(workers=0)
    try:
        env = Env(settings, stack, stack.connections[0].jetstream(), simulator, tmp_path)
        await stack.add_worker("w-a", identity="alice")
        await stack.add_worker("w-b", identity="bob")
        # Six pages (each asking for two sub-resources) and two that redirect once.
        jobs = [page_job(f"cap-{n}", f"/shop/item/{n}") for n in range(6)]
        jobs += [page_job(f"hop-{n}", f"/redirect/{n}?to=/shop/item/{n}") for n in (6, 7)]
        await env.submit(*jobs)
        await env.committed(*(j.id for j in jobs), timeout_s=90)
        counts = simulator.counts()
        notes = [(o.job_id, o.kind, o.reason, o.detail) for o in await env.outcomes()]
        assert counts["by_path_kind"] == {"shop-item": 8, "redirect": 2}, (counts, notes)
        # 10 requests at 2/s (burst 1): any 1 s window holds at most 3.
        assert simulator.max_in_any_window(1.0) <= RATE + 1, counts["windows"]
        assert simulator.max_in_any_window(3.0) <= 3 * RATE + 1
        assert "shop-img" not in counts["by_path_kind"]
        waits = sum(w.stats["refused:rate-limited"] for w in stack.workers)
        assert waits >= 1, "no permit said wait with a page open: the refund went untested"
    finally:
        await stack.stop()


async def test_a_screenshot_is_kept_as_a_result_attachment_and_reads_back(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    spec = PageSpec(wait_for=".price", screenshot=True)
    await env.submit(page_job("shot-1", "/shop/item/1", spec))
    visit = (await env.committed("shot-1"))["shot-1"]

    assert visit.screenshot is not None
    assert visit.screenshot.bucket == subjects.OBJECTS_RESULTS
    data = await stored_bytes(env.js, visit.screenshot)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) == visit.screenshot.size <= env.settings.worker.browser.max_screenshot_bytes


async def test_a_removed_selector_dead_letters_with_reason_selector_removed(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    spec = PageSpec(wait_for=".price", wait_timeout_s=1.0)
    await env.submit(page_job("gone-1", "/shop/item/4?removed=1", spec))

    async def lettered() -> bool:
        return any(d.order.job.id == "gone-1" for d in await env.letters())

    await wait_for(lettered, 60, "the dead letter of gone-1")
    letter = next(d for d in await env.letters() if d.order.job.id == "gone-1")
    assert letter.reason == "selector-removed"
    assert "gone-1" not in await env.results()
    # Permanent: one visit, no retry.
    assert env.asked("shop-item") == 1


async def test_a_challenge_page_is_a_block_signal_never_solved_nor_committed(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    # Challenged twice, then the page: the job comes back after backing off, and commits.
    await env.submit(page_job("ch-1", "/challenge/2?times=2", PageSpec(wait_for="h1")))

    async def blocked_twice() -> bool:
        kinds = [o for o in await env.outcomes() if o.job_id == "ch-1" and o.kind == "blocked"]
        return len(kinds) >= 2

    await wait_for(blocked_twice, 60, "two blocked outcomes of ch-1")
    blocked = [o for o in await env.outcomes() if o.job_id == "ch-1" and o.kind == "blocked"]
    assert {o.reason for o in blocked} == {"challenged"}
    assert all(o.called for o in blocked)
    # Nothing of the challenge was committed; the page after it was.
    visit = (await env.committed("ch-1"))["ch-1"]
    assert visit.status == 200 and visit.title.startswith("Page 2")
    assert env.stack.workers[0].stats["blocked:challenged"] == 2
    # Each challenge page was met once and left: no request beyond the document.
    assert env.asked("challenge") == 3


async def test_a_429_with_retry_after_is_a_block_and_the_page_is_asked_again_only_after_it(
    env: Env,
) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("rl-1", "/ratelimited/3?retry_after=2&times=1", PageSpec()))
    visit = (await env.committed("rl-1"))["rl-1"]
    assert visit.status == 200
    blocked = [o for o in await env.outcomes() if o.job_id == "rl-1" and o.kind == "blocked"]
    assert [o.reason for o in blocked] == ["rate-limited"]
    assert env.asked("ratelimited") == 2
    # The second request came no sooner than the target asked (2 s).
    assert env.sim.max_in_any_window(1.7) <= 1, env.sim.counts()


async def test_a_challenge_kills_the_identitys_browser_session_never_the_job(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("s-1", "/session/1", PageSpec(wait_for="h1")))
    await env.committed("s-1")
    (token,) = env.sim.sessions_issued()
    env.sim.challenge_session(token)  # the site flags the session

    await env.submit(page_job("s-2", "/session/2", PageSpec(wait_for="h1")))
    await env.committed("s-2")
    presented = [sent for path, sent in env.sim.sessions_presented() if path == "/session/2"]
    # Challenged with the old session, then back with none: a new one, never the old.
    assert presented == [token, ""]
    assert len(env.sim.sessions_issued()) == 2


async def test_redirects_are_followed_hop_by_hop_on_the_target_only(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(
        page_job("r-1", "/redirect/1?to=/shop/item/5"),
        page_job("r-off", "/redirect/2?to=http://elsewhere.example.invalid/x"),
    )
    visit = (await env.committed("r-1"))["r-1"]
    assert visit.final_url == env.sim.base_url + "/shop/item/5"
    assert visit.title.startswith("Item 5: ")

    async def lettered() -> bool:
        return any(d.order.job.id == "r-off" for d in await env.letters())

    await wait_for(lettered, 60, "the dead letter of r-off")
    letter = next(d for d in await env.letters() if d.order.job.id == "r-off")
    assert letter.reason == "redirect-off-target"
    assert env.asked("redirect") == 2 and env.asked("shop-item") == 1


async def test_a_page_slower_than_the_budget_is_retried_then_dead_lettered(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(
        page_job("slow-1", "/shop/item/6?delay=5", timeout_s=1.0, max_attempts=2),
        page_job("slow-ok", "/shop/item/7?delay=0.3", timeout_s=4.0),
    )
    assert (await env.committed("slow-ok"))["slow-ok"].status == 200

    async def lettered() -> bool:
        return any(d.order.job.id == "slow-1" for d in await env.letters())

    await wait_for(lettered, 60, "the dead letter of slow-1")
    letter = next(d for d in await env.letters() if d.order.job.id == "slow-1")
    assert letter.reason == "attempts-exhausted"
    assert len(letter.history) == 2
    assert all("timeout" in a.reason or "deadline" in a.reason for a in letter.history), [
        a.reason for a in letter.history
    ]


async def test_a_worker_without_a_browser_hands_browser_jobs_back_unsent(env: Env) -> None:
    plain_settings = msgspec.structs.replace(
        env.settings, worker=msgspec.structs.replace(env.settings.worker, browser=BrowserSettings())
    )
    nc = await env.stack._connect("w-plain", "worker")
    plain = Worker(settings_for_role(plain_settings, "worker"), nc, "w-plain")
    await plain.start()
    env.stack.workers.append(plain)
    await env.submit(page_job("nb-1", "/shop/item/8"))

    async def handed_back() -> bool:
        return plain.hand_backs.get(worker="w-plain", target=SHOP, reason="no-browser") >= 1

    await wait_for(handed_back, 30, "a no-browser hand-back")
    assert env.asked("shop-item") == 0
    assert plain.version_tuple.browser == ""
    await env.stack.add_worker("w-a", identity="alice")
    assert (await env.committed("nb-1"))["nb-1"].status == 200
    assert env.asked("shop-item") == 1


async def test_a_browser_that_died_is_opened_again_for_the_next_job(env: Env) -> None:
    worker = await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("d-1", "/shop/item/1"))
    await env.committed("d-1")
    assert worker.browser is not None and worker.browser.open_identities() == ("alice",)
    folder = worker.browser.folder("alice")
    main = _browser_pids(folder)
    assert main, "no Chromium runs on alice's profile"
    for pid in main:
        os.kill(pid, signal.SIGKILL)  # the browser this test's worker started crashes

    async def forgotten() -> bool:
        return worker.browser is not None and worker.browser.open_identities() == ()

    await wait_for(forgotten, 30, "the dead context to be forgotten")
    await env.submit(page_job("d-2", "/shop/item/2"))
    assert (await env.committed("d-2"))["d-2"].status == 200
    assert _browser_pids(folder) and not set(_browser_pids(folder)) & set(main)


def _browser_pids(folder: Path) -> list[int]:
    """The Chromium browser processes (not renderers) running on profile ``folder``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"--user-data-dir={folder}".encode() in args and not any(
            a.startswith(b"--type=") for a in args
        ):
            pids.append(int(entry.name))
    return pids


async def test_robots_disallow_refuses_a_browser_job_without_navigating(robots_env: Env) -> None:
    env = robots_env
    env.sim.set_robots(text="User-agent: *\nDisallow: /shop/\n")
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("robots-1", "/shop/item/2"))

    async def lettered() -> bool:
        return any(d.order.job.id == "robots-1" for d in await env.letters())

    await wait_for(lettered, 60, "the dead letter of robots-1")
    letter = next(d for d in await env.letters() if d.order.job.id == "robots-1")
    assert letter.reason == "robots-disallowed"
    assert env.asked("robots") == 1
    assert env.asked("shop-item") == 0


async def test_two_identities_never_share_a_profile_folder_nor_its_state(env: Env) -> None:
    alice = await env.stack.add_worker("w-a", identity="alice", targets=(SHOP,))
    await env.submit(
        page_job("a-1", "/shop/item/1?visitor=alice", pin_identity="alice"),
    )
    first = await env.committed("a-1")
    assert first["a-1"].values["visitor"] == "new new"

    bob = await env.stack.add_worker("w-b", identity="bob", targets=(SHOP,))
    await env.submit(
        page_job("b-1", "/shop/item/2?visitor=bob", pin_identity="bob"),
        page_job("a-2", "/shop/item/3", pin_identity="alice"),
    )
    seen = await env.committed("b-1", "a-2")
    # Bob's browser holds nothing of alice's visit; alice's still holds it.
    assert seen["b-1"].values["visitor"] == "new new"
    assert seen["a-2"].values["visitor"] == "alice alice"

    assert alice.browser is not None and bob.browser is not None
    folder_a, folder_b = alice.browser.folder("alice"), bob.browser.folder("bob")
    assert folder_a != folder_b
    assert not folder_a.is_relative_to(folder_b) and not folder_b.is_relative_to(folder_a)
    assert folder_a.is_relative_to(env.profiles) and folder_b.is_relative_to(env.profiles)
    assert "w-a" in folder_a.parent.name and "w-b" in folder_b.parent.name
    assert folder_a.is_dir() and folder_b.is_dir()
    assert os.stat(folder_a).st_mode & 0o077 == 0
    await asyncio.gather(alice.drain(5.0), bob.drain(5.0))  # closed: profiles written out
    assert alice.browser.open_identities() == () == bob.browser.open_identities()
    # Each profile's stored state names its own visitor only.
    assert _profile_mentions(folder_a, b"alice") and not _profile_mentions(folder_a, b"bob")
    assert _profile_mentions(folder_b, b"bob") and not _profile_mentions(folder_b, b"alice")


def _profile_mentions(folder: Path, needle: bytes) -> bool:
    """Whether any file of the profile's cookie or storage databases holds ``needle``."""
    for path in folder.rglob("*"):
        stored = "Local Storage" in str(path) or path.name.startswith("Cookies")
        if stored and path.is_file() and needle in path.read_bytes():
            return True
    return False


async def test_contexts_are_reused_per_identity_and_capped_least_recently_used_first(
    simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = BrowserSettings(
        enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path), max_contexts=2
    )
    contexts = BrowserContexts(settings, CHROMIUM, "w-1", "jetfleet-tests (+loopback only)")
    try:
        first = await contexts.acquire("a")
        contexts.release("a")
        assert await contexts.acquire("a") is first  # reused, not opened again
        contexts.release("a")
        await contexts.acquire("b")
        contexts.release("b")
        await contexts.acquire("a")  # a is now the most recently used
        contexts.release("a")
        await contexts.acquire("c")  # over the cap: b, the least recently used, closes
        contexts.release("c")
        assert contexts.open_identities() == ("a", "c")
        assert contexts.version.split(".")[0].isdigit()
    finally:
        await contexts.close()
    assert contexts.open_identities() == ()


def test_profile_folders_differ_by_worker_and_by_identity_even_when_names_look_alike() -> None:
    folders = {
        profile_folder("/p", worker, identity)
        for worker in ("w-1", "w/1", "w_1")
        for identity in ("a/b", "a_b", "a b", "")
    }
    assert len(folders) == 12
    assert all(f.parent.parent == Path("/p") for f in folders)


def test_a_browser_worker_without_chromium_is_refused_at_start_naming_the_key(
    tmp_path: Path,
) -> None:
    missing = BrowserSettings(enabled=True, executable=str(tmp_path / "no-chromium"))
    with pytest.raises(ConfigError, match=r"worker\.browser\.executable"):
        chromium_path(missing)
    settings = Settings(worker=WorkerSettings(browser=missing))
    with pytest.raises(ConfigError, match=r"worker\.browser\.executable"):
        local_tuple(settings)


def test_the_version_tuple_carries_the_chromium_version_only_with_the_browser_enabled() -> None:
    on = Settings(worker=WorkerSettings(browser=BrowserSettings(enabled=True, executable=CHROMIUM)))
    off = Settings()
    assert local_tuple(off).browser == ""
    version = local_tuple(on).browser
    assert version.count(".") == 3 and version.split(".")[0].isdigit()


async def test_chromium_version_matches_what_the_running_browser_reports(tmp_path: Path) -> None:
    settings = BrowserSettings(enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path))
    contexts = BrowserContexts(settings, CHROMIUM, "w-1", "ua")
    try:
        await contexts.acquire("a")
    finally:
        await contexts.close()
    on = Settings(worker=WorkerSettings(browser=settings))
    assert local_tuple(on).browser == contexts.version


def test_browser_settings_come_from_the_environment_and_bad_ones_name_the_key() -> None:
    env = {
        "JETFLEET_WORKER__BROWSER__ENABLED": "true",
        "JETFLEET_WORKER__BROWSER__MAX_CONTEXTS": "3",
    }
    browser = load_settings(None, env=env).worker.browser
    assert browser.enabled and browser.max_contexts == 3
    with pytest.raises(ConfigError, match=r"worker\.browser\.max_contexts"):
        load_settings(None, env={"JETFLEET_WORKER__BROWSER__MAX_CONTEXTS": "0"})
    with pytest.raises(ConfigError, match=r"unknown key 'worker\.browser\.nope'"):
        load_settings(None, env={"JETFLEET_WORKER__BROWSER__NOPE": "1"})


def test_where_this_host_keeps_chromium_and_profiles_does_not_change_the_config_hash() -> None:
    one = Settings(
        worker=WorkerSettings(browser=BrowserSettings(executable="/a", profiles_dir="/p"))
    )
    two = Settings(
        worker=WorkerSettings(browser=BrowserSettings(executable="/b", profiles_dir="/q"))
    )
    other = Settings(worker=WorkerSettings(browser=BrowserSettings(max_contexts=5)))
    assert config_hash(one) == config_hash(two) != config_hash(other)


def test_submit_page_refuses_an_invalid_page_spec_before_sending(tmp_path: Path) -> None:
    config = tmp_path / "jetfleet.toml"
    config.write_text('[targets.a]\nbase_url = "http://127.0.0.1:9/"\n')
    command = [sys.executable, "-m", "jetfleet", "--config", str(config), "submit", "a", "/x"]
    done = subprocess.run(
        [*command, "--handler", "browser.page", "--page", '{"wait_for": 3}'],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NATS_URL": "nats://127.0.0.1:1"},
    )
    assert done.returncode == 2
    assert "--page is not a valid page spec" in done.stderr and "wait_for" in done.stderr
