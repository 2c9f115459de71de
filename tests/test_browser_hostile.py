"""Review of issue 12's ``browser.page``: hostile pages, a visit cut short, a browser
that dies mid-visit. Real Chromium (/usr/bin/chromium) against the target simulator;
the end-to-end ones run through the real worker runtime over real nats-server and
redis-server (tests/test_browser_page.py's stack)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest
from jetfleet.schemas import Job, Rejection, WorkOrder
from jetfleet.schemas.browser import Extract, PageSpec, PageVisit
from playwright.async_api import Error as PlaywrightError

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.errors import PermanentFailure, RetryLater
from jetfleet.results import iter_results
from jetfleet.settings import BrowserSettings, Settings, TargetSettings
from jetfleet.simulator import TargetSimulator
from jetfleet.worker.browser_contexts import BrowserContexts, profile_folder
from jetfleet.worker.browser_page import browser_page
from jetfleet.worker.handlers import HandlerContext
from tests.conftest import sim_target, wait_for
from tests.test_browser_page import (
    CHROMIUM,
    SHOP,
    Env,
    _browser_pids,
    env,
    page_job,
    shop_env,
)

pytestmark = pytest.mark.timeout(120)
__all__ = ["env"]  # the fixture, imported for these tests

TITLE = PageSpec(wait_for="h1.title", extract={"title": Extract(selector="h1.title")})


async def test_a_page_that_navigates_away_is_read_as_served_and_nothing_leaves(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("nav-1", "/shop/trap/navigates/3", TITLE))
    visit = (await env.committed("nav-1"))["nav-1"]
    # The page's own content, never Chromium's error page for a navigation it aborted.
    assert visit.title == "Leaving" and visit.values["title"] == "Leaving", visit
    assert visit.final_url == env.sim.base_url + "/shop/trap/navigates/3"
    assert visit.blocked_requests >= 1
    # A later visit on the same browser is a barrier: whatever the trap set off is over.
    await env.submit(page_job("nav-2", "/shop/item/1", TITLE))
    await env.committed("nav-2")
    assert env.sim.counts()["by_path_kind"] == {"shop-trap": 1, "shop-item": 1}, env.sim.counts()
    assert env.sim.requests_by_path().get("/shop/item/3", 0) == 0


async def test_a_challenge_served_as_200_with_the_awaited_selector_is_a_block(env: Env) -> None:
    worker = await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("ch200", "/shop/trap/challenge/1", TITLE))

    async def blocked() -> bool:
        return any(
            o.job_id == "ch200" and o.kind == "blocked" and o.reason == "challenged"
            for o in await env.outcomes()
        )

    await wait_for(blocked, 60, "a challenged outcome of ch200")
    assert worker.stats["blocked:challenged"] >= 1
    assert "ch200" not in await env.results()


async def test_lone_surrogates_on_a_page_are_committed_replaced_not_a_crash(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    await env.submit(page_job("sur-1", "/shop/trap/surrogates/1", TITLE))
    visit = (await env.committed("sur-1", timeout_s=30))["sur-1"]
    assert visit.title == "lone \ufffd high"
    assert visit.values["title"] == "lone \ufffd low"


async def test_huge_extracted_text_is_refused_naming_the_field(env: Env) -> None:
    await env.stack.add_worker("w-a", identity="alice")
    spec = PageSpec(wait_for="h1.title", extract={"paras": Extract(selector="p.huge", all=True)})
    await env.submit(page_job("huge-1", "/shop/trap/huge/30", spec))

    letter = await env.dead_letter("huge-1")
    assert letter.reason == "result-too-large"
    assert "paras" in letter.detail, letter.detail
    assert env.asked("shop-trap") == 1


async def test_a_wait_starved_by_a_busy_page_is_not_judged_a_removed_selector(env: Env) -> None:
    # The page holds its main thread in 2 s spells, so a 0.5 s wait for its title times
    # out though the title is in the served document: a starved wait (a script-heavy
    # page, a loaded machine), not a site that removed what the job reads.
    await env.stack.add_worker("w-a", identity="alice")
    spec = msgspec.structs.replace(TITLE, wait_timeout_s=0.5)
    await env.submit(page_job("busy-1", "/shop/trap/busy/20", spec))

    async def ended() -> bool:
        letters = [d for d in await env.letters() if d.order.job.id == "busy-1"]
        assert not letters, f"dead-lettered: {letters[0].reason} {letters[0].detail}"
        return "busy-1" in await env.results()

    await wait_for(ended, 60, "the commit of busy-1")
    visit = (await env.committed("busy-1"))["busy-1"]
    assert visit.values["title"] == "Busy"
    assert env.asked("shop-trap") == 1


async def test_a_page_too_busy_to_answer_is_tried_again_not_judged_a_removed_selector(
    env: Env,
) -> None:
    # The same busy page, waited on for what it lacks: a page that took over 0.5 s to
    # answer once the wait ran out (browser_page.STARVED_S) had no turn for its scripts,
    # so its lack proves nothing. Each attempt loads it busy again: attempts run out, on timeouts.
    await env.stack.add_worker("w-a", identity="alice")
    spec = PageSpec(wait_for=".price", wait_timeout_s=0.5)
    await env.submit(page_job("busy-2", "/shop/trap/busy/20", spec, max_attempts=2))

    letter = await env.dead_letter("busy-2")
    assert letter.reason == "attempts-exhausted", (letter.reason, letter.detail)
    assert [a.reason for a in letter.history] == ["page-busy", "page-busy"], letter.history
    assert "too busy to judge" in letter.detail, letter.detail
    assert env.asked("shop-trap") == 2


# Handler-level: a visit cut short the way the worker cuts one (its task cancelled: a
# lost lease, a drain) and a browser killed under a visit.


@pytest.fixture
async def contexts(tmp_path: Path) -> AsyncIterator[BrowserContexts]:
    settings = BrowserSettings(
        enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path), wait_timeout_s=30.0
    )
    made = BrowserContexts(settings, CHROMIUM, "w-1", "jetfleet-tests (+loopback only)")
    try:
        yield made
    finally:
        await made.close()


def _context(
    sim: TargetSimulator,
    contexts: BrowserContexts,
    session: aiohttp.ClientSession,
    path: str,
    spec: PageSpec,
    hops: list[str],
) -> HandlerContext:
    async def another_request(url: str) -> None:
        hops.append(url)  # what the worker's robots check and permit would be asked

    target = msgspec.structs.replace(sim_target(sim), timeout_s=60.0)
    job = Job(id="j", url=sim.base_url + path, handler="browser.page", page=spec)
    order = WorkOrder(job=job, target="shop", key="k", max_attempts=3, timeout_s=60.0)
    return HandlerContext(
        order=order,
        target=target,
        attempt=1,
        worker_id="w-1",
        identity="alice",
        user_agent="jetfleet-tests (+loopback only)",
        session=session,
        another_request=another_request,
        browser=contexts,
    )


async def test_a_visit_cancelled_mid_document_sends_no_further_hop(
    simulator: TargetSimulator, contexts: BrowserContexts
) -> None:
    simulator.set_latency(1.0)
    hops: list[str] = []
    async with aiohttp.ClientSession() as session:
        ctx = _context(
            simulator, contexts, session, "/redirect/1?to=/shop/item/2", PageSpec(), hops
        )
        visit: asyncio.Future[object] = asyncio.ensure_future(browser_page(ctx))

        async def asked() -> bool:
            return simulator.in_flight("redirect") == 1

        await wait_for(asked, 30, "the document request at the target")
        visit.cancel()  # as the worker cancels a handler whose lease was lost
        with pytest.raises(asyncio.CancelledError):
            await visit

        async def answered() -> bool:
            return simulator.in_flight() == 0

        await wait_for(answered, 30, "the redirect's answer")
        # A later visit on the same browser is a barrier for what the first set off.
        simulator.set_latency(0.0)
        later = _context(simulator, contexts, session, "/page/1", PageSpec(), [])
        assert isinstance(await browser_page(later), PageVisit)
    assert hops == [], "a hop of a cancelled visit asked for a permit"
    assert simulator.counts()["by_path_kind"] == {"redirect": 1, "page": 1}


async def test_a_browser_killed_mid_wait_is_retried_never_dead_lettered_bad_selector(
    simulator: TargetSimulator, contexts: BrowserContexts
) -> None:
    spec = PageSpec(wait_for="#never-there", wait_timeout_s=30.0)
    async with aiohttp.ClientSession() as session:
        ctx = _context(simulator, contexts, session, "/shop/item/1", spec, [])
        visit: asyncio.Future[object] = asyncio.ensure_future(browser_page(ctx))

        context = await contexts.acquire("alice")  # the visit's own, already open
        contexts.release("alice")

        async def loaded() -> bool:
            # Loaded: the handler is waiting for the selector now (it never comes).
            for page in context.pages:
                if page.url.endswith("/shop/item/1"):
                    with contextlib.suppress(PlaywrightError):
                        return bool(await page.evaluate("document.readyState") == "complete")
            return False

        await wait_for(loaded, 30, "the page loaded in the browser")
        pids = _browser_pids(contexts.folder("alice"))
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RetryLater) as raised:
            await visit
    assert raised.value.reason == "browser-unavailable", raised.value
    assert not isinstance(raised.value, PermanentFailure)


_HOLD_A_BROWSER = """
import asyncio, sys
from jetfleet.results import iter_results
from jetfleet.settings import BrowserSettings, Settings, TargetSettings
from jetfleet.worker.browser_contexts import BrowserContexts, profile_folder

