"""I5 and owned identities: an identity has exactly one live owner, claimed in KV with a
server-clock TTL; its cookies stay on its worker and never appear in any message; a
failed challenge discards them (docs/identities.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas.events import CommittedResult
from jetfleet.services.leaser import Leaser
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import IdentityOwned
from jetfleet.identity_presence import IdentityClaim, IdentityPresence, owned_key
from jetfleet.results import iter_results
from jetfleet.settings import IdentitySettings, Settings, validate
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from jetfleet.worker import Worker
from jetfleet.worker.identity_cookies import COOKIES_FILE
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[1]


def identity_settings(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    tmp_path: Path,
    claim_ttl_s: float = 30.0,
) -> Settings:
    """One target and one declared identity, ``alice``, with its state in ``tmp_path``."""
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    alice = IdentitySettings(
        state_dir=str(tmp_path / "alice"), egress="eu-1", subnet="10.1.0.0/24", region="eu"
    )
    worker = msgspec.structs.replace(settings.worker, claim_ttl_s=claim_ttl_s, concurrency=4)
    settings = msgspec.structs.replace(settings, identities={"alice": alice}, worker=worker)
    validate(settings)
    return settings


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[InProcessStack]:
    stack = InProcessStack(settings)
    await stack.start(workers=0)
    try:
        yield stack
    finally:
        await stack.stop()


# --- exactly one live owner -----------------------------------------------------------


async def test_I5_a_second_worker_claiming_an_owned_identity_is_refused_naming_the_owner(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)
    async with running(settings) as stack:
        await stack.add_worker("w-first", identity="alice")
        with pytest.raises(IdentityOwned) as refused:
            await stack.add_worker("w-second", identity="alice")
        message = str(refused.value)
        assert "identity 'alice' is owned by worker 'w-first'" in message
        lasts = re.search(r"its claim lasts (\d+) s more unless renewed", message)
        assert lasts is not None, message
        assert 0 < int(lasts.group(1)) <= 30
        holder = await IdentityPresence(stack.connections[0].jetstream()).holder("alice")
        assert holder is not None and holder.worker_id == "w-first"


async def test_I5_after_its_owner_drains_a_worker_claims_the_identity_at_once(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)  # a 30 s TTL
    async with running(settings) as stack:
        first = await stack.add_worker("w-first", identity="alice")
        await first.drain(5.0)
        stack.workers.remove(first)
        # No waiting: the drain released the claim, far inside its 30 s TTL.
        await stack.add_worker("w-next", identity="alice")
        holder = await IdentityPresence(stack.connections[0].jetstream()).holder("alice")
        assert holder is not None and holder.worker_id == "w-next"


def _cli_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        NATS_URL=settings.nats.url,
        REDIS_URL=settings.redis.url,
        JETFLEET_STACK=str(tmp_path / "no-stack"),
    )
    return env


async def _start_leaser(settings: Settings) -> Leaser:
    """A leaser: a worker has no KV rights, its identity claim is written by the leaser."""
    leaser = Leaser(settings, await connect_nats(settings.nats, "leaser"))
    await leaser.start()
    return leaser


async def _cli_worker(
    settings: Settings, tmp_path: Path, worker_id: str
) -> asyncio.subprocess.Process:
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jetfleet",
        "--config",
        str(config),
        "worker",
        "--id",
        worker_id,
        "--identity",
        "alice",
        cwd=REPO,
        env=_cli_env(settings, tmp_path),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def test_I5_jetfleet_worker_exits_non_zero_naming_the_owner_of_its_identity(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)
    nc = await connect_nats(settings.nats, "holder")
    leaser: Leaser | None = None
    try:
        await declare(nc.jetstream(), settings)
        leaser = await _start_leaser(settings)  # the CLI worker's claim is written by it
        presence = IdentityPresence(nc.jetstream())
        claim = await presence.claim("alice", "w-holder", ttl_s=30)
        proc = await _cli_worker(settings, tmp_path, "w-second")
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        text = stderr.decode(errors="replace")
        assert proc.returncode == 2, text[-2000:]
        assert "jetfleet: error: identity 'alice' is owned by worker 'w-holder'" in text
        assert re.search(r"its claim lasts \d+ s more", text), text[-2000:]
        await presence.release(claim)
    finally:
        if leaser is not None:
            await leaser.drain(1.0)
            await leaser.nc.close()
        await nc.close()


async def test_I5_a_killed_owners_claim_lapses_within_its_ttl(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    ttl_s = 2
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path, claim_ttl_s=ttl_s)
    nc = await connect_nats(settings.nats, "successor")
    proc = None
    leaser: Leaser | None = None
    try:
        await declare(nc.jetstream(), settings)
        leaser = await _start_leaser(settings)  # the CLI worker's claim is written by it
        presence = IdentityPresence(nc.jetstream())
        proc = await _cli_worker(settings, tmp_path, "w-doomed")

        async def doomed_owns() -> bool:
            holder = await presence.holder("alice")
            return holder is not None and holder.worker_id == "w-doomed"

        await wait_for(doomed_owns, 30, "the CLI worker to claim alice")
        claimed = await presence.holder("alice")
        assert claimed is not None
        claimed_at = claimed.revision

        async def renewed() -> bool:
            holder = await presence.holder("alice")
            return holder is not None and holder.revision > claimed_at

        await wait_for(renewed, 10, "the owner to renew its claim")
        os.killpg(proc.pid, signal.SIGKILL)  # no drain, no release
        await proc.wait()
        killed_at = time.monotonic()
        with pytest.raises(IdentityOwned, match="owned by worker 'w-doomed'"):
            await presence.claim("alice", "w-successor", ttl_s=30)
        claim = None
        while claim is None:
            try:
                claim = await presence.claim("alice", "w-successor", ttl_s=30)
            except IdentityOwned:
                assert time.monotonic() - killed_at < ttl_s + 3, "the claim did not lapse"
                await asyncio.sleep(0.05)
        lapsed_after = time.monotonic() - killed_at
        print(f"\nclaim of a killed owner lapsed {lapsed_after:.2f} s after the kill")
        # Its last renewal was at most a third of the TTL before the kill; the server's
        # expiry is prompt (about a quarter second late at most here).
        assert lapsed_after <= ttl_s + 1.0
        await presence.release(claim)
    finally:
        if leaser is not None:
            await leaser.drain(1.0)
            await leaser.nc.close()
        if proc is not None and proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await nc.close()


async def test_I5_jetfleet_worker_whose_identity_another_worker_took_drains_and_exits_non_zero(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path, claim_ttl_s=2)
    nc = await connect_nats(settings.nats, "rival")
    proc = None
    leaser: Leaser | None = None
    try:
        await declare(nc.jetstream(), settings)
        leaser = await _start_leaser(settings)  # the CLI worker's claim is written by it
        presence = IdentityPresence(nc.jetstream())
        proc = await _cli_worker(settings, tmp_path, "w-cut-off")

        async def claimed() -> bool:
            holder = await presence.holder("alice")
            return holder is not None and holder.worker_id == "w-cut-off"

        await wait_for(claimed, 30, "the CLI worker to claim alice")
        # Its claim lapsed while it was cut off, say, and a rival claimed the identity.
        kv = await nc.jetstream().key_value(subjects.BUCKET_WORKERS)
        await kv.delete(owned_key("alice"))
        await presence.claim("alice", "w-rival", ttl_s=30)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        text = stderr.decode(errors="replace")
        assert proc.returncode == 2, text[-2000:]
        assert "lost identity alice to worker w-rival" in text
        assert "worker w-cut-off stopped: it no longer owns identity 'alice'" in text
        holder = await presence.holder("alice")
        assert holder is not None and holder.worker_id == "w-rival"
    finally:
        if leaser is not None:
            await leaser.drain(1.0)
            await leaser.nc.close()
        if proc is not None and proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await nc.close()


# --- identity state stays on its worker -----------------------------------------------


class EverySubject:
    """Every message on every subject of the test's own nats-server, headers and all."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def take(self, msg: Msg) -> None:
        headers = "".join(f"{k}: {v}\n" for k, v in (msg.headers or {}).items())
        self.seen.append(b"\n".join([msg.subject.encode(), headers.encode(), msg.data or b""]))

    def containing(self, token: str) -> list[bytes]:
        return [m for m in self.seen if token.encode() in m]


