"""Egress proposals and second-order retirements against real servers (DESIGN.md I6).

Outcome events are published onto ``jf.outcome.<target>.<job>`` as workers send them;
the real quarantine service counts them, the real leaser enforces what an operator
approves, and leases are asked for as workers ask (with their subnet)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import LeaseRequest, Outcome, Versions
from jetfleet.schemas.lease import (
    QuarantineApprove,
    QuarantineRecord,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.services.quarantine import QuarantineService, egress_proposals
from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.cli.main import main
from jetfleet.cli.quarantine_commands import _command, send
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import JetfleetError
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.quarantine_view import QuarantineView, read_quarantines
from jetfleet.quarantine_proposals import proposal_id, write_proposal
from jetfleet.settings import EgressRule, QuarantineRule, QuarantineSettings, Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import ask, granted, order_for, refused
from tests.stack import InProcessStack
from tests.test_quarantine_service import read_everything

SHOP, NEWS = "shop", "news"
NET_A, NET_B = "10.1.0.0/24", "10.2.0.0/24"
EGRESS = EgressRule(identities=2, window_s=600.0, for_s=3600.0, proposal_ttl_s=7200.0)
RULE = f"rule:{EGRESS.name}"
RETIRE = QuarantineRule(
    name="retire-2-challenges",
    on="challenged",
    scope="identity",
    count=2,
    window_s=600.0,
    action="retire",
    for_s=3600.0,
)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """Two targets; the egress rule (2 identities of a subnet in 10 minutes) and no
    other rule, so only proposals come of blocked outcomes."""
    target = sim_target(simulator)
    base = make_settings(nats_url, redis_url, {SHOP: target, NEWS: target})
    return msgspec.structs.replace(base, quarantine=QuarantineSettings(rules=(), egress=EGRESS))


_seq = iter(range(1_000_000))


async def publish(
    nc: NatsClient,
    identity: str,
    subnet: str,
    target: str = SHOP,
    reason: str = "blocked",
) -> str:
    """One blocked outcome of a worker with ``identity`` on ``subnet``; its job id."""
    job_id = f"{identity}-{next(_seq)}"
    event = Outcome(
        job_id=job_id,
        target=target,
        worker=f"w-{identity}",
        attempt=1,
        kind="blocked",
        duration_s=0.1,
        versions=Versions(jetfleet="0", handler="http.get@0"),
        identity=identity,
        reason=reason,
        subnet=subnet,
    )
    await nc.jetstream().publish(subjects.outcome(target, job_id), msgspec.json.encode(event))
    return job_id


async def view(nc: NatsClient) -> QuarantineView:
    return await read_quarantines(nc.jetstream())


async def proposed(nc: NatsClient) -> str:
    """Wait for exactly one pending proposal; its id."""

    async def one() -> bool:
        return len((await view(nc)).proposals) == 1

    await wait_for(one, 30.0, "one egress proposal")
    (proposal,) = (await view(nc)).proposals
    return proposal.id


def lease_ask(settings: Settings, worker: str, subnet: str, target: str = SHOP) -> LeaseRequest:
    order = order_for(settings, f"/page/{next(_seq)}", target=target)
    return msgspec.structs.replace(
        ask(order, worker=worker, identity=f"id-{worker}"), subnet=subnet
    )


async def test_I6_one_identity_of_a_subnet_blocked_again_and_again_proposes_nothing(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    for _ in range(5):
        await publish(nc, "id-a", NET_A)
    await read_everything(nc, replica)
    assert (await view(nc)).proposals == []
    assert replica.egress.proposed.values == {}


async def test_I6_two_identities_of_one_subnet_blocked_propose_one_egress_quarantine(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    jobs = [await publish(nc, "id-a", NET_A), await publish(nc, "id-b", NET_A, reason="challenged")]
    id_ = await proposed(nc)
    assert id_ == proposal_id(NET_A, SHOP)
    (proposal,) = (await view(nc)).proposals
    assert (proposal.subnet, proposal.target, proposal.state) == (NET_A, SHOP, "proposed")
    assert (proposal.set_by, proposal.for_s, proposal.identities) == (
        RULE,
        3600.0,
        ["id-a", "id-b"],
    )
    assert [e.job_id for e in proposal.evidence] == jobs
    assert [e.reason for e in proposal.evidence] == ["blocked", "challenged"]
    assert f"2 identities of subnet {NET_A}" in proposal.reason
    # It lapses by the server's TTL if nobody answers.
    assert proposal.left_s is not None and 7100 < proposal.left_s <= 7200
    assert replica.egress.proposed.get(target=SHOP, outcome="proposed") == 1
    # A proposal quarantines nothing: the subnet still gets leases on shop.
    client = LeaseClient(nc)
    await granted(client, lease_ask(settings, "a1", NET_A))
    assert (await view(nc)).records == []


async def test_identities_on_different_subnets_or_targets_propose_nothing(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await publish(nc, "id-a", NET_A)
    await publish(nc, "id-c", NET_B)
    await publish(nc, "id-b", NET_A, target=NEWS)
    await publish(nc, "id-d", "")  # a worker without a subnet
    await read_everything(nc, replica)
    assert (await view(nc)).proposals == []


async def test_I6_an_approved_proposal_stops_that_subnet_on_that_target_only(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    # Held leases: subnet A on shop (to be revoked), B on shop and A on news (untouched).
    a_shop, b_shop = lease_ask(settings, "a1", NET_A), lease_ask(settings, "b1", NET_B)
    a_news = lease_ask(settings, "a1", NET_A, target=NEWS)
    for request in (a_shop, b_shop, a_news):
        await granted(client, request)
    await services.add_quarantine()
    jobs = [await publish(nc, "id-a", NET_A), await publish(nc, "id-b", NET_A)]
    id_ = await proposed(nc)

    reply = await send(settings, QuarantineApprove(id=id_))
    assert reply.ok, reply.detail
    assert reply.revoked == [a_shop.job_id]
    (record,) = (await view(nc)).records
    assert (record.scope, record.name, record.target) == ("egress", NET_A, SHOP)
    assert (record.set_by, record.proposed_by, record.for_s) == ("operator", RULE, 3600.0)
    assert [e.job_id for e in record.evidence] == jobs
    assert record.reason.startswith(f"approved egress proposal {id_}: rule {EGRESS.name}")
    assert record.left_s is not None and 3500 < record.left_s <= 3600
    assert (await view(nc)).proposals == []  # approved: the proposal is gone

    # Every worker of subnet A is refused on shop, whatever its identity ...
    for worker in ("a1", "a2"):
        refusal = await refused(client, lease_ask(settings, worker, NET_A))
        assert refusal.reason == "quarantined"
        assert f"egress {NET_A} is quarantined on shop" in refusal.detail
    # ... while subnet B keeps shop (its one worker there: one per subnet and target), and
    # subnet A keeps news (its lease there lives on).
    await granted(client, lease_ask(settings, "b1", NET_B))
    await granted(client, lease_ask(settings, "a1", NET_A, target=NEWS))
    assert await store.live(a_shop.job_id) is None
    assert await store.live(b_shop.job_id) is not None
    assert await store.live(a_news.job_id) is not None

    released = await send(settings, QuarantineRelease(scope="egress", name=NET_A, target=SHOP))
    assert released.ok
    await granted(client, lease_ask(settings, "a1", NET_A))


async def test_I6_a_rejected_proposal_sets_nothing_and_the_same_evidence_never_proposes_again(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    first = await services.add_quarantine()
    await publish(nc, "id-a", NET_A)
    await publish(nc, "id-b", NET_A)
    id_ = await proposed(nc)
    reply = await send(settings, QuarantineReject(id=id_, reason="our own load test"))
    assert reply.ok, reply.detail
    (rejected,) = (await view(nc)).proposals
    assert (rejected.state, rejected.answered_by) == ("rejected", "operator: our own load test")
    assert (await view(nc)).records == []
    await granted(LeaseClient(nc), lease_ask(settings, "a1", NET_A))
    await read_everything(nc, first)

    # A replica started later replays the same window: the marker keeps the rejection.
    second = await services.add_quarantine()
    await read_everything(nc, second)
    assert second.egress.proposed.get(target=SHOP, outcome="already-fired") == 1
    assert second.egress.proposed.get(target=SHOP, outcome="proposed") == 0
    assert [p.state for p in (await view(nc)).proposals] == ["rejected"]

    # A rejected proposal cannot be approved; the answer says how to set it anyway.
    again = await send(settings, QuarantineApprove(id=id_))
    assert not again.ok and "was rejected" in again.detail
    assert f"quarantine set --subnet {NET_A} --target {SHOP}" in again.detail
    assert (await view(nc)).records == []


async def test_two_replicas_meeting_the_egress_rule_propose_once(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replicas = [await services.add_quarantine(), await services.add_quarantine()]
    await publish(nc, "id-a", NET_A)
    await publish(nc, "id-b", NET_A)

    def total(outcome: str) -> int:
        return sum(r.egress.proposed.get(target=SHOP, outcome=outcome) for r in replicas)

    async def both_met() -> bool:
        return total("proposed") + total("already-fired") == 2

    await wait_for(both_met, 30.0, "both replicas meeting the egress rule")
    assert (total("proposed"), total("already-fired")) == (1, 1)
    assert len((await view(nc)).proposals) == 1


async def test_bad_egress_commands_are_refused_with_what_to_fix(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    answer = await nc.request(subjects.QUARANTINE, b'{"type":"approve","id":"../x"}', timeout=5.0)
    reply = msgspec.json.decode(answer.data, type=QuarantineReply)
    assert not reply.ok and reply.detail.startswith("malformed command")
    unknown = await send(settings, QuarantineApprove(id="0" * 16))
    assert not unknown.ok and "no egress proposal 0000000000000000" in unknown.detail
    for subnet, fix in (
        ("10.1.0.5/24", "not a network"),
        ("10.1.0.0/255.255.255.0", "as '10.1.0.0/24'"),
    ):
        record = QuarantineRecord(scope="egress", name=subnet, target=SHOP, set_by="operator")
        refusal = await send(settings, QuarantineSet(record=record))
        assert not refusal.ok and fix in refusal.detail
    assert (await view(nc)).records == []

    args = argparse.Namespace(quarantine_action="approve", id="nope")
    with pytest.raises(JetfleetError, match="not a proposal id"):
        _command(args, settings)


@pytest.fixture
def retiring(settings: Settings) -> Settings:
    """The retire rule (2 challenges retire an identity) and no egress rule."""
    quarantine = msgspec.structs.replace(
        settings.quarantine,
        rules=(RETIRE,),
        second_order_window_s=120.0,
        egress=EgressRule(identities=0),
    )
    return msgspec.structs.replace(settings, quarantine=quarantine)


async def retire(nc: NatsClient, identity: str, subnet: str) -> None:
    """Two challenges of ``identity``; wait until it is retired on shop."""
    await publish(nc, identity, subnet, reason="challenged")
    await publish(nc, identity, subnet, reason="challenged")

    async def retired() -> bool:
        return any(r.name == identity for r in (await view(nc)).records)

    await wait_for(retired, 30.0, f"{identity} retired on shop")


@contextlib.asynccontextmanager
async def serving(settings: Settings, services: InProcessStack) -> AsyncIterator[QuarantineService]:
    """A quarantine replica with ``settings`` (not the stack's), drained at the end."""
    replica = QuarantineService(settings, services.connections[0])
    await replica.start()
    try:
        yield replica
    finally:
        await replica.drain(5.0)


def second_order(records: QuarantineView) -> dict[str, str]:
    return {r.name: r.second_order_of for r in records.records}


async def test_I6_second_order_count_is_zero_when_one_identity_is_retired(
    retiring: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    async with serving(retiring, services) as replica:
        await retire(nc, "id-a", NET_A)
        await retire(nc, "id-c", NET_B)  # another subnet: no neighbour
        assert second_order(await view(nc)) == {"id-a": "", "id-c": ""}
        assert replica.second_order.counted.values == {}
        status = await services.status()
        assert status.second_order == 0 and len(status.quarantines) == 2
        assert {r.subnet for r in status.quarantines} == {NET_A, NET_B}


async def test_I6_second_order_counts_a_neighbour_retired_within_the_window(
    retiring: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    async with serving(retiring, services) as replica:
        await retire(nc, "id-a", NET_A)
        # Released at once: the retirement still happened, and its mark stays.
        assert (
            await send(retiring, QuarantineRelease(scope="identity", name="id-a", target=SHOP))
        ).ok
        await retire(nc, "id-b", NET_A)
        assert second_order(await view(nc)) == {"id-b": "id-a"}
        assert replica.second_order.counted.get(target=SHOP) == 1

    # A restarted service sees the same neighbours: the marks are in jf-control.
    async with serving(retiring, services) as restarted:
        await retire(nc, "id-d", NET_A)
        assert second_order(await view(nc))["id-d"] in ("id-a", "id-b")
        assert restarted.second_order.counted.get(target=SHOP) == 1
        status = await services.status()
        assert status.second_order == 2


async def test_I6_a_retirement_after_the_neighbours_window_is_first_order(
    retiring: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    short = msgspec.structs.replace(
        retiring,
        quarantine=msgspec.structs.replace(retiring.quarantine, second_order_window_s=3.0),
    )
    async with serving(short, services) as replica:
        await retire(nc, "id-a", NET_A)
        marks = f"$KV.{subjects.BUCKET_CONTROL}.{subjects.QUARANTINE_RETIRED_PREFIX}.>"
        control_stream = f"KV_{subjects.BUCKET_CONTROL}"

        async def marked() -> bool:
            return await count_messages(nc.jetstream(), control_stream, marks) == 1

        async def marks_lapsed() -> bool:
            return await count_messages(nc.jetstream(), control_stream, marks) == 0

        await wait_for(marked, 10.0, "id-a's retirement mark")

        # The mark lapses by the server's TTL once the window has passed.
        await wait_for(marks_lapsed, 15.0, "id-a's retirement mark to lapse")
        await retire(nc, "id-b", NET_A)
        assert second_order(await view(nc)) == {"id-a": "", "id-b": ""}
        assert replica.second_order.counted.values == {}


async def test_status_and_the_cli_list_show_records_and_proposals(
    retiring: Settings,
    nc: NatsClient,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    both = msgspec.structs.replace(
        retiring,
        quarantine=msgspec.structs.replace(retiring.quarantine, egress=EGRESS),
    )
    async with serving(both, services):
        await retire(nc, "id-a", NET_A)
        await retire(nc, "id-b", NET_A)  # also the second identity of NET_A: a proposal
        id_ = await proposed(nc)
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(both))

    capsys.readouterr()
    assert (
        await asyncio.to_thread(main, ["--config", str(config), "quarantine", "list", "--json"])
        == 0
    )
    listed = json.loads(capsys.readouterr().out)
    assert [(r["name"], r.get("second_order_of", "")) for r in listed["records"]] == [
        ("id-a", ""),
        ("id-b", "id-a"),
    ]
    assert all(3500 < r["left_s"] <= 3600 for r in listed["records"])
    assert [p["id"] for p in listed["proposals"]] == [id_]

    assert await asyncio.to_thread(main, ["--config", str(config), "status"]) == 0
    text = capsys.readouterr().out
    assert "quarantines in force: 2 (1 second-order)" in text
    assert "egress proposals: 1 pending, 0 rejected" in text
    assert id_ in text and NET_A in text

    assert await asyncio.to_thread(main, ["--config", str(config), "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["second_order"] == 1
    assert [p["id"] for p in status["proposals"]] == [id_]
    assert {r["name"] for r in status["quarantines"]} == {"id-a", "id-b"}

    assert (
        await asyncio.to_thread(main, ["--config", str(config), "quarantine", "approve", id_]) == 0
    )
    assert "approved: quarantined" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["--config", str(config), "quarantine", "list"]) == 0
    text = capsys.readouterr().out
    assert "quarantines in force: 3 (1 second-order)" in text
    assert "operator (rule:egress-subnet-blocked)" in text
    with pytest.raises(KeyNotFoundError):
        control = await nc.jetstream().key_value(subjects.BUCKET_CONTROL)
        await control.get(f"{subjects.QUARANTINE_PROPOSAL_PREFIX}.{id_}")


async def test_a_proposal_a_kv_error_kept_from_being_written_is_written_on_a_retry(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(egress_proposals, "RETRY_FIRST_S", 0.05)
    write = write_proposal
    failures: list[int] = []

    async def failing_once(*args: object, **kwargs: object) -> None:
        # The fault: JetStream does not answer the first write (a leader change).
        if not failures:
            failures.append(1)
            raise NatsTimeoutError
        await write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(egress_proposals, "write_proposal", failing_once)
    replica = await services.add_quarantine()
    await publish(nc, "id-a", NET_A)
    await publish(nc, "id-b", NET_A)
    assert await proposed(nc) == proposal_id(NET_A, SHOP)
    assert failures == [1]
    assert replica.egress.proposed.get(target=SHOP, outcome="proposed") == 1
    assert replica.egress.proposed.get(target=SHOP, outcome="failed") == 0
    assert replica.egress.pending == []