async def main() -> None:
    settings = BrowserSettings(enabled=True, executable=sys.argv[1], profiles_dir=sys.argv[2])
    contexts = BrowserContexts(settings, sys.argv[1], "w-killed", "ua")
    await contexts.acquire("alice")
    print("open", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_a_worker_process_killed_leaves_no_chromium_and_its_profile_reopens(
    tmp_path: Path, sig: signal.Signals
) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD_A_BROWSER, CHROMIUM, str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None
    assert await asyncio.wait_for(holder.stdout.readline(), 60) == b"open\n"
    folder = profile_folder(str(tmp_path), "w-killed", "alice")

    def on_profile() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if f"--user-data-dir={folder}" in (proc.info["cmdline"] or []):
                found.append(proc)
        return found

    assert on_profile(), "no Chromium on the profile"
    holder.send_signal(sig)  # no drain: the process just dies
    await holder.wait()

    def alive(proc: psutil.Process) -> bool:
        try:
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:  # ended between the listing and the look
            return False

    async def none_left() -> bool:
        return not [p for p in on_profile() if alive(p)]

    await wait_for(none_left, 30, "every Chromium of the killed process to end")
    settings = BrowserSettings(enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path))
    again = BrowserContexts(settings, CHROMIUM, "w-killed", "ua")
    try:
        await again.acquire("alice")  # the dead process's profile lock is taken over
    finally:
        await again.close()
    assert not on_profile()


