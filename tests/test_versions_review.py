"""Adversarial review of the version gate (issue #11): the ``when-set`` gate stays shut
once a tuple was approved, whatever is revoked later, and approving a tuple that is
already approved does not make it newer than the tuples approved after it (the rollout
guard's incumbent is the earliest approval). Real NATS throughout."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from jetfleet.schemas import LeaseRequest, Versions
from jetfleet.schemas.versions import VersionsApprove, VersionsRevoke
from jetfleet.services.leaser.version_commands import (
    ApprovedVersions,
    VersionCommands,
    approved_key,
)
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.settings import Settings, VersionSettings
from jetfleet.simulator import TargetSimulator
from jetfleet.version_records import approved_tuples
from jetfleet.version_tuple import install_flags, tuple_id
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import running_stack
from tests.test_I8_versions import _approve, _publish, _read_all, _view
from tests.test_I8_versions import _tuple as _i8_tuple


@pytest.fixture
def guard_settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    base = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    guard = VersionSettings(guard_min_sample=10, guard_fraction=0.8, guard_window_s=600.0)
    return msgspec.structs.replace(base, versions=guard)


DEMO = "demo"


def _tuple(code: str) -> Versions:
    return Versions(jetfleet="0.1.0", code=code, config="c0ffee", python="3.11.7")


def _ask(versions: Versions) -> LeaseRequest:
    return LeaseRequest(
        job_id="j-1", target=DEMO, key="u-" + "0" * 40, worker="w-1", versions=versions
    )


async def test_revoking_the_last_approved_tuple_does_not_open_the_when_set_gate(
    settings: Settings, nc: NatsClient
) -> None:
    gated = msgspec.structs.replace(settings, versions=VersionSettings(gate="when-set"))
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    spawned: list[asyncio.Task[None]] = []
    book = ApprovedVersions(gated, js, control, lambda c: spawned.append(asyncio.ensure_future(c)))
    commands = VersionCommands(gated, js, control)
    await book.start()
    try:
        bad, other = _tuple("9.0"), _tuple("9.1")
        reply = await commands.command(VersionsApprove(versions=bad, by="test"))
        assert reply.ok, reply.detail

        async def learned() -> bool:
            return approved_key(tuple_id(bad)) in book.watch.keys

        await wait_for(learned, 10.0, "the watch to learn of the approval")
        assert await book.objection(_ask(other)) is not None
        reply = await commands.command(VersionsRevoke(id=tuple_id(bad), by="test", why="bad"))
        assert reply.ok and "withdrawn" in reply.detail, reply.detail

        async def forgot() -> bool:
            return approved_key(tuple_id(bad)) not in book.watch.keys

        await wait_for(forgot, 10.0, "the watch to learn of the revoke")
        # The operator withdrew the fleet's only approved build because it is bad: its
        # workers (and any other unapproved tuple) must not get leases again.
        refusal = await book.objection(_ask(bad))
        assert refusal is not None and refusal.reason == "version-not-approved"
        assert await book.objection(_ask(other)) is not None
        # Approved again after its withdrawal, it runs again.
        reply = await commands.command(VersionsApprove(versions=bad, by="test", why="fixed"))
        assert reply.ok and reply.detail.startswith("approved"), reply.detail
        await wait_for(learned, 10.0, "the watch to learn of the new approval")
        assert await book.objection(_ask(bad)) is None
    finally:
        await book.stop()
        await asyncio.gather(*spawned)


async def test_approving_the_incumbent_again_keeps_it_the_incumbent(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    commands = VersionCommands(settings, js, control)
    incumbent, canary = _tuple("8.0"), _tuple("8.1")
    for versions in (incumbent, canary):
        reply = await commands.command(VersionsApprove(versions=versions, by="test"))
        assert reply.ok, reply.detail
    assert [t for t, _ in await approved_tuples(js)] == [tuple_id(incumbent), tuple_id(canary)]
    # An operator runs the approval again (a script, or to be sure): the stable build
    # must not become the "newly approved" tuple the guard judges (and may withdraw)
    # against the canary.
    reply = await commands.command(VersionsApprove(versions=incumbent, by="test", why="again"))
    assert reply.ok, reply.detail
    assert [t for t, _ in await approved_tuples(js)] == [tuple_id(incumbent), tuple_id(canary)]


async def test_a_dead_watch_keeps_the_when_set_gate_shut(
    settings: Settings, nc: NatsClient
) -> None:
    gated = msgspec.structs.replace(settings, versions=VersionSettings(gate="when-set"))
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    spawned: list[asyncio.Task[None]] = []
    book = ApprovedVersions(gated, js, control, lambda c: spawned.append(asyncio.ensure_future(c)))
    commands = VersionCommands(gated, js, control)
    stable, canary = _tuple("7.0"), _tuple("7.1")
    reply = await commands.command(VersionsApprove(versions=stable, by="test"))
    assert reply.ok, reply.detail
    await book.start()
    # The watch dies (docs/versions.md: "every check reads the approval from KV
    # (failing closed)").
    await book.watch.stop()
    await book.withdrawn.stop()
    try:
        assert not book.watch.following()
        assert await book.objection(_ask(stable)) is None
        refusal = await book.objection(_ask(canary))
        assert refusal is not None and refusal.reason == "version-not-approved"
    finally:
        await asyncio.gather(*spawned)


def test_a_local_folder_or_unhashed_archive_install_is_unpinned() -> None:
    # PEP 610 records, as pip writes them for `pip install .`, `pip install -e .`, a VCS
    # URL and a local archive. A folder installed without -e holds whatever the folder
    # held: two different trees would otherwise advertise one "pinned" 0.1.0 tuple.
    assert install_flags({"url": "file:///src", "dir_info": {}}) == [
        "installed from a local folder"
    ]
    assert install_flags({"url": "file:///src", "dir_info": {"editable": True}}) == [
        "editable install"
    ]
    vcs = {"url": "https://x/y.git", "vcs_info": {"vcs": "git", "commit_id": "ab" * 20}}
    assert install_flags(vcs) == []
    assert install_flags({"url": "file:///a.whl", "archive_info": {}}) == [
        "installed from an archive with no hash"
    ]
    hashed = {"url": "file:///a.whl", "archive_info": {"hashes": {"sha256": "00"}}}
    assert install_flags(hashed) == []
    assert install_flags({}) == []  # from an index: no record


async def test_the_guard_judges_a_canary_though_an_older_approval_no_longer_runs(
    guard_settings: Settings, nc: NatsClient
) -> None:
    """After one full rollout the first approval stays approved but runs nowhere: the
    canary after it must still be judged, against the approval that does run."""
    async with running_stack(guard_settings) as stack:
        await stack.add_quarantine()
        retired, stable, canary = _i8_tuple("5.0"), _i8_tuple("5.1"), _i8_tuple("5.2")
        for versions in (retired, stable, canary):
            await _approve(stack, versions)
        await _publish(nc, stable, ok=20, failed=0)
        await _publish(nc, canary, ok=5, failed=15)

        async def withdrawn() -> bool:
            return [w.id for w in (await _view(guard_settings)).withdrawn] == [tuple_id(canary)]

        await wait_for(withdrawn, 30.0, "the canary's withdrawal")
        (gone,) = (await _view(guard_settings)).withdrawn
        assert gone.figures is not None and gone.figures.incumbent == tuple_id(stable)
        view = await _view(guard_settings)
        assert [a.id for a in view.approved] == [tuple_id(retired), tuple_id(stable)]


async def test_the_guard_never_withdraws_the_approval_that_runs_against_a_newer_one(
    guard_settings: Settings, nc: NatsClient
) -> None:
    async with running_stack(guard_settings) as stack:
        await stack.add_quarantine()
        stable, canary = _i8_tuple("6.0"), _i8_tuple("6.1")
        for versions in (stable, canary):
            await _approve(stack, versions)
        await _publish(nc, stable, ok=5, failed=15)  # the stable build does badly today
        await _publish(nc, canary, ok=20, failed=0)
        await _read_all(nc, stack)
        view = await _view(guard_settings)
        assert [a.id for a in view.approved] == [tuple_id(stable), tuple_id(canary)]
        assert view.withdrawn == []


class _VersionsNext(msgspec.Struct, frozen=True, omit_defaults=True):
    """``Versions`` as a later release may evolve it: one more field, with a default."""

    jetfleet: str
    handler: str = ""
    browser: str = ""
    code: str = ""
    config: str = ""
    python: str = ""
    nats_py: str = ""
    declared: dict[str, str] = {}
    unpinned: bool = False
    unpinned_why: str = ""
    id: str = ""
    gpu: str = ""


def test_a_tuple_keeps_its_id_when_a_later_leaser_knows_one_more_field() -> None:
    # The wire evolves by new fields with defaults. A leaser upgraded to a release that
    # adds one decodes an older worker's tuple with the default: its id (what the
    # approved set lists) must not change, or under `when-set` every worker would be
    # refused version-not-approved from the upgrade on.
    sent = msgspec.json.encode(_tuple("4.0"))
    today = msgspec.json.decode(sent, type=Versions)
    later = msgspec.json.decode(sent, type=_VersionsNext)
    assert tuple_id(later) == tuple_id(today)  # type: ignore[arg-type]


async def test_a_dead_watch_on_a_fresh_fleet_leaves_the_when_set_gate_open(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    spawned: list[asyncio.Task[None]] = []
    book = ApprovedVersions(
        settings, js, control, lambda c: spawned.append(asyncio.ensure_future(c))
    )
    await book.start()
    await book.watch.stop()
    try:
        assert await book.objection(_ask(_tuple("6.9"))) is None  # nothing ever approved
    finally:
        await book.withdrawn.stop()
        await asyncio.gather(*spawned)
