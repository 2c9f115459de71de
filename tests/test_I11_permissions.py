"""I11: every lever has an owner. Only the sink may write a result; each role's
credentials work for that role and no other; ``jetfleet auth init`` writes files the
servers accept; Redis users are per role too."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import nats.errors
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import PubAck, StreamConfig

from jetfleet import publish, subjects
from jetfleet.auth.bundle import init_bundle
from jetfleet.auth.credentials import credentials_file, settings_for_role
from jetfleet.auth.roles import ROLE_NAMES, Role
from jetfleet.canonical import idempotency_key
from jetfleet.cli.main import main
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, find_nats_server
from jetfleet.errors import ConfigError, JetfleetError
from jetfleet.js_publish import publish_js
from jetfleet.results import iter_results
from jetfleet.settings import NatsSettings, Settings
from tests.conftest import bundle_credentials, wait_for
from tests.stack import InProcessStack


@pytest.fixture(autouse=True)
def _auth_is_on(request: pytest.FixtureRequest) -> None:
    if "settings" in request.fixturenames:
        settings: Settings = request.getfixturevalue("settings")
        if not bundle_credentials(settings.nats.url):
            pytest.skip("runs only on the tests' own servers, with auth on (NATS_URL is set)")


def _plain(url: str) -> str:
    """``url`` without the admin user the tests' URLs carry."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port}"))


def _as_file(settings: Settings, role: Role) -> NatsSettings:
    """NATS settings naming ``role``'s own file, as a production process has."""
    bundle = Path(settings.nats.credentials)
    return NatsSettings(
        url=_plain(settings.nats.url), credentials=str(credentials_file(bundle, role))
    )


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("NATS refused")]


@pytest.mark.expects_refusals
async def test_I11_a_result_forged_by_anyone_but_the_sink_is_refused_and_the_job_still_runs(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="jetfleet.connection")
    [job] = jobs_for("demo", settings, ["/page/7"], idempotency_key="order-7")
    forged = subjects.result_key("demo", idempotency_key("http", job.url, explicit="order-7"))
    await submit_jobs(nc.jetstream(), settings, "demo", [job])
    # The leaser may write results too, only to re-land a seal the sink wrote
    # (roles.LEASER_RELANDS_SEALS, docs/security.md): every other role is refused.
    forgers = [r for r in ROLE_NAMES if r not in ("sink", "leaser", "admin")]
    for role in forgers:
        rogue = await connect_nats(_as_file(settings, role), f"forger-{role}", role=role)
        try:
            # A forged record under the job's key would suppress the real commit.
            await rogue.publish(forged, b'{"job_id": "forged"}')
            await rogue.flush()

            async def refused(role: Role = role) -> bool:
                return any(f"role {role} " in line for line in _refusals(caplog))

            await wait_for(refused, 5, f"the server to refuse {role}'s forged result")
        finally:
            await rogue.close()
    await services.add_worker("w-0")

    async def committed() -> bool:
        return (await services.status()).totals.committed == 1

    await wait_for(committed, 30, "the real job to commit")
    [record] = [r async for r in iter_results(nc.jetstream(), "demo")]
    assert (record.job_id, record.worker) == (job.id, "w-0")


