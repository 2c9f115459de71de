"""Bad lease calls and quarantine commands on the real leaser (issue 8 item 10): each is
refused with its reason and what to fix, nothing is granted or quarantined for it, and a
good call right after is still served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from jetfleet.schemas import LeaseGrant, LeaseRefusal, WorkOrder
from jetfleet.schemas.lease import (
    LeaseReply,
    QuarantineList,
    QuarantineRecord,
    QuarantineReply,
    QuarantineSet,
)
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.errors import ConfigError
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings, load_settings
from jetfleet.worker import Worker
from tests.leasing import ask, granted, order_for, report
from tests.stack import InProcessStack

_lease_reply = msgspec.json.Decoder(LeaseReply)
_quarantine_reply = msgspec.json.Decoder(QuarantineReply)
DELIVERY = "$JS.ACK.JF_WORK.work-demo-normal.1.7.7.0.0"


def _grant_body(order: WorkOrder, **fields: object) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(ask(order, reply_subject=DELIVERY))
    body.update(fields)
    return body


# (what is wrong, the fields that make it so, the reason, a hint the detail must carry)
BAD_GRANTS = [
    ("undeclared target", {"target": "nosuch"}, "unknown-target", "[targets.nosuch]"),
    ("target not a name", {"target": "Demo.x"}, "malformed-request", "$.target"),
    ("wildcard target", {"target": ">"}, "malformed-request", "$.target"),
    ("job id with spaces", {"job_id": "a b\r\nX: 1"}, "malformed-request", "$.job_id"),
    ("job id too long", {"job_id": "j" * 300}, "malformed-request", "$.job_id"),
    ("wildcard key", {"key": ">"}, "malformed-request", "$.key"),
    ("key with an empty token", {"key": "u-1..x"}, "malformed-request", "$.key"),
    ("empty worker", {"worker": ""}, "malformed-request", "$.worker"),
    ("worker too long", {"worker": "w" * 300}, "malformed-request", "$.worker"),
    ("worker with a line break", {"worker": "w\nFORGED"}, "malformed-request", "$.worker"),
    ("identity with control", {"identity": "id\x1b[2J"}, "malformed-request", "$.identity"),
    ("wildcard reply subject", {"reply_subject": "jf.>"}, "malformed-request", "$.reply_subject"),
]


@pytest.mark.parametrize(
    ("fields", "reason", "hint"),
    [case[1:] for case in BAD_GRANTS],
    ids=[case[0] for case in BAD_GRANTS],
)
async def test_item10_a_bad_lease_request_is_refused_with_its_reason_and_nothing_granted(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    fields: dict[str, object],
    reason: str,
    hint: str,
) -> None:
    client = LeaseClient(nc)
    done = order_for(settings, "/page/done")
    # A committed result is there, so a wildcard key would find "already done".
    fence = (await granted(client, ask(done))).fence
    assert (await report(nc, done, fence, "w-a")).status == "committed"
    assert await client.release(done.job.id, fence)

    order = order_for(settings, "/page/1")
    payload = msgspec.json.encode(_grant_body(order, **fields))
    answer = await nc.request(subjects.LEASE, payload, timeout=5.0)
    reply = _lease_reply.decode(answer.data)
    assert isinstance(reply, LeaseRefusal), reply
    assert (reply.reason, reply.retry_after_s) == (reason, 0.0), reply
    assert hint in reply.detail, reply.detail
    assert await store.all_live() == [], "a refused request must not leave a lease"
    assert (await store.highest_fence(order.job.id)).grants == 0

    # A good request right after is served.
    grant = await granted(client, ask(order, reply_subject=DELIVERY))
    assert grant.attempt == 1


async def test_item10_an_oversized_lease_call_is_refused_unread_and_the_next_is_served(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    order = order_for(settings, "/page/2")
    valid = msgspec.json.encode(_grant_body(order))
    # Valid JSON, a valid request: only its size (padding) is wrong.
    padded = valid[:-1] + b" " * (settings.fleet.max_request_bytes + 1) + b"}"
    answer = await nc.request(subjects.LEASE, padded, timeout=5.0)
    reply = _lease_reply.decode(answer.data)
    assert isinstance(reply, LeaseRefusal), reply
    assert reply.reason == "request-too-large", reply
    assert f"the request is {len(padded)} bytes" in reply.detail, reply.detail
    assert f"over the {settings.fleet.max_request_bytes} bytes" in reply.detail
    assert "fleet.max_request_bytes" in reply.detail
    assert await store.all_live() == []
    assert services.leaser is not None
    assert services.leaser.responder.refused.get(subject=subjects.LEASE, reason="too-large") == 1

    again = _lease_reply.decode((await nc.request(subjects.LEASE, valid, timeout=5.0)).data)
    assert isinstance(again, LeaseGrant), again


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        ({"type": "renew", "job_id": "x y", "fence": 3}, "$.job_id"),
        ({"type": "release", "job_id": "x" * 200, "fence": 3}, "$.job_id"),
        ({"type": "release", "job_id": "a.>", "fence": 3, "refund": True}, "$.job_id"),
    ],
    ids=["renew-job-id-with-a-space", "release-job-id-too-long", "release-wildcard-job-id"],
)
async def test_item10_a_renew_or_release_out_of_bounds_is_malformed_and_the_lease_stays(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    call: dict[str, object],
    hint: str,
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/3")
    grant = await granted(client, ask(order))
    answer = await nc.request(subjects.LEASE, msgspec.json.encode(call), timeout=5.0)
    reply = _lease_reply.decode(answer.data)
    assert isinstance(reply, LeaseRefusal) and reply.reason == "malformed-request", reply
    assert hint in reply.detail, reply.detail
    live = await store.live(order.job.id)
    assert live is not None and live.fence == grant.fence
    assert await client.renew(order.job.id, grant.fence) is True


def _record(**fields: object) -> dict[str, Any]:
    record = QuarantineRecord(scope="worker", name="w-bad", target="demo", reason="test")
    body: dict[str, Any] = msgspec.to_builtins(record)
    body.update(fields)
    return {"type": "set", "record": body}


BAD_COMMANDS = [
    ("undeclared target", _record(target="nosuch"), "[targets.nosuch]"),
    ("target not a name", _record(target="demo.worker"), "record.target"),
    ("empty name", _record(name=""), "record.name"),
    ("name too long", _record(name="n" * 300), "record.name"),
    ("name with a line break", _record(name="w\nx"), "record.name"),
    ("negative duration", _record(for_s=-5), "record.for_s is -5"),
    ("duration over a year", _record(for_s=1e12), "366 days"),
    ("reason too long", _record(reason="r" * 5000), "record.reason"),
    ("reason with control", _record(reason="a\x00b"), "printable"),
    ("set_by too long", _record(set_by="s" * 200), "record.set_by"),
    (
        "too much evidence",
        _record(evidence=[{"job_id": "j", "seq": 1}] * 101),
        "record.evidence names 101",
    ),
    (
        "evidence with a long job id",
        _record(evidence=[{"job_id": "j" * 200, "seq": 1}]),
        "record.evidence[0]",
    ),
    (
        "release of a wildcard target",
        {"type": "release", "scope": "worker", "name": "w", "target": "*"},
        "$.target",
    ),
    (
        "release of an empty name",
        {"type": "release", "scope": "worker", "name": "", "target": "demo"},
        "$.name",
    ),
]


@pytest.mark.parametrize(
    ("command", "hint"), [c[1:] for c in BAD_COMMANDS], ids=[c[0] for c in BAD_COMMANDS]
)
async def test_item10_a_bad_quarantine_command_is_refused_and_nothing_is_quarantined(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    command: dict[str, object],
    hint: str,
) -> None:
    answer = await nc.request(subjects.QUARANTINE, msgspec.json.encode(command), timeout=5.0)
    reply = _quarantine_reply.decode(answer.data)
    assert not reply.ok, reply
    assert hint in reply.detail, reply.detail
    assert await _records(nc) == []

    # A good command right after is served.
    good = QuarantineSet(record=QuarantineRecord(scope="worker", name="w-1", target="demo"))
    answer = await nc.request(subjects.QUARANTINE, msgspec.json.encode(good), timeout=5.0)
    assert _quarantine_reply.decode(answer.data).ok
    assert [r.name for r in await _records(nc)] == ["w-1"]


async def _records(nc: NatsClient) -> list[QuarantineRecord]:
    listing = msgspec.json.encode(QuarantineList())
    reply = _quarantine_reply.decode(
        (await nc.request(subjects.QUARANTINE, listing, timeout=5.0)).data
    )
    assert reply.ok, reply
    return reply.records


@pytest.mark.parametrize("value", ["100", "-1", "16383", "100000000"])
def test_item10_max_request_bytes_out_of_range_names_the_key_and_the_range(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(f"[fleet]\nmax_request_bytes = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert "fleet.max_request_bytes" in str(info.value)
    assert "16384 to 67108864" in str(info.value)
    assert load_settings(None, {}).fleet.max_request_bytes == 65536


@pytest.mark.parametrize(
    ("worker_id", "identity", "key"),
    [
        ("", "", "worker.id"),
        ("w" * 257, "", "worker.id"),
        ("w\nFORGED", "", "worker.id"),
        ("w-1", "id\x1b[2J", "worker.identity"),
    ],
    ids=["empty-id", "id-too-long", "id-with-a-line-break", "identity-with-control"],
)
async def test_item10_a_worker_whose_names_the_leaser_would_refuse_does_not_start(
    settings: Settings, nc: NatsClient, worker_id: str, identity: str, key: str
) -> None:
    # Started, every lease call would be refused malformed and its jobs handed back.
    with pytest.raises(ConfigError) as info:
        Worker(settings, nc, worker_id, identity=identity)
    assert key in str(info.value) and "without control characters" in str(info.value)
    Worker(settings, nc, "w" * 256, identity="ïd.entity *")  # the longest, any text


def test_the_largest_lease_call_jetfleet_may_send_fits_the_smallest_request_bound() -> None:
    """The bounds count characters; at 4 bytes a character in UTF-8 the largest call the
    wire types allow must still fit the smallest ``fleet.max_request_bytes``."""
    from jetfleet.schemas import LeaseRequest, Versions

    wide = "\U0001f600" * 256  # 4 bytes each in UTF-8, 256 characters: at the bound
    request = LeaseRequest(
        job_id="j" * 128,
        target="t" * 64,
        key="k" * 256,
        worker=wide,
        versions=Versions(
            jetfleet="0.1.0",
            handler="h" * 200 + "@1",
            code="0.1.0.dev1+local." + "0" * 64 + "+g0123456789ab.dirty",
            config="0" * 12,
            python="3.11.7",
            nats_py="2.16.0",
            # worker.version_fields at its bounds (jetfleet/settings.py).
            declared={f"f{n}" + "x" * 30: "v" * 64 for n in range(8)},
            unpinned=True,
            unpinned_why="editable install, uncommitted changes, local version, dev version",
            id="0" * 12,
        ),
        identity=wide,
        region=wide,
        reply_subject="r" * 1024,
        pin_identity=wide,
    )
    msgspec.json.decode(msgspec.json.encode(request), type=LeaseRequest)  # within bounds
    assert len(msgspec.json.encode(request)) <= 16 * 1024
