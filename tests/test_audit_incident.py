"""A whole incident through the real CLI, with the operator's credentials (issue 11): a
target starts failing under a bad build; the operator pauses it at once, quarantines the
identity, approves the fixed build and revokes the bad one, lowers the target's rate,
releases the quarantine, resumes, replays the dead letter worth replaying and purges the
rest. `jetfleet audit` then lists exactly those actions, in order, with who, what, why
and outcome, and every job is accounted for: committed once, or dead-lettered and purged.

Real NATS and Redis with auth on, the real scheduler, leaser and sink, workers in this
process (tests/stack.py), the target simulator (docs/audit.md, docs/pause.md,
docs/versions.md)."""

from __future__ import annotations

import asyncio
import datetime
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jetfleet.schemas import CommittedResult
from jetfleet.services.leaser.version_commands import approved_key
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.auth.credentials import credentials_file, settings_for_role
from jetfleet.cli.main import main
from jetfleet.dev.settings_file import settings_toml
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings, load_settings
from jetfleet.stream_reader import read_stream
from jetfleet.version_tuple import local_tuple
from jetfleet.worker import Worker
from tests.conftest import wait_for
from tests.queueing.helpers import committed, dead, submit_paths
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

DEMO = "demo"
PAGES = 12
SLOW = 3
MISSING = 3


def _build(settings: Settings, build: str, tmp_path: Path) -> Settings:
    """The settings of a deployment of ``build`` (an operator-declared tuple field), as
    its workers load them from its jetfleet.toml: the config hash in the tuple is of the
    loaded values (``rate = 1000`` loads as 1000.0), so the CLI's ``--current`` on the
    same file names the same tuple."""
    worker = msgspec.structs.replace(settings.worker, version_fields={"build": build})
    path = tmp_path / f"build-{build}.toml"
    path.write_text(settings_toml(msgspec.structs.replace(settings, worker=worker)))
    return load_settings(str(path), {})


