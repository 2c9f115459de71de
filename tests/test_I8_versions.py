"""I8 versions (DESIGN.md): a worker whose version tuple is not in the approved set gets no
lease, and its jobs run on approved workers; every result carries its tuple; the rollout
guard withdraws a newly approved tuple that does worse than the incumbent, and leaves one
within tolerance (docs/versions.md). Real servers throughout."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, LeaseRequest, Outcome, Versions
from jetfleet.schemas.versions import (
    VersionAlert,
    VersionApproval,
    VersionsApprove,
    VersionsGuard,
    VersionSighting,
    VersionsList,
    VersionView,
)
from jetfleet.services.leaser.version_commands import ApprovedVersions, approved_key
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli import main as cli_main
from jetfleet.cli.version_commands import send_versions
from jetfleet.errors import ConfigError
from jetfleet.ops.version_view import version_view
from jetfleet.settings import Settings, VersionSettings, load_settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from jetfleet.version_tuple import (
    code_revision,
    config_hash,
    local_tuple,
    tuple_id,
    with_handler,
)
from jetfleet.worker import Worker
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, outcomes, submit_paths
from tests.stack import InProcessStack, running_stack

DEMO = "demo"


def _declaring(settings: Settings, **fields: str) -> Settings:
    worker = msgspec.structs.replace(settings.worker, version_fields=fields)
    return msgspec.structs.replace(settings, worker=worker)


async def _start_worker(stack: InProcessStack, settings: Settings, worker_id: str) -> Worker:
    nc = await stack._connect(worker_id)
    worker = Worker(settings, nc, worker_id)
    await worker.start()
    stack.workers.append(worker)
    return worker


async def _approve(stack: InProcessStack, versions: Versions) -> str:
    reply = await send_versions(
        stack.settings, VersionsApprove(versions=versions, by="test", why="rolled out")
    )
    assert reply.ok, reply.detail
    assert stack.leaser is not None
    tid = tuple_id(versions)

    async def known() -> bool:
        assert stack.leaser is not None
        return approved_key(tid) in stack.leaser.versions.watch.keys

    await wait_for(known, 10.0, f"the leaser's watch to learn of approval {tid}")
    return tid


async def _results(nc: NatsClient, target: str) -> list[CommittedResult]:
    stream = read_stream(nc.jetstream(), subjects.STREAM_RESULTS, subjects.results(target))
    return [msgspec.json.decode(m.data, type=CommittedResult) async for m in stream]


async def _view(settings: Settings) -> VersionView:
    reply = await send_versions(settings, VersionsList())
    assert reply.ok and reply.view is not None, reply.detail
    return reply.view


async def test_I8_an_unapproved_tuple_gets_no_lease_and_its_jobs_run_on_approved_workers(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    stable, canary = _declaring(settings, ring="stable"), _declaring(settings, ring="canary")
    approved = await _approve(services, local_tuple(stable))
    unapproved = local_tuple(canary).id
    assert approved != unapproved
    # The unapproved worker starts first, so it is asked before the approved one is there.
    await _start_worker(services, canary, "w-canary")
    await submit_paths(nc.jetstream(), settings, DEMO, [f"/page/{n}" for n in range(20)], "v")
    assert services.leaser is not None
    refusals = services.leaser.answers

    async def refused() -> bool:
        labels = {"answer": "refused", "reason": "version-not-approved", "target": DEMO}
        return refusals.get(**labels, worker="w-canary") > 0

    await wait_for(refused, 20.0, "the unapproved worker's first refusal")
    await _start_worker(services, stable, "w-stable")

    async def all_committed() -> bool:
        return await committed(nc.jetstream(), DEMO) == 20

    await wait_for(all_committed, 60.0, "every job committed")
    results = await _results(nc, DEMO)
    assert {r.worker for r in results} == {"w-stable"}
    assert {r.versions.id for r in results} == {approved}
    assert {r.versions.declared["ring"] for r in results} == {"stable"}
    assert all(r.versions.handler.startswith("http.get@") for r in results)
    events = await outcomes(nc.jetstream(), DEMO)
    assert {(e.worker, e.versions.id) for e in events} == {("w-stable", approved)}
    granted = refusals.get(answer="granted", reason="", target=DEMO, worker="w-canary")
    assert granted == 0
    # The leaser saw both tuples: an operator sees what runs and what is not approved.
    seen = {s.id: s.approved for s in (await _view(settings)).seen}
    assert seen == {approved: True, unapproved: False}


def _outcome(n: int, versions: Versions, ok: bool) -> Outcome:
    return Outcome(
        job_id=f"g-{versions.code}-{n}",
        target=DEMO,
        worker=f"w-{versions.code}",
        attempt=1,
        kind="ok" if ok else "blocked",
        reason="" if ok else "blocked",
        duration_s=0.1,
        versions=with_handler(versions, "http.get@1"),
    )


async def _publish(nc: NatsClient, versions: Versions, ok: int, failed: int) -> None:
    """Outcome events of one tuple, as its workers would publish them."""
    for n in range(ok + failed):
        event = _outcome(n, versions, ok=n < ok)
        await nc.jetstream().publish(
            subjects.outcome(DEMO, event.job_id), msgspec.json.encode(event)
        )


def _tuple(code: str) -> Versions:
    return Versions(jetfleet="0.1.0", code=code, config="c0ffee", python="3.11.7")


@pytest.fixture
def guard_settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    base = make_settings(nats_url, redis_url, {DEMO: sim_target(simulator)})
    guard = VersionSettings(guard_min_sample=10, guard_fraction=0.8, guard_window_s=600.0)
    return msgspec.structs.replace(base, versions=guard)


async def _read_all(nc: NatsClient, stack: InProcessStack) -> None:
    last = (await nc.jetstream().stream_info(subjects.STREAM_OUTCOMES)).state.last_seq

    async def caught_up() -> bool:
        return all((q.next_seq or 0) > last for q in stack.quarantines)

    await wait_for(caught_up, 30.0, f"the quarantine replicas to read outcome {last}")


async def test_I8_the_rollout_guard_withdraws_a_worse_tuple_and_keeps_one_within_tolerance(
    guard_settings: Settings, nc: NatsClient
) -> None:
    async with running_stack(guard_settings) as stack:
        # Two replicas judge alike: one withdrawal, one alert.
        await stack.add_quarantine()
        await stack.add_quarantine()
        incumbent, worse, close = _tuple("1.0"), _tuple("1.1"), _tuple("1.2")
        for versions in (incumbent, worse, close):
            await _approve(stack, versions)
        await _publish(nc, incumbent, ok=20, failed=0)  # 100%
        await _publish(nc, close, ok=17, failed=3)  # 85%: above 0.8 x 100%
        await _publish(nc, worse, ok=10, failed=10)  # 50%: withdrawn

        async def withdrawn() -> bool:
            return [w.id for w in (await _view(guard_settings)).withdrawn] == [tuple_id(worse)]

        await wait_for(withdrawn, 30.0, "the worse tuple's withdrawal")
        await _read_all(nc, stack)
        view = await _view(guard_settings)
        assert [a.id for a in view.approved] == [tuple_id(incumbent), tuple_id(close)]
        assert view.approved[0].incumbent
        (gone,) = view.withdrawn
        assert gone.by == "rollout-guard"
        assert gone.figures is not None
        assert (gone.figures.sample, gone.figures.success_rate) == (20, 0.5)
        assert (gone.figures.incumbent, gone.figures.incumbent_success_rate) == (
            tuple_id(incumbent),
            1.0,
        )
        assert gone.figures.block_rate == 0.5
        assert "below 0.8 x the incumbent" in gone.why
        alerts = [
            msgspec.json.decode(m.data, type=VersionAlert)
            async for m in read_stream(
                nc.jetstream(), subjects.STREAM_ALERTS, subjects.VERSIONS_ALERT
            )
        ]
        assert [(a.id, a.by) for a in alerts] == [(tuple_id(worse), "rollout-guard")]


async def test_I8_the_rollout_guard_turned_off_withdraws_nothing(
    guard_settings: Settings, nc: NatsClient
) -> None:
    async with running_stack(guard_settings) as stack:
        await stack.add_quarantine()
        reply = await send_versions(guard_settings, VersionsGuard(on=False, by="test"))
        assert reply.ok, reply.detail
        incumbent, worse = _tuple("2.0"), _tuple("2.1")
        for versions in (incumbent, worse):
            await _approve(stack, versions)
        await _publish(nc, incumbent, ok=20, failed=0)
        await _publish(nc, worse, ok=2, failed=18)
        await _read_all(nc, stack)
        view = await version_view(nc.jetstream())
        assert view.guard == "off"
        assert [a.id for a in view.approved] == [tuple_id(incumbent), tuple_id(worse)]
        assert view.withdrawn == []


async def test_approving_an_unseen_id_says_how_to_approve_it(services: InProcessStack) -> None:
    reply = await send_versions(services.settings, VersionsApprove(id="0123456789ab"))
    assert not reply.ok
    assert "--current" in reply.detail


def test_the_tuple_id_is_stable_and_leaves_out_the_handler() -> None:
    a = _tuple("1.0")
    assert tuple_id(a) == tuple_id(_tuple("1.0"))
    assert tuple_id(with_handler(a, "http.get@1")) == tuple_id(with_handler(a, "other@2"))
    assert tuple_id(msgspec.structs.replace(a, id="ffffffffffff")) == tuple_id(a)
    assert tuple_id(a) != tuple_id(_tuple("1.1"))
    assert tuple_id(msgspec.structs.replace(a, declared={"ring": "x"})) != tuple_id(a)
    assert len(tuple_id(a)) == 12


def test_the_config_hash_leaves_out_urls_and_per_process_names(settings: Settings) -> None:
    other = msgspec.structs.replace(
        settings,
        nats=msgspec.structs.replace(settings.nats, url="nats://elsewhere:4222"),
        redis=msgspec.structs.replace(settings.redis, url="redis://:secret@elsewhere/0"),
        worker=msgspec.structs.replace(settings.worker, id="w-9", identity="id-9", region="eu"),
    )
    assert config_hash(other) == config_hash(settings)
    slower = msgspec.structs.replace(
        settings, fleet=msgspec.structs.replace(settings.fleet, retry_base_s=9.0)
    )
    assert config_hash(slower) != config_hash(settings)


def test_a_worker_from_this_source_tree_says_it_is_unpinned(settings: Settings) -> None:
    # The tests run from a git work tree (an editable install): not a pinned build.
    versions = local_tuple(settings)
    assert versions.unpinned
    assert versions.unpinned_why == ", ".join(code_revision().unpinned_why)
    assert versions.code.startswith(versions.jetfleet)
    assert versions.nats_py and versions.python
    assert versions.id == tuple_id(versions)


def test_version_settings_are_validated_with_what_to_fix(tmp_path: object) -> None:
    cases = {
        "[versions]\nguard_fraction = 1.5": "versions.guard_fraction",
        "[versions]\nguard_min_sample = 0": "versions.guard_min_sample",
        "[versions]\nguard_window_s = 0": "versions.guard_window_s",
        '[versions]\ngate = "sometimes"': "versions.gate",
        '[worker.version_fields]\n"Bad Key" = "x"': "worker.version_fields.Bad Key",
        '[worker.version_fields]\nring = ""': "worker.version_fields.ring",
    }
    for n, (text, key) in enumerate(cases.items()):
        path = f"{tmp_path}/c{n}.toml"
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_settings(path, env={})
    fields = load_settings(env={"JETFLEET_WORKER__VERSION_FIELDS": "image=v42, ring=canary"})
    assert fields.worker.version_fields == {"image": "v42", "ring": "canary"}
    assert load_settings(env={}).versions.gate == "when-set"


async def _cli(argv: list[str]) -> int:
    """The CLI, in a thread: it runs its own event loop."""
    return await asyncio.to_thread(cli_main.main, argv)


def _ask(worker: str, versions: Versions) -> LeaseRequest:
    return LeaseRequest(
        job_id="j-1", target=DEMO, key="u-" + "0" * 40, worker=worker, versions=versions
    )


@pytest.mark.parametrize(
    ("gate", "refused_while_none_approved"), [("when-set", False), ("always", True), ("off", False)]
)
async def test_the_gate_modes_refuse_an_unapproved_tuple_as_documented(
    settings: Settings, nc: NatsClient, gate: str, refused_while_none_approved: bool
) -> None:
    gated = msgspec.structs.replace(settings, versions=VersionSettings(gate=gate))  # type: ignore[arg-type]
    control = await nc.jetstream().key_value(subjects.BUCKET_CONTROL)
    spawned: list[asyncio.Task[None]] = []
    book = ApprovedVersions(
        gated, nc.jetstream(), control, lambda c: spawned.append(asyncio.ensure_future(c))
    )
    await book.start()
    try:
        stable, canary = _tuple("3.0"), _tuple("3.1")
        refusal = await book.objection(_ask("w-canary", canary))
        assert (refusal is not None) == refused_while_none_approved
        approval = VersionApproval(versions=stable, by="test")
        await control.put(approved_key(tuple_id(stable)), msgspec.json.encode(approval))

        async def learned() -> bool:
            return approved_key(tuple_id(stable)) in book.watch.keys

        await wait_for(learned, 10.0, "the watch to learn of the approval")
        assert await book.objection(_ask("w-stable", stable)) is None
        refusal = await book.objection(_ask("w-canary", canary))
        if gate == "off":
            assert refusal is None
            return
        assert refusal is not None and refusal.reason == "version-not-approved"
        assert refusal.retry_after_s > 0
        assert f"jetfleet versions approve {tuple_id(canary)}" in refusal.detail
        await asyncio.gather(*spawned)
        # Each tuple is recorded as seen once per replica every few minutes, not per ask.
        assert len(spawned) == 2
        seen = await control.get(f"{subjects.VERSION_SEEN_PREFIX}.{tuple_id(canary)}")
        assert msgspec.json.decode(seen.value or b"", type=VersionSighting).worker == "w-canary"
    finally:
        await book.stop()


async def test_the_cli_approves_this_machines_tuple_and_lists_it(
    services: InProcessStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "jetfleet.toml"
    config.write_text(f'[nats]\nurl = "{services.settings.nats.url}"\n', encoding="utf-8")
    base = ["--config", str(config), "versions"]
    assert await _cli([*base, "approve", "--current", "--why", "release 0.1.0"]) == 0
    local = local_tuple(load_settings(config, env={}))
    assert f"approved: version tuple {local.id}" in capsys.readouterr().out
    assert await _cli([*base, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["local"]["id"] == local.id
    (approved,) = listed["approved"]
    assert (approved["id"], approved["why"], approved["incumbent"]) == (
        local.id,
        "release 0.1.0",
        True,
    )
    assert approved["by"]  # the OS user
    assert await _cli([*base, "revoke", local.id, "--why", "bad build"]) == 0
    assert await _cli([*base, "list"]) == 0
    text = capsys.readouterr().out
    assert f"withdrawn: version tuple {local.id}" in text
    assert "bad build" in text.split("withdrawn:")[-1]


async def test_I8_the_guard_withdraws_a_canary_whose_real_jobs_fail_and_its_work_moves_on(
    nats_url: str, redis_url: str, simulator: TargetSimulator, nc: NatsClient
) -> None:
    """End to end: real workers' outcome events, the guard, the leaser's gate. The canary
    tuple's jobs fail (404: permanent) where the incumbent's succeed; once withdrawn,
    the canary gets no lease."""
    targets = {"good": sim_target(simulator), "bad": sim_target(simulator)}
    base = make_settings(nats_url, redis_url, targets)
    guarded = msgspec.structs.replace(
        base, versions=VersionSettings(guard_min_sample=5, guard_fraction=0.8)
    )
    await declare(nc.jetstream(), guarded)
    async with running_stack(guarded) as stack:
        await stack.add_quarantine()
        stable, canary = _declaring(guarded, ring="stable"), _declaring(guarded, ring="canary")
        await _approve(stack, local_tuple(stable))
        canary_id = await _approve(stack, local_tuple(canary))
        nc_stable, nc_canary = await stack._connect("w-stable"), await stack._connect("w-canary")
        for worker in (
            Worker(stable, nc_stable, "w-stable", ("good",)),
            Worker(canary, nc_canary, "w-canary", ("bad",)),
        ):
            await worker.start()
            stack.workers.append(worker)
        js = nc.jetstream()
        await submit_paths(js, guarded, "good", [f"/page/{n}" for n in range(8)], "g")
        await submit_paths(js, guarded, "bad", [f"/missing/{n}" for n in range(8)], "b")

        async def withdrawn() -> bool:
            return [w.id for w in (await _view(guarded)).withdrawn] == [canary_id]

        await wait_for(withdrawn, 30.0, "the canary's withdrawal by the guard")
        await submit_paths(js, guarded, "bad", ["/page/1"], "after")
        assert stack.leaser is not None
        answers = stack.leaser.answers

        async def refused() -> bool:
            labels = {"answer": "refused", "reason": "version-not-approved", "target": "bad"}
            return answers.get(**labels, worker="w-canary") > 0

        await wait_for(refused, 30.0, "the withdrawn canary's refusal")
        assert await committed(js, "good") == 8


def test_I8_the_config_hash_does_not_care_whether_a_number_was_written_as_int_or_float(
    settings: Settings,
) -> None:
    # A rate of 5 given in code and 5.0 read from TOML is one deployment's config.
    target = settings.targets["demo"]
    as_int = msgspec.structs.replace(
        settings, targets={"demo": msgspec.structs.replace(target, rate=5)}
    )
    as_float = msgspec.structs.replace(
        settings, targets={"demo": msgspec.structs.replace(target, rate=5.0)}
    )
    other = msgspec.structs.replace(
        settings, targets={"demo": msgspec.structs.replace(target, rate=6.0)}
    )
    assert config_hash(as_int) == config_hash(as_float) != config_hash(other)