async def test_a_worker_drained_mid_visit_gives_the_job_back_and_leaves_no_chromium(
    env: Env,
) -> None:
    first = await env.stack.add_worker("w-a", identity="alice")
    assert first.browser is not None
    folder = first.browser.folder("alice")
    await env.submit(page_job("dr-1", "/shop/item/1?delay=3", TITLE))

    async def visiting() -> bool:
        return env.sim.in_flight("shop-item") == 1

    await wait_for(visiting, 30, "the visit at the target")
    assert _browser_pids(folder)
    await first.drain(0.2)  # shorter than the page: the visit is cut
    env.stack.workers.remove(first)
    assert first.browser.open_identities() == ()
    assert _browser_pids(folder) == []
    assert "dr-1" not in await env.results()

    await env.stack.add_worker("w-b", identity="bob")
    visit = (await env.committed("dr-1"))["dr-1"]
    assert visit.values["title"] and visit.status == 200
    assert [r.job_id async for r in iter_results(env.js, SHOP)] == ["dr-1"]  # once
    assert env.asked("shop-item") == 2


def test_admission_refuses_a_page_spec_that_cannot_work_as_asked() -> None:
    target = TargetSettings(base_url="http://127.0.0.1:9/", timeout_s=15.0)
    settings = Settings(targets={SHOP: target})

    def admitted(job: Job) -> WorkOrder | Rejection:
        return admit(subjects.submit(SHOP), msgspec.json.encode(job), settings)

    spec = PageSpec(wait_for="h1", wait_timeout_s=30.0)
    too_long = admitted(page_job("p-1", "/x", spec))
    assert isinstance(too_long, Rejection) and too_long.reason == "invalid-job"
    assert "wait_timeout_s 30 s" in too_long.message and "budget (15 s" in too_long.message
    raised = admitted(page_job("p-2", "/x", spec, timeout_s=60.0))
    assert isinstance(raised, WorkOrder) and raised.timeout_s == 60.0
    ignored = admitted(Job(id="p-3", url="/x", handler="http.get", page=PageSpec(wait_for="h1")))
    assert isinstance(ignored, Rejection) and "handler 'http.get' ignores it" in ignored.message
    assert isinstance(admitted(page_job("p-4", "/x", PageSpec())), WorkOrder)


