"""Item 11: one contract at every entry point.

The same input goes through ``jetfleet submit``, ``POST /v1/targets/{t}/jobs`` and a bare
core-NATS publish to ``jf.submit.<t>`` (what a client in any language does), on a real
stack (nats-server, the scheduler), and must come out the same: the same work order
(URL resolved, defaults filled in) on ``jf.work.<t>.<tier>``, or the same rejection
(reason and message) on ``jf.rejected.<t>``. Every case also states the outcome it must
have, so three equally wrong answers cannot pass.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from jetfleet.schemas import Rejection, WorkOrder
from jetfleet.services.gateway import Gateway
from nats.aio.client import Client as NatsClient

import jetfleet.cli.main as cli_main
from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.settings import GatewaySettings, Settings, TargetSettings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import make_settings, wait_for
from tests.stack import InProcessStack

TARGET = "shop"
MAX_ATTEMPTS = 4
TIMEOUT_S = 7.0
ENTRY_POINTS = ("cli", "gateway", "nats")

_order = msgspec.json.Decoder(WorkOrder)
_rejection = msgspec.json.Decoder(Rejection)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """``shop`` lives under a path (``/catalog/``), so a path that climbed to the host's
    root would show; its attempt budget and timeout are not the defaults."""
    shop = TargetSettings(
        base_url=simulator.base_url + "/catalog/",
        rate=1000,
        burst=100,
        max_attempts=MAX_ATTEMPTS,
        timeout_s=TIMEOUT_S,
    )
    return make_settings(nats_url, redis_url, {TARGET: shop})


@dataclass(frozen=True)
class Case:
    """One input and the outcome every entry point must give it."""

    job: dict[str, Any] | bytes
    """The JSON job (or raw bytes) posted and published; the CLI gets its url/handler."""
    url: str = ""
    """The admitted job's URL, relative to the simulator's base URL; empty: rejected."""
    reason: str = ""
    """The rejection's reason; empty: admitted."""
    entry_points: tuple[str, ...] = ENTRY_POINTS
    """Where the input can be expressed (the CLI takes only a URL and a handler)."""
    expected: dict[str, Any] = field(default_factory=dict)
    """Fields the admitted job must carry besides its URL."""
    target: str = TARGET


CASES = {
    "absolute-path": Case({"url": "/item/7"}, url="/catalog/item/7"),
    "relative-path": Case({"url": "item/7?b=2&a=1"}, url="/catalog/item/7?b=2&a=1"),
    "path-with-a-colon": Case({"url": "/item:7"}, url="/catalog/item:7"),
    "full-url-under-the-target": Case({"url": "{base}/catalog/item/8"}, url="/catalog/item/8"),
    "path-climbing-out": Case({"url": "../admin"}, reason="url-outside-target"),
    "url-outside-the-target": Case(
        {"url": "http://elsewhere.invalid/catalog/x"}, reason="url-outside-target"
    ),
    "malformed-url": Case({"url": "http://[::1/x"}, reason="invalid-url"),
    "other-scheme": Case({"url": "ftp://elsewhere.invalid/x"}, reason="invalid-url"),
    "unknown-handler": Case(
        {"url": "/item/9", "handler": "browser.click"}, reason="unknown-handler"
    ),
    "known-handler": Case(
        {"url": "/item/10", "handler": "noop"}, url="/catalog/item/10", expected={"handler": "noop"}
    ),
    "tier-high": Case({"url": "/item/14", "tier": "high"}, url="/catalog/item/14"),
    "attempts-over-the-targets": Case(
        {"url": "/item/15", "max_attempts": 50},
        url="/catalog/item/15",
        entry_points=("gateway", "nats"),
    ),
    "empty-url": Case({"url": ""}, reason="invalid-job"),
    "missing-url": Case(
        {"handler": "noop"}, reason="invalid-job", entry_points=("gateway", "nats")
    ),
    # One id per entry point: a second submission of one id is the same job.
    "id-given": Case(
        {"id": "given-{entry}", "url": "/item/11"},
        url="/catalog/item/11",
        entry_points=("gateway", "nats"),
        expected={"id": "given-{entry}"},
    ),
    "unknown-target": Case({"url": "/item/13"}, reason="unknown-target", target="nosuch"),
    "not-json": Case(
        b'{"url": "/item/12"', reason="invalid-json", entry_points=("gateway", "nats")
    ),
}


@dataclass(frozen=True)
class Outcome:
    """What the scheduler made of one submission, without what differs by design (the
    id the CLI or the gateway picks, the bytes each entry point encodes)."""

    order: WorkOrder | None = None
    reason: str = ""
    message: str = ""


Submit = Callable[[str, Case], Awaitable[None]]