async def _commit_paths(
    nc: NatsClient, settings: Settings, paths: list[str], done_before: int
) -> None:
    js = nc.jetstream()
    await submit_jobs(js, settings, "demo", jobs_for("demo", settings, paths))

    async def all_committed() -> bool:
        return await committed(js, "demo") == done_before + len(paths)

    await wait_for(all_committed, 30, f"{paths} to commit")


async def test_I5_cookies_set_by_the_target_never_appear_in_any_message_or_log_line(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="jetfleet")
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)
    capture = EverySubject()
    async with running(settings) as stack:
        nc = stack.connections[0]
        await nc.subscribe(">", cb=capture.take)
        first = await stack.add_worker("w-first", identity="alice")
        await _commit_paths(nc, settings, ["/session/1"], 0)
        await _commit_paths(nc, settings, ["/session/2", "/session/3"], 1)
        [token] = simulator.sessions_issued()
        presented = dict(simulator.sessions_presented())
        # The identity holds a session: its jar sent the cookie back.
        assert presented == {"/session/1": "", "/session/2": token, "/session/3": token}
        await first.drain(5.0)
        stack.workers.remove(first)
        jar = tmp_path / "alice" / COOKIES_FILE
        assert token in jar.read_text(), "the jar is kept in the identity's state_dir"
        assert jar.stat().st_mode & 0o077 == 0, "only this user may read the jar"
        # Its successor (free to claim at once) resumes the session from the folder.
        await stack.add_worker("w-next", identity="alice")
        await _commit_paths(nc, settings, ["/session/4"], 3)
        assert dict(simulator.sessions_presented())["/session/4"] == token
        await nc.flush()
    assert len(capture.seen) > 100, "the capture saw the run"
    assert any(b"jf.results.demo" in m for m in capture.seen)
    assert capture.containing(token) == []
    assert [r.getMessage() for r in caplog.records if token in r.getMessage()] == []