def _operator_config(settings: Settings, tmp_path: Path, name: str) -> str:
    """A jetfleet.toml as an operator's machine has it: the operator role's credentials
    file only, not the bundle (so every command must connect as operator)."""
    bundle = Path(settings.nats.credentials)
    nats = msgspec.structs.replace(
        settings.nats, credentials=str(credentials_file(bundle, "operator"))
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(settings_toml(msgspec.structs.replace(settings, nats=nats)))
    return str(path)


class Operator:
    """`jetfleet --config CONFIG ...` in a thread (the CLI runs its own event loop)."""

    def __init__(self, config: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.config = config
        self.capsys = capsys

    async def run(self, *argv: str) -> int:
        return await asyncio.to_thread(main, ["--config", self.config, *argv])

    async def ok(self, *argv: str) -> str:
        """Run a command that must succeed; its stdout."""
        self.capsys.readouterr()
        code = await self.run(*argv)
        out, err = self.capsys.readouterr()
        assert code == 0, (argv, out, err)
        return out

    async def json(self, *argv: str) -> Any:
        return json.loads(await self.ok(*argv, "--json"))


async def _start_worker(
    stack: InProcessStack, settings: Settings, worker_id: str, identity: str
) -> Worker:
    nc = await stack._connect(worker_id, "worker")
    worker = Worker(settings_for_role(settings, "worker"), nc, worker_id, (), identity=identity)
    await worker.start()
    stack.workers.append(worker)
    return worker


async def _known_to_leaser(stack: InProcessStack, tid: str) -> None:
    """The leaser's watch has the approval (else a worker asking at once is refused and
    holds the target off for the refusal's 30 s)."""

    async def known() -> bool:
        assert stack.leaser is not None
        return approved_key(tid) in stack.leaser.versions.watch.keys

    await wait_for(known, 10.0, f"the leaser to learn of approval {tid}")


async def _results(nc: NatsClient) -> list[CommittedResult]:
    stream = read_stream(nc.jetstream(), subjects.STREAM_RESULTS, subjects.results(DEMO))
    return [msgspec.json.decode(m.data, type=CommittedResult) async for m in stream]


async def test_the_audit_lists_every_action_of_a_scripted_incident_in_order_and_loses_no_job(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = nc.jetstream()
    bad, fixed = _build(settings, "2.0", tmp_path), _build(settings, "2.1", tmp_path)
    bad_id, fixed_id = local_tuple(bad).id, local_tuple(fixed).id
    assert bad_id != fixed_id
    deploy = Operator(_operator_config(bad, tmp_path, "deploy-2.0"), capsys)
    ops = Operator(_operator_config(fixed, tmp_path, "ops"), capsys)

    # Before the incident: build 2.0 is rolled out and approved.
    await deploy.ok("versions", "approve", "--current", "--as", "deploy", "--why", "release 2.0")
    await _known_to_leaser(services, bad_id)
    await _start_worker(services, bad, "w-bad", identity="id-bad")
    pages = await submit_paths(
        js, settings, DEMO, [f"/page/{n}" for n in range(PAGES)], "p", handler="http.get"
    )
    # The target starts failing: a page answering 500 twice (its two attempts), pages gone.
    flaky = await submit_paths(
        js, settings, DEMO, ["/error/1?times=2"], "e", handler="http.get", max_attempts=2
    )
    gone = await submit_paths(
        js, settings, DEMO, [f"/missing/{n}" for n in range(MISSING)], "m", handler="http.get"
    )

    async def failing() -> bool:
        return await dead(js, DEMO) == 1 + MISSING and await committed(js, DEMO) == PAGES

    await wait_for(failing, 30, "the pages committed and the failures dead-lettered")
    # Slow answers: leases held when the operator pauses.
    slow = await submit_paths(
        js, settings, DEMO, [f"/slow/{n}?delay=3" for n in range(SLOW)], "s", handler="http.get"
    )
    store = await LeaseStore.open(js)

    async def slow_jobs_held() -> bool:
        held = {live.record.job_id for live in await store.all_live()}
        # A lease outlives its commit (left to expire): held and not committed yet.
        return held >= {j.id for j in slow} and await committed(js, DEMO) == PAGES

    await wait_for(slow_jobs_held, 10, "the slow jobs' leases held")
    incident = datetime.datetime.now(datetime.UTC)
    ana, bo = ("--as", "ana"), ("--as", "bo")

    # The incident, as the operators ran it.
    paused = await ops.json("pause", "--target", DEMO, "--now", *ana, "--why", "demo failing")
    assert sorted(paused["revoked"]) == sorted(j.id for j in slow), paused
    quarantine = ("--identity", "id-bad", "--target", DEMO)
    await ops.ok("quarantine", "set", *quarantine, *ana, "--why", "blocked on demo")
    approved = await ops.json("versions", "approve", "--current", *bo, "--why", "fix in 2.1")
    assert approved["ok"] and fixed_id in approved["detail"], approved
    await ops.ok("versions", "revoke", bad_id, *bo, "--why", "2.0 breaks demo")
    await ops.ok("target", "set", DEMO, "--rate", "10/s", *bo, "--why", "go gently")
    await ops.ok("quarantine", "release", *quarantine, *ana, "--why", "fixed build out")
    await _known_to_leaser(services, fixed_id)
    await _start_worker(services, fixed, "w-fixed", identity="id-fixed")
    await ops.ok("resume", "--target", DEMO, *ana, "--why", "2.1 deployed")

    async def revoked_jobs_committed() -> bool:
        return await committed(js, DEMO) == PAGES + SLOW

    await wait_for(revoked_jobs_committed, 60, "the revoked slow jobs committed after resume")
    letters = await ops.json("dlq", "list", "--target", DEMO)
    [letter] = [entry["id"] for entry in letters if entry["job"] == flaky[0].id]
    await ops.ok("dlq", "replay", str(letter), *bo, "--why", "500s were transient")

    async def replay_committed() -> bool:
        return await committed(js, DEMO) == PAGES + SLOW + 1

    await wait_for(replay_committed, 60, "the replayed job committed")
    await ops.ok("dlq", "purge", "--target", DEMO, "--yes", *ana, "--why", "pages are gone")

    # The audit: the rollout's approval, then exactly the incident's nine actions in order.
    entries = await ops.json("audit")
    assert [(e["action"], e["who"], e["what"], e["why"], e["outcome"]) for e in entries] == [
        ("versions.approve", "deploy", f"version tuple {bad_id}", "release 2.0", "done"),
        ("pause", "ana", f"target {DEMO} until resumed, now", "demo failing", "done"),
        (
            "quarantine.set",
            "ana",
            f"identity id-bad on {DEMO} until released",
            "blocked on demo",
            "done",
        ),
        ("versions.approve", "bo", f"version tuple {fixed_id}", "fix in 2.1", "done"),
        ("versions.revoke", "bo", f"version tuple {bad_id}", "2.0 breaks demo", "done"),
        ("target.set", "bo", f"target {DEMO}: rate 10/s", "go gently", "done"),
        ("quarantine.release", "ana", f"identity id-bad on {DEMO}", "fixed build out", "done"),
        ("resume", "ana", f"target {DEMO}", "2.1 deployed", "done"),
        ("dlq.replay", "bo", f"dead letter {letter}", "500s were transient", "done"),
        ("dlq.purge", "ana", f"dead letters of {DEMO}", "pages are gone", "done"),
    ], json.dumps(entries, indent=1)
    by_action = {e["action"]: e for e in entries}
    assert f"revoked {SLOW} lease(s)" in by_action["pause"]["detail"]
    assert f"{flaky[0].id}.r{letter}" in by_action["dlq.replay"]["detail"]
    assert by_action["dlq.purge"]["detail"] == f"removed {1 + MISSING} letter(s)"
    times = [datetime.datetime.fromisoformat(e["at"]) for e in entries]
    assert times == sorted(times)
    # --since the incident began (one loopback host: its clock is the server's).
    since = await ops.json("audit", "--since", incident.isoformat())
    assert since == entries[1:]
    assert await ops.json("audit", "--since", "1h") == entries

    # Nothing lost: every page committed exactly once, the revoked jobs and the replay by
    # the fixed build only, the dead letters purged, and the fleet's counts add up.
    results = await _results(nc)
    by_job = {r.job_id: r for r in results}
    assert len(results) == len(by_job) == PAGES + SLOW + 1
    assert set(by_job) == {j.id for j in pages + slow} | {f"{flaky[0].id}.r{letter}"}
    after_resume = [by_job[j.id] for j in slow] + [by_job[f"{flaky[0].id}.r{letter}"]]
    assert {(r.worker, r.versions.id) for r in after_resume} == {("w-fixed", fixed_id)}
    assert {j.id for j in gone}.isdisjoint(by_job)
    assert await ops.json("dlq", "list", "--target", DEMO) == []
    status = await ops.json("status")
    counts = status["targets"][DEMO]
    assert status["conserved"], status
    assert (counts["queued"], counts["leased"]) == (0, 0), counts
    assert counts["committed"] == PAGES + SLOW + 1, counts