async def test_I11_each_roles_own_file_works_for_that_role(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    reads = {
        "admin": subjects.STREAM_WORK,
        "operator": subjects.STREAM_DLQ,
        "client": subjects.STREAM_RESULTS,
        "scheduler": subjects.STREAM_SUBMIT,
        "leaser": "KV_" + subjects.BUCKET_LEASES,
        "ratelimit": "KV_" + subjects.BUCKET_TARGETS,
        "quarantine": subjects.STREAM_OUTCOMES,
        "sink": "KV_" + subjects.BUCKET_FENCES,
        "gateway": subjects.STREAM_RESULTS,
        "worker": subjects.STREAM_WORK,
    }
    for role in ROLE_NAMES:
        conn = await connect_nats(_as_file(settings, role), f"check-{role}", role=role)
        try:
            info = await conn.jetstream(timeout=2.0).stream_info(reads[role])
            assert info.config.name == reads[role]
        finally:
            await conn.close()


async def test_a_clients_submission_whose_first_answer_was_lost_is_published_not_a_duplicate(
    settings: Settings, services: InProcessStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the ``client`` role's own file: the retry of a publish whose answer was lost
    is answered duplicate by the stream, and the client reads back the stored
    submission to tell its own try from another's (it could not, and said duplicate)."""
    lose_next = [True]

    async def answer_lost(*args: Any, **kwargs: Any) -> PubAck:
        ack = await publish_js(*args, **kwargs)  # stored by the real server ...
        if lose_next[0]:
            lose_next[0] = False
            raise NatsTimeoutError  # ... and its answer lost on the way back
        return ack

    conn = await connect_nats(_as_file(settings, "client"), "retrying-client", role="client")
    try:
        monkeypatch.setattr(publish, "publish_js", answer_lost)
        js = conn.jetstream()
        [job] = jobs_for("demo", settings, ["/page/lost-answer"])
        [first] = await submit_jobs(js, settings, "demo", [job])
        assert not lose_next[0]  # its first answer was lost
        assert (first.published, first.duplicate) == (True, False)
        # Other work under the same id is still a duplicate.
        lose_next[0] = True
        other = msgspec.structs.replace(jobs_for("demo", settings, ["/b"])[0], id=job.id)
        [clash] = await submit_jobs(js, settings, "demo", [other])
        assert not lose_next[0]
        assert (clash.published, clash.duplicate) == (False, True)
    finally:
        await conn.close()


async def test_I11_a_role_refuses_another_roles_file(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="holds the 'worker' role's credentials"):
        await connect_nats(_as_file(settings, "worker"), "wrong", role="sink")


async def test_I11_redis_users_are_per_role(settings: Settings, redis_url: str) -> None:
    limiter = aioredis.from_url(settings_for_role(settings, "ratelimit").redis.url)
    try:
        assert await limiter.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            await limiter.flushall()
    finally:
        await limiter.aclose()
    # A worker has no Redis user: the URL it gets carries none, and Redis refuses it.
    worker = aioredis.from_url(settings_for_role(settings, "worker").redis.url)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await worker.ping()
    finally:
        await worker.aclose()


def test_auth_init_writes_files_nats_server_accepts_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags, folder in (([], "plain"), (["--nkeys"], "nkeys")):
        bundle = tmp_path / folder
        assert main(["auth", "init", "--dir", str(bundle), *flags]) == 0
        conf = tmp_path / f"{folder}.conf"
        conf.write_text(
            f'listen: "127.0.0.1:-1"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
            f'include "{folder}/nats-auth.conf"\n'
        )
        check = subprocess.run(
            [str(find_nats_server()), "-t", "-c", str(conf)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stderr
        for role in ROLE_NAMES:
            assert credentials_file(bundle, role).stat().st_mode & 0o077 == 0
        assert "user default off" in (bundle / "redis-users.acl").read_text()
    capsys.readouterr()
    assert main(["auth", "init", "--dir", str(tmp_path / "plain")]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["auth", "init", "--dir", str(tmp_path / "plain"), "--force"]) == 0


@pytest.mark.expects_refusals
async def test_I11_nkey_users_get_their_roles_permissions(tmp_path: Path) -> None:
    bundle = init_bundle(tmp_path / "auth", use_nkeys=True)
    server = EmbeddedNats(tmp_path / "nats", auth_include=bundle.nats_include).start()
    try:
        folder = str(bundle.directory)
        admin = await connect_nats(NatsSettings(url=server.url, credentials=folder), "a")
        worker = await connect_nats(
            NatsSettings(url=server.url, credentials=folder), "w", role="worker"
        )
        try:
            await admin.jetstream().add_stream(
                StreamConfig(name=subjects.STREAM_WORK, subjects=["jf.work.>"])
            )
            rogue = worker.jetstream(timeout=1.0)
            assert (await rogue.stream_info(subjects.STREAM_WORK)).config.name
            with pytest.raises(nats.errors.TimeoutError):
                await rogue.purge_stream(subjects.STREAM_WORK)
        finally:
            await worker.close()
            await admin.close()
        with pytest.raises(JetfleetError, match="refused the 'worker' credentials"):
            other = init_bundle(tmp_path / "other", use_nkeys=True)
            await connect_nats(
                NatsSettings(url=server.url, credentials=str(other.directory)),
                "stranger",
                role="worker",
            )
    finally:
        server.stop()


def test_a_roles_redis_url_carries_its_own_user_and_messages_show_none() -> None:
    from jetfleet.auth.credentials import RoleCredentials, redis_url_for, without_secrets

    limiter = RoleCredentials(role="ratelimit", redis_user="ratelimit", redis_password="p/w")
    worker = RoleCredentials(role="worker", nats_user="worker", nats_password="x")
    given = "redis://admin:secret@127.0.0.1:6379/15"
    assert redis_url_for(given, limiter) == "redis://ratelimit:p%2Fw@127.0.0.1:6379/15"
    assert redis_url_for(given, worker) == "redis://127.0.0.1:6379/15"
    assert redis_url_for(given, None) == given  # no credentials configured: as given
    cluster = "redis+cluster://x:y@r1:7000,r2:7001"
    assert redis_url_for(cluster, limiter) == "redis+cluster://ratelimit:p%2Fw@r1:7000,r2:7001"
    assert without_secrets(given) == "redis://127.0.0.1:6379/15"