async def test_I5_a_failed_challenge_discards_the_identitys_cookies_for_that_target(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)
    async with running(settings) as stack:
        nc = stack.connections[0]
        worker = await stack.add_worker("w-alice", identity="alice")
        await _commit_paths(nc, settings, ["/session/1"], 0)
        [token] = simulator.sessions_issued()
        assert len(worker.cookies.jar) == 1
        js = nc.jetstream()
        # Challenged once: its retry, after the back-off, gets the page.
        challenge = jobs_for("demo", settings, ["/challenge/1?times=1"])
        await submit_jobs(js, settings, "demo", challenge)

        async def challenged() -> bool:
            return worker.stats["blocked:challenged"] >= 1

        await wait_for(challenged, 30, "the challenge")
        assert len(worker.cookies.jar) == 0, "the challenged session's cookies were kept"
        jar = tmp_path / "alice" / COOKIES_FILE
        assert token not in jar.read_text(), "the dead session would come back at restart"

        async def requeued_and_done() -> bool:
            return await committed(js, "demo") == 2

        # The job was requeued, not the session: it ran again and committed.
        await wait_for(requeued_and_done, 30, "the challenged job to run again")
        assert (await stack.status()).totals.dead == 0
        # The identity's next request to the target starts a fresh session.
        await _commit_paths(nc, settings, ["/session/2"], 2)
        assert dict(simulator.sessions_presented())["/session/2"] == ""
        assert len(simulator.sessions_issued()) == 2


# --- a challenged job moves on; its session does not --------------------------------


def two_identity_settings(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path, **fleet: object
) -> Settings:
    """``identity_settings`` with a second identity, ``bob``, with its own state folder."""
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path)
    bob = IdentitySettings(state_dir=str(tmp_path / "bob"), region="eu")
    settings = msgspec.structs.replace(
        settings,
        identities={**settings.identities, "bob": bob},
        fleet=msgspec.structs.replace(settings.fleet, **fleet),
    )
    validate(settings)
    return settings


async def result_of(js: JetStreamContext, target: str, job_id: str) -> CommittedResult | None:
    """The committed result of ``job_id``, if any."""
    async for record in iter_results(js, target):
        if record.job_id == job_id:
            return record
    return None


async def _challenged_on_alice(
    stack: InProcessStack, simulator: TargetSimulator, settings: Settings, path: str
) -> tuple[Worker, str, str, IdentityClaim]:
    """Bob is live (claimed) but no worker of his pulls anything, so alice is the one
    offered the job again; alice's worker holds a session on the target, the target
    flags it, and a job on ``path`` meets the challenge there. (Alice's worker, her
    token, the job's id, bob's claim.)"""
    nc = stack.connections[0]
    bob_claim = await IdentityPresence(nc.jetstream()).claim("bob", "w-bob-elsewhere", 30)
    alice = await stack.add_worker("w-alice", identity="alice")
    await _commit_paths(nc, settings, ["/session/1"], 0)
    [token] = simulator.sessions_issued()
    simulator.challenge_session(token)
    [job] = jobs_for("demo", settings, [path])
    await submit_jobs(nc.jetstream(), settings, "demo", [job])

    async def challenged() -> bool:
        return alice.stats["blocked:challenged"] >= 1

    await wait_for(challenged, 30, "the challenge on alice's session")
    return alice, token, job.id, bob_claim


async def refused_avoided(worker: Worker, what: str) -> None:
    """Wait until the leaser refused ``worker`` a job as ``avoided``."""

    async def refused() -> bool:
        return worker.stats["refused:avoided"] >= 1

    await wait_for(refused, 30, what)


async def test_I5_a_job_requeued_after_a_failed_challenge_runs_on_another_identity_with_fresh_session_state(  # noqa: E501
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = two_identity_settings(nats_url, redis_url, simulator, tmp_path)
    async with running(settings) as stack:
        js = stack.connections[0].jetstream()
        alice, token, job_id, bob_claim = await _challenged_on_alice(
            stack, simulator, settings, "/session/2"
        )
        assert token not in {c.value for c in alice.cookies.jar}
        assert token not in (tmp_path / "alice" / COOKIES_FILE).read_text()

        await refused_avoided(alice, "alice to be refused the job she was challenged on")
        await IdentityPresence(js).release(bob_claim)
        bob = await stack.add_worker("w-bob", identity="bob")

        async def done() -> bool:
            return await committed(js, "demo") == 2

        await wait_for(done, 30, "the job to commit on bob")
        result = await result_of(js, "demo", job_id)
        assert result is not None and (result.identity, result.worker) == ("bob", "w-bob")
        # The target saw the job twice: alice's flagged session, then bob's without it.
        tries = [t for p, t in simulator.sessions_presented() if p == "/session/2"]
        assert tries[0] == token and len(tries) == 2 and tries[1] != token, tries
        assert token not in {c.value for c in bob.cookies.jar}
        # Alice sent /session/1 and the challenged try, nothing more.
        assert simulator.counts()["by_client"] == {"w-alice": 2, "w-bob": 1}
        assert (await stack.status()).totals.dead == 0
