"""The gateway's dashboard endpoints over a real stack: the reads add up after a known
run, the control POSTs need the token, refuse bad input with a clear message, and do
what the CLI does (recorded in the audit log as the dashboard)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from jetfleet.schemas import DeadLetter, Job, WorkOrder
from jetfleet.schemas.lease import QuarantineRecord, QuarantineReply, QuarantineSet
from jetfleet.services.gateway import Gateway, fleet_reads
from jetfleet.services.gateway.access import check_write
from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeoutError

from jetfleet import subjects
from jetfleet.auth.credentials import settings_for_role
from jetfleet.connection import connect_nats
from jetfleet.ops.pause_status import pauses_in_force
from jetfleet.ops.status import fleet_status
from jetfleet.presence_writer import DirectPresenceWriter
from jetfleet.region_presence import region_key
from jetfleet.settings import GatewaySettings, Settings
from tests.conftest import wait_for
from tests.dashboard_stack import (
    AUTH,
    DEAD_JOBS,
    IDENTITY,
    OK_JOBS,
    TOKEN,
    WORKER,
    DashboardStack,
    dashboard_stack,
)


@pytest.fixture
async def dash(settings: Settings, nc: NatsClient) -> AsyncIterator[DashboardStack]:
    async with dashboard_stack(settings, nc) as running:
        yield running


CONTROLS = [
    "/v1/pause",
    "/v1/resume",
    "/v1/proposals/0123456789abcdef/approve",
    "/v1/proposals/0123456789abcdef/reject",
    "/v1/dead-letters/1/replay",
]


async def test_every_control_route_is_refused_without_the_token_and_changes_nothing(
    dash: DashboardStack,
) -> None:
    for path in CONTROLS:
        status, answer = await dash.post(path, token=False)
        assert status == 401, (path, answer)
        assert "Authorization: Bearer" in answer["error"]
    assert await pauses_in_force(dash.nc) == []
    assert await dash.audit() == []


def test_control_routes_are_forbidden_beyond_loopback_when_no_token_is_set() -> None:
    # The control routes share the submit route's check (a gateway cannot be bound to
    # a non-loopback address here to ask it over HTTP).
    denial = check_write(GatewaySettings(host="0.0.0.0"), None)
    assert denial is not None and denial.status == 403
    assert "set gateway.token" in denial.message


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/pause", {"scope": "galaxy"}, "$.scope"),
        ("/v1/pause", {"for": "soon"}, "is not a duration"),
        ("/v1/pause", {"scope": "target", "name": "Not A Target"}, "is not a target name"),
        ("/v1/pause", {"name": "x"}, "a fleet pause names nothing"),
        ("/v1/pause", {"colour": "red"}, "unknown field"),
        ("/v1/proposals/zz/approve", {}, "is not a proposal id"),
        ("/v1/dead-letters/abc/replay", {}, "is not a dead letter id"),
        ("/v1/dead-letters/0/replay", {}, "is not a dead letter id"),
    ],
)
async def test_bad_input_is_answered_400_saying_what_is_wrong(
    dash: DashboardStack, path: str, body: dict[str, str], expected: str
) -> None:
    status, answer = await dash.post(path, body)
    assert status == 400, answer
    assert expected in answer["error"]


async def test_a_body_that_is_not_json_is_answered_400(dash: DashboardStack) -> None:
    status, answer = await dash.post("/v1/pause", raw=b"{not json")
    assert status == 400
    assert answer["error"].startswith("bad request body")


async def test_a_dead_letter_that_does_not_exist_is_answered_404(dash: DashboardStack) -> None:
    status, answer = await dash.post("/v1/dead-letters/999/replay")
    assert status == 404
    assert "no dead letter 999" in answer["error"]
    [entry] = await dash.audit()  # refused, and recorded as the CLI records it
    assert (entry.entry.action, entry.entry.who, entry.entry.outcome) == (
        "dlq.replay",
        "dashboard",
        "refused",
    )


async def test_the_reads_show_the_known_run(dash: DashboardStack) -> None:
    await dash.known_run()
    status, targets = await dash.get("/v1/targets")
    assert status == 200
    [demo] = targets["targets"]
    assert demo["target"] == "demo" and demo["rate_cap"] == 1000 and demo["breaker"] == "closed"

    async def tallied() -> bool:
        _, doc = await dash.get("/v1/workers")
        rows = {w["name"]: w for w in doc["workers"]}
        row = rows.get(WORKER)
        return row is not None and (row["ok"], row["failed"]) == (OK_JOBS, DEAD_JOBS)

    await wait_for(tallied, 20, "the gateway to tally the run's outcome events")
    _, actors = await dash.get("/v1/workers")
    [worker] = actors["workers"]
    assert worker["identities"] == [IDENTITY]
    [identity] = actors["identities"]
    assert (identity["name"], identity["owner"], identity["ok"]) == (IDENTITY, WORKER, OK_JOBS)

    _, versions = await dash.get("/v1/versions/series")
    [version] = versions["versions"]
    assert sum(p["total"] for p in version["points"]) == OK_JOBS + DEAD_JOBS
    assert sum(p["ok"] for p in version["points"]) == OK_JOBS

    _, letters = await dash.get("/v1/dead-letters")
    assert letters["total"] == DEAD_JOBS
    assert sorted(letter["job"] for letter in letters["letters"]) == ["gone-0", "gone-1"]
    status, answer = await dash.get("/v1/dead-letters?limit=0")
    assert status == 400 and "limit" in answer["error"]


async def test_pause_and_resume_reach_the_leaser_and_are_audited_as_the_dashboard(
    dash: DashboardStack,
) -> None:
    status, answer = await dash.post("/v1/pause", {"for": "10m", "why": "maintenance"})
    assert status == 200 and answer["ok"], answer
    [pause] = await pauses_in_force(dash.nc)
    assert (pause.record.scope, pause.record.by, pause.record.why) == (
        "fleet",
        "dashboard",
        "maintenance",
    )
    status, answer = await dash.post("/v1/resume", {})
    assert status == 200, answer
    assert await pauses_in_force(dash.nc) == []
    actions = [(r.entry.action, r.entry.who) for r in await dash.audit()]
    assert actions == [("pause", "dashboard"), ("resume", "dashboard")]


async def test_a_pause_the_leaser_refuses_is_answered_409_with_its_reason(
    dash: DashboardStack,
) -> None:
    status, answer = await dash.post("/v1/pause", {"scope": "target", "name": "nowhere"})
    assert status == 409
    assert answer["error"].startswith("the leaser refused: not paused")


async def test_a_proposal_is_approved_or_rejected_and_a_letter_replayed(
    dash: DashboardStack,
) -> None:
    approve = await dash.propose("10.9.1.0/24")
    reject = await dash.propose("10.9.2.0/24")
    status, answer = await dash.post(f"/v1/proposals/{approve}/approve", {"why": "seen it"})
    assert status == 200, answer
    status, answer = await dash.post(f"/v1/proposals/{reject}/reject", {"reason": "a CDN"})
    assert status == 200, answer
    state = await fleet_status(dash.js, dash.settings)
    assert [(q.scope, q.name) for q in state.quarantines] == [("egress", "10.9.1.0/24")]
    [rejected] = state.proposals
    assert (rejected.id, rejected.state) == (reject, "rejected")
    status, answer = await dash.post(f"/v1/proposals/{approve}/approve")
    assert status == 409 and "no egress proposal" in answer["error"]

    await dash.known_run()
    _, letters = await dash.get("/v1/dead-letters")
    letter = letters["letters"][0]
    status, answer = await dash.post(f"/v1/dead-letters/{letter['id']}/replay")
    assert status == 200
    assert answer["replayed"] == [f"{letter['job']}.r{letter['id']}"]
    totals = (await fleet_status(dash.js, dash.settings)).totals
    assert totals.submitted == OK_JOBS + DEAD_JOBS + 1
    actions = [(r.entry.action, r.entry.who, r.entry.outcome) for r in await dash.audit()]
    assert ("quarantine.approve", "dashboard", "done") in actions
    assert ("quarantine.reject", "dashboard", "done") in actions
    assert ("dlq.replay", "dashboard", "done") in actions


async def test_a_control_request_another_web_page_could_send_is_refused(
    dash: DashboardStack,
) -> None:
    url = dash.gateway.url + "/v1/pause"
    cross = {**AUTH, "Content-Type": "application/json", "Origin": "http://evil.example"}
    async with dash.http.post(url, data=b"{}", headers=cross) as response:
        assert response.status == 403
        assert "another origin" in (await response.json())["error"]
    # A form post (no preflight) cannot carry a JSON content type.
    form = {**AUTH, "Content-Type": "text/plain"}
    async with dash.http.post(url, data=b"{}", headers=form) as response:
        assert response.status == 415
        assert "application/json" in (await response.json())["error"]
    same = {**AUTH, "Content-Type": "application/json", "Origin": dash.gateway.url}
    async with dash.http.post(url, data=b"{}", headers=same) as response:
        assert response.status == 200
    assert [p.record.by for p in await pauses_in_force(dash.nc)] == ["dashboard"]


async def test_the_regions_a_running_worker_announces_are_listed(dash: DashboardStack) -> None:
    _, before = await dash.get("/v1/workers")
    assert before["regions"] == []
    # As a worker of region eu-west announces it (scripted: its writer, not its loop).
    writer = DirectPresenceWriter(dash.js)
    await writer.put(subjects.BUCKET_WORKERS, region_key("eu-west"), b"eu-west", ttl_s=60)

    async def listed() -> bool:  # once the shared answer (shared_reads.FRESH_S) is stale
        _, after = await dash.get("/v1/workers")
        return bool(after["regions"] == ["eu-west"])

    await wait_for(listed, 10, "the region to be listed")


READS = ["/v1/targets", "/v1/workers", "/v1/versions/series", "/v1/dead-letters"]


async def test_the_dashboard_reads_need_the_token_unless_reads_are_open(
    dash: DashboardStack,
) -> None:
    for path in READS:  # this gateway has open_reads
        status, _ = await dash.get(path)
        assert status == 200, path
    own = msgspec.structs.replace(
        dash.settings, gateway=GatewaySettings(port=0, token=TOKEN, open_reads=False)
    )
    conn = await connect_nats(dash.settings.nats, "gateway-closed", role="gateway")
    closed = Gateway(settings_for_role(own, "gateway"), conn)
    await closed.start()
    try:
        for path in READS:
            async with dash.http.get(closed.url + path) as response:
                assert response.status == 401, path
                assert "gateway token" in (await response.json())["error"]
            async with dash.http.get(closed.url + path, headers=AUTH) as response:
                assert response.status == 200, path
    finally:
        await closed.drain(5.0)
        await conn.close()


@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ({"Authorization": "Bearer not-the-token"}, ""),
        ({"Authorization": f"Basic {TOKEN}"}, ""),
        ({"Authorization": f"Bearer {TOKEN}x"}, ""),
        ({}, f"?token={TOKEN}"),
        ({}, f"?access_token={TOKEN}"),
    ],
)
async def test_a_wrong_token_or_one_in_the_query_string_is_refused(
    dash: DashboardStack, headers: dict[str, str], query: str
) -> None:
    for path in CONTROLS:
        sent = {"Content-Type": "application/json", **headers}
        async with dash.http.post(dash.gateway.url + path + query, data=b"{}", headers=sent) as r:
            assert r.status == 401, (path, await r.text())
    assert await pauses_in_force(dash.nc) == []
    assert await dash.audit() == []


async def test_a_tokenless_loopback_gateway_refuses_a_dns_rebinding_page(
    dash: DashboardStack,
) -> None:
    # A page on evil.example whose name is rebound to 127.0.0.1 sends its own origin and
    # its own name as Host: same-origin to the browser, and no token is asked for.
    own = msgspec.structs.replace(dash.settings, gateway=GatewaySettings(port=0, token=""))
    conn = await connect_nats(dash.settings.nats, "gateway-tokenless", role="gateway")
    open_ = Gateway(settings_for_role(own, "gateway"), conn)
    await open_.start()
    try:
        port = open_.url.rsplit(":", 1)[1]
        rebound = {
            "Host": f"evil.example:{port}",
            "Origin": f"http://evil.example:{port}",
            "Content-Type": "application/json",
        }
        async with dash.http.post(open_.url + "/v1/pause", data=b"{}", headers=rebound) as r:
            assert r.status == 403, await r.text()
            assert "loopback" in (await r.json())["error"]
        async with dash.http.get(open_.url + "/v1/status", headers=rebound) as r:
            assert r.status == 403, await r.text()
        assert await pauses_in_force(dash.nc) == []
        # Addressed by a loopback name (the page it serves itself), it still works.
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            loopback = {"Host": host, "Content-Type": "application/json"}
            async with dash.http.get(open_.url + "/v1/status", headers=loopback) as r:
                assert r.status == 200, host
    finally:
        await open_.drain(5.0)
        await conn.close()


async def test_the_dead_letter_read_looks_at_the_newest_letters_only(
    dash: DashboardStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each poll of each open tab reads it: its cost must not grow with the letters kept.
    monkeypatch.setattr(fleet_reads, "SCAN_LETTERS", 20)
    order = WorkOrder(
        job=Job(id="j", url="/page/1"), target="demo", key="k", max_attempts=1, timeout_s=5.0
    )
    for n in range(1, 31):
        letter = DeadLetter(
            order=msgspec.structs.replace(order, job=Job(id=f"j{n}", url="/page/1")),
            reason="http-404" if n % 2 else "blocked:challenged",
            history=[],
        )
        await dash.js.publish(subjects.dead_letter("demo", f"j{n}"), msgspec.json.encode(letter))
    status, doc = await dash.get("/v1/dead-letters?limit=5")
    assert status == 200, doc
    assert doc["total"] == 30
    assert doc["scanned"] == 20 and doc["complete"] is False
    assert doc["matched"] == 20
    assert [letter["job"] for letter in doc["letters"]] == [f"j{n}" for n in range(30, 25, -1)]
    _, blocked = await dash.get("/v1/dead-letters?reason=blocked&limit=500")
    assert [letter["job"] for letter in blocked["letters"]] == [f"j{n}" for n in range(30, 10, -2)]
    # The dashboard never shows a letter's idempotency key: it is not sent.
    assert all("key" not in letter for letter in doc["letters"])


@pytest.mark.expects_refusals
async def test_the_gateways_credentials_answer_proposals_and_set_no_quarantine(
    dash: DashboardStack, caplog: pytest.LogCaptureFixture
) -> None:
    # The leaser cannot tell who sent a command, so the gateway's NATS role is what keeps
    # a stolen gateway credential from quarantining (or releasing) anything.
    caplog.set_level(logging.ERROR, logger="jetfleet.connection")
    forged = QuarantineSet(
        record=QuarantineRecord(scope="worker", name=WORKER, target="demo"), by="alice"
    )
    rogue = await connect_nats(dash.settings.nats, "gateway-rogue", role="gateway")
    try:
        with pytest.raises(NatsTimeoutError):  # the server drops the publish: no answer
            await rogue.request(subjects.QUARANTINE, msgspec.json.encode(forged), timeout=2.0)

        async def refused() -> bool:
            return any(
                "role gateway" in r.getMessage() and subjects.QUARANTINE in r.getMessage()
                for r in caplog.records
            )

        await wait_for(refused, 5, "the server to refuse the gateway's jf.quarantine")
        # Its own subject takes proposal answers only.
        reply = await rogue.request(
            subjects.QUARANTINE_ANSWER, msgspec.json.encode(forged), timeout=10.0
        )
        answer = msgspec.json.decode(reply.data, type=QuarantineReply)
        assert not answer.ok and "malformed" in answer.detail, answer
    finally:
        await rogue.close()
    assert (await fleet_status(dash.js, dash.settings)).quarantines == []


async def test_a_leaser_that_never_answers_is_a_503_naming_it_within_the_request_timeout(
    settings: Settings, nc: NatsClient
) -> None:
    # No leaser but one that takes the requests and never answers (hung, partitioned).
    silent = [
        await nc.subscribe(s, queue=subjects.QUEUE_LEASER)
        for s in (subjects.PAUSE, subjects.QUARANTINE_ANSWER)
    ]
    own = msgspec.structs.replace(
        settings, gateway=GatewaySettings(port=0, token=TOKEN, request_timeout_s=3.0)
    )
    conn = await connect_nats(settings.nats, "gateway-hung-leaser", role="gateway")
    gateway = Gateway(settings_for_role(own, "gateway"), conn)
    await gateway.start()
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/pause", "/v1/proposals/0123456789abcdef/approve"):
                async with http.post(gateway.url + path, data=b"{}", headers=headers) as r:
                    answer = await r.json()
                    assert r.status == 503, (path, answer)
                    assert "no leaser answered" in answer["error"], answer
                    assert r.headers["Retry-After"] == "1"
    finally:
        await gateway.drain(5.0)
        await conn.close()
        for sub in silent:
            await sub.unsubscribe()


async def test_tabs_polling_at_once_share_one_computed_answer_per_read(
    dash: DashboardStack,
) -> None:
    await dash.known_run()
    tabs = 10
    for path in READS:
        before = dash.gateway.shared.computed
        answers = await asyncio.gather(*(dash.get(path) for _ in range(tabs)))
        assert all(status == 200 for status, _ in answers), path
        assert len({msgspec.json.encode(doc) for _, doc in answers}) == 1, path
        assert dash.gateway.shared.computed - before == 1, path
    # A tab polling again after FRESH_S gets a newly computed answer.
    first = dash.gateway.shared.computed

    async def recomputed() -> bool:
        await dash.get("/v1/targets")
        return dash.gateway.shared.computed > first

    await wait_for(recomputed, 10, "a fresh answer after FRESH_S")


async def test_open_reads_are_open_only_to_a_loopback_name(dash: DashboardStack) -> None:
    # `jetfleet dev` keeps reads open on its loopback gateway: a DNS-rebinding page must
    # not read the fleet through it, while a proxy that sends the token still can.
    port = dash.gateway.url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}"}
    for path in ["/v1/status", *READS]:
        async with dash.http.get(dash.gateway.url + path, headers=rebound) as r:
            assert r.status == 401, path
        async with dash.http.get(dash.gateway.url + path, headers={**rebound, **AUTH}) as r:
            assert r.status == 200, path
        async with dash.http.get(dash.gateway.url + path) as r:
            assert r.status == 200, path
