"""I7 (pause is restricted) and I11 (every lever has an owner), for a worker's
credentials: the server refuses every lever a worker must not pull, and nothing changes.

Refusals reach nats-py only through ``error_cb`` (connection.py logs them), and a refused
JetStream call times out; so each test asserts both the logged refusal and that the
state the lever guards is as it was.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.auth.roles import PAUSE, VERSIONS
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.settings import Settings
from tests.conftest import bucket_keys, bundle_credentials, wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.expects_refusals

# A refused JetStream call gets no answer: keep its wait short.
JS_TIMEOUT_S = 1.0


@pytest.fixture(autouse=True)
def _auth_is_on(settings: Settings) -> None:
    if not bundle_credentials(settings.nats.url):
        pytest.skip("runs only on the tests' own servers, with auth on (NATS_URL is set)")


@pytest.fixture
async def worker_nc(settings: Settings) -> AsyncIterator[NatsClient]:
    nc = await connect_nats(settings.nats, "w-rogue", role="worker")
    yield nc
    await nc.close()


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("NATS refused")]


async def _refused(caplog: pytest.LogCaptureFixture, subject: str) -> None:
    """Wait until the server's refusal of ``subject`` reached the connection's log."""

    async def seen() -> bool:
        return any(repr(subject.lower()) in line for line in _refusals(caplog))

    await wait_for(seen, 5, f"the server to refuse {subject}")


async def _work_messages(js: JetStreamContext) -> int:
    return (await js.stream_info(subjects.STREAM_WORK)).state.messages


@pytest.fixture
def caplog_errors(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.ERROR, logger="jetfleet.connection")
    return caplog


async def test_I7_a_worker_cannot_pull_the_pause_or_approve_a_version(
    worker_nc: NatsClient,
    nc: NatsClient,
    services: InProcessStack,
    caplog_errors: pytest.LogCaptureFixture,
) -> None:
    for subject in (PAUSE, VERSIONS, subjects.QUARANTINE, subjects.BREAKER):
        await worker_nc.publish(subject, b'{"scope": "fleet"}')
        await worker_nc.flush()
        await _refused(caplog_errors, subject)
    # Nothing reached the control bucket: no pause or approval was recorded.
    keys = await bucket_keys(nc, subjects.BUCKET_CONTROL)
    assert not [k for k in keys if k.startswith(("pause", "version"))], keys


async def test_I7_a_worker_cannot_purge_or_delete_the_work_stream(
    worker_nc: NatsClient,
    nc: NatsClient,
    settings: Settings,
    services: InProcessStack,
    caplog_errors: pytest.LogCaptureFixture,
) -> None:
    js = nc.jetstream()
    await submit_jobs(js, settings, "demo", jobs_for("demo", settings, ["/page/1", "/page/2"]))

    async def queued() -> bool:
        return await _work_messages(js) == 2

    await wait_for(queued, 10, "two jobs in the work stream")
    rogue = worker_nc.jetstream(timeout=JS_TIMEOUT_S)
    with pytest.raises(nats.errors.TimeoutError):
        await rogue.purge_stream(subjects.STREAM_WORK)
    await _refused(caplog_errors, f"$JS.API.STREAM.PURGE.{subjects.STREAM_WORK}")
    with pytest.raises(nats.errors.TimeoutError):
        await rogue.delete_stream(subjects.STREAM_WORK)
    await _refused(caplog_errors, f"$JS.API.STREAM.DELETE.{subjects.STREAM_WORK}")
    with pytest.raises(nats.errors.TimeoutError):
        await rogue.delete_consumer(subjects.STREAM_WORK, subjects.work_consumer("demo"))
    assert await _work_messages(js) == 2


async def test_I7_a_worker_cannot_write_leases_fences_or_the_control_bucket(
    worker_nc: NatsClient,
    nc: NatsClient,
    services: InProcessStack,
    caplog_errors: pytest.LogCaptureFixture,
) -> None:
    rogue = worker_nc.jetstream(timeout=JS_TIMEOUT_S)
    for bucket, key in (
        (subjects.BUCKET_CONTROL, "pause.fleet"),
        (subjects.BUCKET_LEASES, "some-job"),
        (subjects.BUCKET_FENCES, "some-job"),
    ):
        subject = f"$KV.{bucket}.{key}"
        with pytest.raises(nats.errors.TimeoutError):
            await rogue.publish(subject, b"forged")
        await _refused(caplog_errors, subject)
        kv = await nc.jetstream().key_value(bucket)
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)


async def test_I11_a_worker_cannot_publish_results_or_dead_letters(
    worker_nc: NatsClient,
    nc: NatsClient,
    services: InProcessStack,
    caplog_errors: pytest.LogCaptureFixture,
) -> None:
    rogue = worker_nc.jetstream(timeout=JS_TIMEOUT_S)
    for subject in (
        subjects.result_key("demo", "u-forged"),
        subjects.dead_letter("demo", "some-job"),
        subjects.work("demo", "normal"),
    ):
        with pytest.raises(nats.errors.TimeoutError):
            await rogue.publish(subject, b"{}")
        await _refused(caplog_errors, subject)
    info = await nc.jetstream().stream_info(subjects.STREAM_RESULTS)
    assert info.state.messages == 0


async def test_I11_a_worker_cannot_read_other_roles_replies(
    worker_nc: NatsClient, caplog_errors: pytest.LogCaptureFixture
) -> None:
    # Services' replies go to their own inbox families; a worker may subscribe only to
    # its own (_INBOX_worker.>), so it cannot snoop grants or fences meant for others.
    for subject in ("_INBOX.>", "_INBOX_leaser.>", "_INBOX_sink.>", subjects.LEASE):
        await worker_nc.subscribe(subject)
        await worker_nc.flush()
        await _refused(caplog_errors, subject)


async def test_I11_a_worker_still_runs_jobs_under_its_own_role(
    nc: NatsClient, settings: Settings, stack: InProcessStack
) -> None:
    # The stack's worker connects as `worker`: everything it needs is allowed (the
    # suite-wide guard in conftest.py would fail this test on any refusal).
    js = nc.jetstream()
    await submit_jobs(js, settings, "demo", jobs_for("demo", settings, ["/page/3"]))

    async def committed() -> bool:
        return (await stack.status()).totals.committed == 1

    await wait_for(committed, 30, "the job to commit")
