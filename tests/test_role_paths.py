"""Production paths run under each service's own role (the session's auth bundle): a
subject a role lacks is refused by the server, which the suite's refusal guard turns into
a failure (tests/conftest.py). Each test drives one path the role table once missed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgspec
import nats.errors
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from jetfleet.schemas import Duplicate, Job, WorkOrder
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import APIError

from jetfleet import inflight_caps, subjects
from jetfleet.auth.bundle import ensure_bundle, nats_authorization
from jetfleet.auth.credentials import credentials_file, settings_for_role
from jetfleet.auth.roles import STREAM_AUDIT, Role
from jetfleet.cli.main import main
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.results import stored_bytes
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream
from jetfleet.worker.result_objects import ResultObjects
from tests.conftest import wait_for
from tests.queueing.helpers import committed, submit_paths
from tests.stack import InProcessStack


async def test_the_leaser_records_an_already_done_duplicate_under_its_own_role(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    js = nc.jetstream()
    await submit_paths(js, settings, "demo", ["/page/1"], "first")

    async def one_commit() -> bool:
        return await committed(js, "demo") == 1

    await wait_for(one_commit, 20, "the first job to commit")
    # The same unit of work as another job: the leaser finds the key committed and must
    # store the duplicate record (jf.duplicates.<target>) before it answers already-done.
    await submit_paths(js, settings, "demo", ["/page/1"], "again")

    async def recorded() -> list[Duplicate]:
        return [
            msgspec.json.decode(m.data, type=Duplicate)
            async for m in read_stream(js, subjects.STREAM_DUPLICATES, subjects.duplicates("demo"))
        ]

    async def landed() -> bool:
        return [d.job_id for d in await recorded()] == ["again-0"]

    await wait_for(landed, 20, "the second job's duplicate record")
    [dup] = await recorded()
    assert (dup.committed_by, dup.via) == ("first-0", "already-done")


def _operator_config(settings: Settings, tmp_path: Path, role: Role = "operator") -> str:
    """A jetfleet.toml naming only ``role``'s own credentials file, as a production
    machine has it (not the whole bundle folder, which lets a process pick any role's
    file)."""
    bundle = Path(settings.nats.credentials)
    parts = urlsplit(settings.nats.url)
    nats = msgspec.structs.replace(
        settings.nats,
        url=urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port}")),
        credentials=str(credentials_file(bundle, role)),
    )
    path = tmp_path / f"{role}.toml"
    path.write_text(settings_toml(msgspec.structs.replace(settings, nats=nats)))
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ("pause", "--target", "demo", "--as", "ana", "--why", "test"),
        ("pause", "--list"),
        ("resume", "--target", "demo", "--as", "ana", "--why", "test"),
        ("versions", "list"),
        ("versions", "guard", "off", "--as", "ana", "--why", "test"),
        ("audit",),
        ("runbook", "--json"),
    ],
    ids=" ".join,
)
async def test_an_operator_with_only_its_own_file_runs_the_control_commands(
    argv: tuple[str, ...],
    settings: Settings,
    services: InProcessStack,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _operator_config(settings, tmp_path)
    assert await asyncio.to_thread(main, ["--config", config, *argv]) == 0
    assert not [r for r in caplog.records if "not reachable" in r.getMessage()], (
        "the runbook fell back to the settings alone"
    )


def test_a_kept_dev_bundle_gets_the_current_role_table(tmp_path: Path) -> None:
    first = ensure_bundle(tmp_path)
    # A folder an older jetfleet made: same secrets, that version's permissions.
    first.nats_include.write_text("authorization { users: [] }\n")
    again = ensure_bundle(tmp_path)
    assert again.credentials == first.credentials, "the secrets are kept"
    assert again.nats_include.read_text() == nats_authorization(first.credentials)
    assert again.nats_include.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("action", ["show", "apply"])
async def test_topology_runs_on_the_admin_file_alone(
    action: str, settings: Settings, nc: NatsClient, tmp_path: Path
) -> None:
    config = _operator_config(settings, tmp_path, "admin")
    assert await asyncio.to_thread(main, ["--config", config, "topology", action]) == 0


async def test_the_sink_keeps_a_malformed_order_a_worker_reports_under_their_roles(
    nc: NatsClient, stack: InProcessStack
) -> None:
    js = nc.jetstream()
    garbage = b'{"job": "not a work order"'
    await js.publish(subjects.work("demo", "normal"), garbage)

    async def kept() -> bool:
        info = await js.stream_info(subjects.STREAM_REJECTED)
        return info.state.messages == 1

    await wait_for(kept, 20, "the malformed order kept on jf.rejected")

    async def gone() -> bool:
        info = await js.stream_info(subjects.STREAM_WORK)
        return info.state.messages == 0

    await wait_for(gone, 20, "the malformed order to be terminated")


async def _as_role(settings: Settings, role: Role) -> NatsClient:
    return await connect_nats(settings.nats, f"rollup-{role}", role=role)


async def _rollup_is_refused(js: JetStreamContext, subject: str) -> None:
    """The stream behind ``subject`` refuses a rollup outright (so the silent publish
    below, which gets no answer, was refused too, not merely slow)."""
    with pytest.raises(APIError, match="rollup not permitted"):
        await js.publish(subject, b"x", headers={"Nats-Rollup": "all"})


async def test_a_workers_credentials_cannot_wipe_the_result_object_store(
    settings: Settings, nc: NatsClient
) -> None:
    # nats-server checks subjects, not headers: a worker may publish on the object
    # store's chunk subjects, so only a stream that refuses rollups keeps a
    # 'Nats-Rollup: all' there from purging every committed result's large body.
    js = nc.jetstream()
    writer = ResultObjects(js, max_inline_bytes=1024, max_payload=1 << 20, max_job_bytes=1024)
    job = Job(id="victim", url="http://example.test/")
    order = WorkOrder(job=job, target="demo", key="victim", max_attempts=3, timeout_s=5.0)
    ref = await writer.put(order, "body", b"y" * 300_000)
    chunk = f"$O.{subjects.OBJECTS_RESULTS}.C.not-a-real-object"
    await _rollup_is_refused(js, chunk)
    worker = await _as_role(settings, "worker")
    try:
        await worker.publish(chunk, b"x", headers={"Nats-Rollup": "all"})
        await worker.flush()
    finally:
        await worker.close()
    assert await stored_bytes(js, ref) == b"y" * 300_000


async def test_an_operators_purge_count_write_cannot_empty_the_control_bucket(
    settings: Settings, nc: NatsClient
) -> None:
    # The operator may write $KV.jf-control.purged.dlq.> (dead-letter purge counts); a
    # 'Nats-Rollup: all' there would empty the whole control bucket (quarantines,
    # pauses, approvals, breakers), which its role says it cannot write.
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    await control.put("quarantine.victim", b"kept")
    key = f"$KV.{subjects.BUCKET_CONTROL}.purged.dlq.demo"
    await _rollup_is_refused(js, key)
    operator = await _as_role(settings, "operator")
    try:
        await operator.publish(key, b"1", headers={"Nats-Rollup": "all"})
        await operator.flush()
    finally:
        await operator.close()
    assert (await control.get("quarantine.victim")).value == b"kept"


async def test_a_services_redis_user_touches_only_jetfleets_keys(settings: Settings) -> None:
    gateway = aioredis.from_url(settings_for_role(settings, "gateway").redis.url)
    try:
        assert await gateway.zcard(f"{inflight_caps.KEY_PREFIX}demo") >= 0
        with pytest.raises(redis.exceptions.NoPermissionError):
            await gateway.set("another-apps-key", "overwritten")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await gateway.publish("another-apps-channel", "x")
    finally:
        await gateway.aclose()


@pytest.mark.expects_refusals
@pytest.mark.parametrize("role", ["operator", "gateway"])
@pytest.mark.parametrize(
    ("stream", "durable"),
    [
        (subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER),
        (subjects.STREAM_ADVISORIES, subjects.CONSUMER_MAX_DELIVERIES),
    ],
)
async def test_a_reader_cannot_change_a_services_durable_consumer(
    role: Role, stream: str, durable: str, settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    config = (await js.consumer_info(stream, durable)).config.as_dict()
    config["description"] = "changed by a reader"
    reader = await _as_role(settings, role)
    try:
        # The name-in-subject create form without a filter token: `...<durable>.>` in the
        # deny list does not match it (`>` needs one more token).
        body = json.dumps({"stream_name": stream, "config": config}).encode()
        with pytest.raises(nats.errors.TimeoutError):
            await reader.request(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", body, timeout=1)
    finally:
        await reader.close()
    assert (await js.consumer_info(stream, durable)).config.description != "changed by a reader"


@pytest.mark.expects_refusals
@pytest.mark.parametrize("role", ["gateway", "scheduler", "sink", "quarantine", "worker"])
async def test_only_the_leaser_and_the_operator_write_the_audit_log(
    role: Role, settings: Settings, nc: NatsClient
) -> None:
    forger = await _as_role(settings, role)
    try:
        # A stored publish is acknowledged; a refused one gets no answer.
        with pytest.raises(nats.errors.TimeoutError):
            await forger.jetstream().publish(
                f"{subjects.PREFIX}.audit.pause", b'{"who": "forged"}', timeout=1
            )
    finally:
        await forger.close()
    info = await nc.jetstream().stream_info(STREAM_AUDIT)
    assert info.state.messages == 0


async def test_a_worker_with_an_identity_claims_it_through_the_leaser_under_their_roles(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    # start() returns once the leaser has written the identity claim (jf.presence).
    await services.add_worker("w-id", identity="id-1")
    js = nc.jetstream()
    await submit_paths(js, settings, "demo", ["/page/3"], "idjob")

    async def one_commit() -> bool:
        return await committed(js, "demo") == 1

    await wait_for(one_commit, 20, "the identity worker's job to commit")