class Entries:
    """The three entry points, on one stack, and a reader of what each submission made."""

    def __init__(
        self,
        settings: Settings,
        nc: NatsClient,
        gateway: Gateway,
        http: aiohttp.ClientSession,
        config: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.gateway = gateway
        self.http = http
        self.config = config
        self.capsys = capsys
        self.base = settings.targets[TARGET].base_url.removesuffix("/catalog/")

    def body(self, case: Case, entry: str) -> bytes:
        if isinstance(case.job, bytes):
            return case.job
        text = json.dumps(case.job)
        return text.replace("{base}", self.base).replace("{entry}", entry).encode()

    async def cli(self, case: Case) -> None:
        assert isinstance(case.job, dict)
        url = str(case.job["url"]).replace("{base}", self.base)
        argv = ["--config", str(self.config), "--stack", str(self.config.parent / "none")]
        argv += ["submit", case.target, url, "--json"]
        for flag in ("handler", "tier"):
            if flag in case.job:
                argv += [f"--{flag}", case.job[flag]]
        self.capsys.readouterr()
        code = await asyncio.to_thread(cli_main.main, argv)
        out = self.capsys.readouterr().out
        assert code == (1 if case.reason else 0), out
        assert len(json.loads(out)["submitted"]) == 1

    async def post(self, case: Case) -> None:
        url = f"{self.gateway.url}/v1/targets/{case.target}/jobs"
        async with self.http.post(url, data=self.body(case, "gateway")) as response:
            assert response.status == (400 if case.reason else 202), await response.text()

    async def publish(self, case: Case) -> None:
        # Core NATS, no JetStream ack, no message id: the least any client does.
        await self.nc.publish(subjects.submit(case.target), self.body(case, "nats"))
        await self.nc.flush()

    async def submit(self, entry: str, case: Case) -> Outcome:
        """Submit ``case`` through ``entry`` and read the one record the scheduler made."""
        before = await self._last_seqs()
        await {"cli": self.cli, "gateway": self.post, "nats": self.publish}[entry](case)
        seen: dict[str, int] = {}

        async def decided() -> bool:
            seen.update(await self._last_seqs())
            return seen != before

        await wait_for(decided, 15, f"the scheduler to decide the {entry} submission")
        await wait_for(self._settled, 15, "admission to settle")
        assert sum(seen.values()) == sum(before.values()) + 1, (before, seen)
        if seen[subjects.STREAM_WORK] > before[subjects.STREAM_WORK]:
            msg = await self.js.get_msg(subjects.STREAM_WORK, seen[subjects.STREAM_WORK])
            order = _order.decode(msg.data or b"")
            return Outcome(order=order)
        msg = await self.js.get_msg(subjects.STREAM_REJECTED, seen[subjects.STREAM_REJECTED])
        assert msg.subject == subjects.rejected(case.target)
        rejection = _rejection.decode(msg.data or b"")
        return Outcome(reason=rejection.reason, message=rejection.message)

    async def _last_seqs(self) -> dict[str, int]:
        streams = (subjects.STREAM_WORK, subjects.STREAM_REJECTED)
        return {s: (await self.js.stream_info(s)).state.last_seq for s in streams}

    async def _settled(self) -> bool:
        info = await self.js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
        return (info.num_pending or 0) == 0 and (info.num_ack_pending or 0) == 0


@pytest.fixture
async def entries(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> AsyncIterator[Entries]:
    """The scheduler (no workers: admitted orders stay on jf.work to be read), a gateway
    on its own connection, the CLI on a jetfleet.toml of the same settings."""
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    own = msgspec.structs.replace(settings, gateway=GatewaySettings(port=0))
    conn = await connect_nats(settings.nats, "gateway")
    gateway = Gateway(own, conn)
    await gateway.start()
    async with aiohttp.ClientSession() as http:
        yield Entries(settings, nc, gateway, http, config, capsys)
    await gateway.drain(5.0)
    await conn.close()


def _without_id(order: WorkOrder) -> WorkOrder:
    return msgspec.structs.replace(order, job=msgspec.structs.replace(order.job, id=""))


@pytest.mark.parametrize("name", list(CASES))
async def test_item11_every_entry_point_gives_the_same_outcome_for_the_same_input(
    entries: Entries, simulator: TargetSimulator, name: str
) -> None:
    case = CASES[name]
    outcomes = {entry: await entries.submit(entry, case) for entry in case.entry_points}

    if case.reason:
        for entry, outcome in outcomes.items():
            assert outcome.order is None, (entry, outcome)
            assert outcome.reason == case.reason, (entry, outcome.message)
        messages = {outcome.message for outcome in outcomes.values()}
        assert len(messages) == 1, messages
        return

    for entry, outcome in outcomes.items():
        assert outcome.order is not None, (entry, outcome.reason, outcome.message)
        order = outcome.order
        assert order.job.url == simulator.base_url + case.url, entry
        assert isinstance(case.job, dict)
        assert (order.target, order.job.tier) == (TARGET, case.job.get("tier", "normal")), entry
        assert (order.max_attempts, order.timeout_s) == (MAX_ATTEMPTS, TIMEOUT_S), entry
        assert order.job.id, entry
        for key, value in case.expected.items():
            assert getattr(order.job, key) == value.replace("{entry}", entry), (entry, key)
    orders = {entry: _without_id(o.order) for entry, o in outcomes.items() if o.order}
    first = orders[case.entry_points[0]]
    assert all(order == first for order in orders.values()), orders


async def test_item11_a_job_without_an_id_gets_one_that_a_redelivery_keeps(
    entries: Entries, simulator: TargetSimulator
) -> None:
    # The gateway names the job before publishing (it answers with the id); a bare
    # publish gets its id from admission, derived from the stored submission.
    case = Case({"url": "/item/20"}, url="/catalog/item/20")
    posted = await entries.submit("gateway", case)
    published = await entries.submit("nats", case)
    assert posted.order is not None and published.order is not None
    assert posted.order.job.id != published.order.job.id
    assert _without_id(posted.order) == _without_id(published.order)
    # A redelivery of the submission (a scheduler restarting mid-batch) is admitted from
    # the same stored message: the same id, so it is routed once (message id job-<id>).
    # Read it as the scheduler does, through a consumer (its metadata, not a direct get).
    delivered = [m async for m in read_stream(entries.js, subjects.STREAM_SUBMIT, "jf.submit.>")]
    last = delivered[-1]
    meta = last.metadata
    again = admit(last.subject, last.data, entries.settings, meta.sequence.stream, meta.timestamp)
    assert isinstance(again, WorkOrder) and again.job.id == published.order.job.id
