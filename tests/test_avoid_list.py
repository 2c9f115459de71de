"""The avoid list (docs/leases.md#the-avoid-list): a job revoked by a quarantine goes to
another identity and is not granted back to the quarantined one while its entry holds,
even once the quarantine is lifted; and no entry keeps a job from running for ever.

Real servers: nats-server, Redis, the simulator, and the scheduler, leaser and sink in
this process. The list's pure rules are tested at the bottom."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas.lease import (
    AVOID_MAX,
    AvoidEntry,
    JobLeaseHistory,
    LeaseRefusal,
    LeaseRequest,
    QuarantineRecord,
    QuarantineRelease,
    QuarantineSet,
)
from jetfleet.schemas.report import Versions
from jetfleet.services.leaser.avoid_check import AvoidList
from nats.aio.client import Client as NatsClient

from jetfleet.avoid_list import marker_key, naming, with_entry
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.identity_presence import IdentityPresence
from jetfleet.lease_store import HistoryEntry
from jetfleet.simulator import TargetSimulator
from jetfleet.worker.hand_back_pace import HandBackPace
from tests.conftest import wait_for
from tests.queueing.helpers import committed
from tests.test_invariant_i5 import (
    _challenged_on_alice,
    refused_avoided,
    result_of,
    running,
    two_identity_settings,
)
from tests.test_leases import quarantine

pytestmark = pytest.mark.timeout(90)


async def test_a_quarantine_requeues_the_identitys_job_to_another_and_never_back_while_it_holds(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = two_identity_settings(nats_url, redis_url, simulator, tmp_path)
    # Each time alice is refused the job it goes back with a wait that doubles (up to a
    # cap set by its max age, 17 min with the tests' default: hand_back_pace.py); while
    # bob starts under load she may meet it often enough that it is away past the 30 s
    # below (a CI run failed so). A 120 s max age caps the waits at 2 s.
    demo = msgspec.structs.replace(settings.targets["demo"], max_age_s=120.0)
    settings = msgspec.structs.replace(settings, targets={**settings.targets, "demo": demo})
    assert HandBackPace(settings).cap_s("demo") <= 2.0
    async with running(settings) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        presence = IdentityPresence(js)
        alice = await stack.add_worker("w-alice", identity="alice")
        [job] = jobs_for("demo", settings, ["/slow/1?delay=3"])
        await submit_jobs(js, settings, "demo", [job])

        async def in_flight() -> bool:
            return simulator.in_flight("slow") == 1

        await wait_for(in_flight, 30, "alice to run the job")
        # Bob is live (claimed) but pulls nothing yet, so alice meets the job again.
        bob_claim = await presence.claim("bob", "w-bob-starting", ttl_s=30)
        # A one-second quarantine, lifted at once too: from then on nothing refuses
        # alice but her job's avoid entry. (Had she asked again before the release landed,
        # her refusal holds her off for the quarantine's second at most.)
        record = QuarantineRecord(
            scope="identity", name="alice", target="demo", reason="test", for_s=1.0
        )
        reply = await quarantine(nc, QuarantineSet(record=record))
        assert reply.revoked == [job.id]
        await quarantine(nc, QuarantineRelease(scope="identity", name="alice", target="demo"))

        await refused_avoided(alice, "alice to be refused the job revoked from her")
        await presence.release(bob_claim)
        await stack.add_worker("w-bob", identity="bob")

        async def done() -> bool:
            return await committed(js, "demo") == 1

        await wait_for(done, 30, "the revoked job to commit on bob")
        result = await result_of(js, "demo", job.id)
        assert result is not None and result.identity == "bob"
        # Alice's revoked try and bob's: alice was never granted the job again.
        assert simulator.counts()["by_client"] == {"w-alice": 1, "w-bob": 1}


async def test_with_no_other_identity_live_the_avoided_job_runs_where_it_was_challenged(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    settings = two_identity_settings(nats_url, redis_url, simulator, tmp_path)
    async with running(settings) as stack:
        js = stack.connections[0].jetstream()
        alice, token, job_id, bob_claim = await _challenged_on_alice(
            stack, simulator, settings, "/session/2"
        )

        await refused_avoided(alice, "alice to be refused while bob is live")
        # Bob goes, and nobody else could take the job: it must not wait for nobody.
        await IdentityPresence(js).release(bob_claim)

        async def done() -> bool:
            return await committed(js, "demo") == 2

        await wait_for(done, 30, "the job to commit on alice, the only identity left")
        result = await result_of(js, "demo", job_id)
        assert result is not None and result.identity == "alice"
        # On a fresh session: her challenged one was discarded.
        tries = [t for p, t in simulator.sessions_presented() if p == "/session/2"]
        assert tries[0] == token and tries[-1] != token, tries
        assert (await stack.status()).totals.dead == 0


async def test_an_avoid_entry_lapses_after_fleet_avoid_s_when_no_one_else_takes_the_job(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    avoid_s = 3.0
    settings = two_identity_settings(nats_url, redis_url, simulator, tmp_path, avoid_s=avoid_s)
    async with running(settings) as stack:
        js = stack.connections[0].jetstream()
        # Bob stays live all along but never pulls the target (a worker of other targets,
        # say): the job would wait for him for ever, but for the entry's lapse.
        alice, _, job_id, bob_claim = await _challenged_on_alice(
            stack, simulator, settings, "/session/2"
        )
        challenged_at = time.monotonic()  # after the challenge; its entry came after it

        async def done() -> bool:
            return await committed(js, "demo") == 2

        await wait_for(done, avoid_s + 20, "the job to commit on alice once her entry lapsed")
        waited_s = time.monotonic() - challenged_at
        assert alice.stats["refused:avoided"] >= 1, "the entry held before it lapsed"
        # Not before the marker's TTL ran out (whole seconds, the server's clock; the
        # challenge was seen at most a poll after it was met).
        assert waited_s >= avoid_s - 0.5, waited_s
        result = await result_of(js, "demo", job_id)
        assert result is not None and result.identity == "alice"
        await IdentityPresence(js).release(bob_claim)


# --- the check against real KV ---------------------------------------------------------


def _asking(worker: str, identity: str, pin: str = "") -> LeaseRequest:
    return LeaseRequest(
        job_id="j-1",
        target="demo",
        key="u-1",
        worker=worker,
        versions=Versions(jetfleet="0", handler="http.get@1"),
        identity=identity,
        pin_identity=pin,
    )


def _read(entries: list[AvoidEntry]) -> asyncio.Future[HistoryEntry]:
    done: asyncio.Future[HistoryEntry] = asyncio.get_running_loop().create_future()
    done.set_result(HistoryEntry(JobLeaseHistory(fence=1, grants=1, avoid=entries), 1))
    return done


async def test_the_check_refuses_while_its_marker_lives_and_someone_else_is_live(
    nc: NatsClient,
) -> None:
    js = nc.jetstream()

    async def objection(request: LeaseRequest, entries: list[AvoidEntry]) -> LeaseRefusal | None:
        # A leaser of its own each time: none keeps a listing of the claims from before.
        return await AvoidList(js, avoid_s=2.0).objection(request, _read(entries))

    alice = await AvoidList(js, avoid_s=2.0).entry("j-1", "identity", "alice", "challenged")
    assert alice is not None
    presence = IdentityPresence(js)
    # Nobody else live: waived.
    assert await objection(_asking("w-a", "alice"), [alice]) is None
    bob = await presence.claim("bob", "w-b", ttl_s=30)
    refusal = await objection(_asking("w-a", "alice"), [alice])
    assert refusal is not None and refusal.reason == "avoided" and refusal.retry_after_s == 0
    assert "identity alice" in refusal.detail and "challenged" in refusal.detail
    # Not alice, or a job pinned to alice (nobody else may run it): no objection.
    assert await objection(_asking("w-b", "bob"), [alice]) is None
    assert await objection(_asking("w-a", "alice", pin="alice"), [alice]) is None
    # Pinned to a region: bob may be of another one (claims do not say), so no objection.
    in_eu = msgspec.structs.replace(_asking("w-a", "alice"), pin_region="eu", region="eu")
    assert await objection(in_eu, [alice]) is None
    # Bob on the list too: nobody else is left, so the job runs on alice.
    bob_entry = await AvoidList(js, avoid_s=2.0).entry("j-1", "identity", "bob", "blocked")
    assert bob_entry is not None
    assert await objection(_asking("w-a", "alice"), [alice, bob_entry]) is None

    # The marker's TTL (the server's clock) ends the entry.
    async def lapsed() -> bool:
        return await objection(_asking("w-a", "alice"), [alice]) is None

    await wait_for(lapsed, 10, "alice's marker to lapse")
    await presence.release(bob)


# --- the list's rules (pure) ----------------------------------------------------------


def _entry(name: str, scope: str = "identity") -> AvoidEntry:
    return AvoidEntry(scope=scope, name=name, reason="challenged")  # type: ignore[arg-type]


def test_adding_replaces_the_same_name_last_and_keeps_the_newest() -> None:
    entries = [_entry("old"), _entry("alice"), _entry("alice", scope="worker")]
    added = with_entry(entries, AvoidEntry(scope="identity", name="alice", reason="blocked"))
    assert [(e.scope, e.name, e.reason) for e in added] == [
        ("identity", "old", "challenged"),
        ("worker", "alice", "challenged"),
        ("identity", "alice", "blocked"),
    ]
    many: list[AvoidEntry] = []
    for n in range(AVOID_MAX + 5):
        many = with_entry(many, _entry(f"id-{n}"))
    assert [e.name for e in many] == [f"id-{n}" for n in range(5, AVOID_MAX + 5)]


def test_an_entry_names_a_worker_or_an_identity_never_an_empty_one() -> None:
    entries = [_entry("w-1", scope="worker"), _entry("alice")]
    assert naming(entries, "w-1", "") == [entries[0]]
    assert naming(entries, "w-2", "alice") == [entries[1]]
    assert naming(entries, "w-1", "alice") == entries
    assert naming(entries, "alice", "") == [], "a worker id is not an identity"
    assert naming([_entry("")], "w-2", "") == []


def test_each_job_and_name_has_its_own_marker_key() -> None:
    keys = {
        marker_key(job, entry)
        for job in ("j-1", "j-2")
        for entry in (_entry("alice"), _entry("alice", scope="worker"), _entry("bob"))
    }
    assert len(keys) == 6
    assert all(k.startswith("avoid.") and " " not in k for k in keys)