async def test_the_target_sees_only_its_identifying_user_agent_on_every_hop(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    agent = "jetfleet-shop-review (+mailto:ops@example.invalid)"
    async with shop_env(nats_url, redis_url, simulator, tmp_path, user_agent=agent) as env:
        await env.stack.add_worker("w-a", identity="alice")
        await env.submit(page_job("ua-1", "/redirect/1?to=/redirect/2%3Fto%3D/shop/item/5"))
        visit = (await env.committed("ua-1"))["ua-1"]
        assert visit.final_url == simulator.base_url + "/shop/item/5"
        counts = simulator.counts()
        assert counts["by_path_kind"] == {"redirect": 2, "shop-item": 1}, counts
        assert counts["by_user_agent"] == {agent: 3}


async def test_chromium_itself_opens_no_connection_a_preconnect_hint_asks_for(
    simulator: TargetSimulator, contexts: BrowserContexts
) -> None:
    accepted: list[int] = []

    async def third_party(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(third_party, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            path = f"/shop/trap/preconnect/1?to=http://127.0.0.1:{port}"
            ctx = _context(simulator, contexts, session, path, TITLE, [])
            visit = await browser_page(ctx)
            assert isinstance(visit, PageVisit) and visit.values["title"] == "Hints"
            # A later visit is a barrier for the hints the first left behind.
            later = _context(simulator, contexts, session, "/page/1", PageSpec(), [])
            assert isinstance(await browser_page(later), PageVisit)
    finally:
        server.close()
        await server.wait_closed()
    assert accepted == [], "Chromium connected to a third party on a hint"
    assert simulator.counts()["by_path_kind"] == {"shop-trap": 1, "page": 1}


async def test_a_job_on_a_browser_that_died_never_frees_its_successor_in_use(
    tmp_path: Path,
) -> None:
    settings = BrowserSettings(
        enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path), max_contexts=1
    )
    contexts = BrowserContexts(settings, CHROMIUM, "w-1", "ua")
    try:
        dead = await contexts.acquire("a")  # a job's, when its browser is killed
        for pid in _browser_pids(contexts.folder("a")):
            os.kill(pid, signal.SIGKILL)

        async def forgotten() -> bool:
            return contexts.open_identities() == ()

        await wait_for(forgotten, 30, "the dead context to be forgotten")
        await contexts.acquire("a")  # the next job of a, in a new browser, running
        contexts.release("a", dead)  # the first job ends
        await contexts.acquire("b")  # the cap is full, and a's context is in use
        assert contexts.open_identities() == ("a", "b")
    finally:
        await contexts.close()


@pytest.mark.parametrize(
    ("spec", "reason", "says"),
    [
        (PageSpec(wait_for="[[["), "bad-selector", "[[["),
        (PageSpec(extract={"a": Extract(selector="::nope(")}), "bad-selector", "::nope("),
        (PageSpec(screenshot=True), "result-too-large", "max_screenshot_bytes (1024)"),
    ],
)
async def test_bad_selectors_and_an_oversized_screenshot_fail_permanently_saying_why(
    simulator: TargetSimulator, tmp_path: Path, spec: PageSpec, reason: str, says: str
) -> None:
    settings = BrowserSettings(
        enabled=True, executable=CHROMIUM, profiles_dir=str(tmp_path), max_screenshot_bytes=1024
    )
    contexts = BrowserContexts(settings, CHROMIUM, "w-1", "ua")
    try:
        async with aiohttp.ClientSession() as session:
            ctx = _context(simulator, contexts, session, "/shop/item/1", spec, [])
            with pytest.raises(PermanentFailure) as raised:
                await browser_page(ctx)
    finally:
        await contexts.close()
    assert raised.value.reason == reason and says in raised.value.detail, raised.value.detail
    assert simulator.counts()["by_path_kind"] == {"shop-item": 1}  # one visit, no more
