"""``jetfleet serve quarantine`` against real servers: outcome events from a real worker,
challenged by the simulator, retire its identity for that target through the leaser
(DESIGN.md I6: the identity keeps working for its other targets), at N and not at N-1;
a replica started later, replaying the window, does not set the record again."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import Outcome, Versions
from jetfleet.schemas.lease import (
    QuarantineFired,
    QuarantineList,
    QuarantineRecord,
    QuarantineRelease,
    QuarantineSet,
)
from jetfleet.services.quarantine import QuarantineService
from jetfleet.services.quarantine import service as quarantine_service
from jetfleet.services.quarantine.rule_windows import Firing
from jetfleet.services.quarantine.service import marker_key
from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.cli.quarantine_commands import send
from jetfleet.ops.quarantine_view import read_quarantines
from jetfleet.outcome_events import JOB_HEADER
from jetfleet.settings import (
    BreakerSettings,
    EgressRule,
    QuarantineRule,
    QuarantineSettings,
    Settings,
)
from jetfleet.simulator import TargetSimulator
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, submit_paths
from tests.stack import InProcessStack

SHOP, NEWS = "shop", "news"
IDENTITY = "id-a"
RETIRE = QuarantineRule(
    name="retire-3-challenges",
    on="challenged",
    scope="identity",
    count=3,
    window_s=600.0,
    action="retire",
    for_s=3600.0,
)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """Two targets on one simulator, and one rule: 3 challenges in 10 minutes retire."""
    target = sim_target(simulator)
    base = make_settings(nats_url, redis_url, {SHOP: target, NEWS: target})
    return msgspec.structs.replace(base, quarantine=QuarantineSettings(rules=(RETIRE,)))


async def records(settings: Settings) -> list[QuarantineRecord]:
    """The quarantines in force, as the leaser lists them."""
    reply = await send(settings, QuarantineList())
    assert reply.ok, reply.detail
    return reply.records


async def read_everything(nc: NatsClient, replica: QuarantineService) -> None:
    """Wait until ``replica`` has read every outcome event stored so far."""
    js = nc.jetstream()
    last = (await js.stream_info(subjects.STREAM_OUTCOMES)).state.last_seq

    async def caught_up() -> bool:
        return (replica.next_seq or 0) > last

    await wait_for(caught_up, 30.0, f"the quarantine service to read outcome {last}")


async def challenge_jobs(nc: NatsClient, settings: Settings, count: int) -> list[str]:
    """``count`` jobs on SHOP whose first request is challenged, the next answered."""
    paths = [f"/challenge/{n}?times=1" for n in range(count)]
    jobs = await submit_paths(nc.jetstream(), settings, SHOP, paths, "ch")
    return [job.id for job in jobs]


async def test_I6_three_challenges_retire_the_identity_for_that_target_only(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await services.add_worker("w-0", identity=IDENTITY)
    challenged = await challenge_jobs(nc, settings, 3)

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the identity's retirement on shop")
    (record,) = await records(settings)
    assert (record.scope, record.name, record.target) == ("identity", IDENTITY, SHOP)
    assert (record.set_by, record.for_s) == ("rule:retire-3-challenges", 3600.0)
    assert sorted(e.job_id for e in record.evidence) == sorted(challenged)
    assert {e.reason for e in record.evidence} == {"challenged"}
    assert "rule retire-3-challenges: 3 challenged outcome(s)" in record.reason
    assert "within 600 s" in record.reason
    assert all(job in record.reason for job in challenged)

    # Retired for shop only: the same identity keeps committing for news.
    await submit_paths(nc.jetstream(), settings, NEWS, ["/page/1", "/page/2"], "news")

    async def news_committed() -> bool:
        return await committed(nc.jetstream(), NEWS) == 2

    await wait_for(news_committed, 30.0, "news jobs committed by the retired identity")
    assert await committed(nc.jetstream(), SHOP) < 3
    await read_everything(nc, replica)
    assert [(r.name, r.target) for r in await records(settings)] == [(IDENTITY, SHOP)]


async def test_two_challenges_of_three_retire_nothing(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    await services.add_worker("w-0", identity=IDENTITY)
    await challenge_jobs(nc, settings, 2)

    async def both_committed() -> bool:
        return await committed(nc.jetstream(), SHOP) == 2

    await wait_for(both_committed, 30.0, "the challenged jobs committed on their retry")

    async def all_counted() -> bool:
        # Two challenged, two ok: a worker sends its ok events in a batch after a short
        # wait, so they may be stored after the commit.
        return replica.events.get(verdict="counted") >= 4

    await wait_for(all_counted, 30.0, "the 4 outcome events counted")
    await read_everything(nc, replica)
    assert await records(settings) == []
    assert replica.fired.values == {}


async def test_a_replica_started_later_does_not_set_a_released_record_again(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    first = await services.add_quarantine()
    await services.add_worker("w-0", identity=IDENTITY)
    await challenge_jobs(nc, settings, 3)

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the identity's retirement on shop")
    await read_everything(nc, first)
    released = await send(settings, QuarantineRelease(scope="identity", name=IDENTITY, target=SHOP))
    assert released.ok and await records(settings) == []

    # A new replica reads the same window again from the stream: the rule is met again
    # by the same evidence, and the fired marker keeps the operator's release.
    second = await services.add_quarantine()
    await read_everything(nc, second)
    assert await records(settings) == []
    labels = {"rule": RETIRE.label, "target": SHOP}
    assert second.fired.get(outcome="already-fired", **labels) == 1
    assert second.fired.get(outcome="set", **labels) == 0


def _challenged(target: str, job_id: str) -> bytes:
    event = Outcome(
        job_id=job_id,
        target=target,
        worker="w-far",
        attempt=1,
        kind="blocked",
        duration_s=0.1,
        versions=Versions(jetfleet="0", handler="http.get@0"),
        identity=IDENTITY,
        reason="challenged",
    )
    return msgspec.json.encode(event)


async def test_unreadable_events_and_undeclared_targets_count_for_nothing(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    js = nc.jetstream()
    await js.publish(subjects.outcome(SHOP, "garbled"), b"{not json")
    await js.publish(subjects.outcome(SHOP, "elsewhere"), _challenged(SHOP, "other-job"))
    for n in range(3):
        await js.publish(subjects.outcome("ghost", f"g{n}"), _challenged("ghost", f"g{n}"))
    for n in range(2):
        await js.publish(subjects.outcome(SHOP, f"s{n}"), _challenged(SHOP, f"s{n}"))
    await read_everything(nc, replica)
    assert replica.events.get(verdict="skipped") == 2  # undecodable; names another job
    assert replica.events.get(verdict="unknown-target") == 3
    assert await records(settings) == []

    # Two counted, so the third readable challenge on shop retires the identity.
    await js.publish(subjects.outcome(SHOP, "s2"), _challenged(SHOP, "s2"))

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the retirement from the third counted challenge")
    (record,) = await records(settings)
    assert [e.job_id for e in record.evidence] == ["s0", "s1", "s2"]


async def test_events_of_both_subject_forms_count_and_a_per_target_one_needs_its_header(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """Workers publish on jf.outcome.<target> with the job in Jf-Job; events from before
    that, on jf.outcome.<target>.<job>, are still in the window until they age out."""
    replica = await services.add_quarantine()
    js = nc.jetstream()
    await js.publish(subjects.outcomes(SHOP), _challenged(SHOP, "bare"))  # names no job
    await js.publish(
        subjects.outcomes(SHOP), _challenged(SHOP, "p0"), headers={JOB_HEADER: "not-p0"}
    )
    await js.publish(subjects.outcome(SHOP, "old"), _challenged(SHOP, "old"))
    await js.publish(subjects.outcomes(SHOP), _challenged(SHOP, "p1"), headers={JOB_HEADER: "p1"})
    await read_everything(nc, replica)
    assert replica.events.get(verdict="skipped") == 2
    assert await records(settings) == []

    await js.publish(subjects.outcomes(SHOP), _challenged(SHOP, "p2"), headers={JOB_HEADER: "p2"})

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the retirement from three challenges of both forms")
    (record,) = await records(settings)
    assert [e.job_id for e in record.evidence] == ["old", "p1", "p2"]


async def test_by_default_one_block_cools_the_worker_off_that_target(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    defaults = msgspec.structs.replace(settings, quarantine=QuarantineSettings())
    replica = QuarantineService(defaults, services.connections[0])
    await replica.start()
    try:
        await services.add_worker("w-0", identity=IDENTITY)
        await submit_paths(nc.jetstream(), settings, SHOP, ["/blocked/1?times=1"], "bl")

        async def cooled() -> bool:
            return bool(await records(settings))

        await wait_for(cooled, 30.0, "the worker cooled off shop")
        (record,) = await records(settings)
        assert (record.scope, record.name, record.target) == ("worker", "w-0", SHOP)
        assert (record.set_by, record.for_s) == ("rule:cool-after-block", 300.0)
        assert [e.reason for e in record.evidence] == ["blocked"]
    finally:
        await replica.drain(5.0)


async def test_a_rule_firing_keeps_an_operators_until_released_record(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    held = QuarantineRecord(
        scope="identity", name=IDENTITY, target=SHOP, reason="held", set_by="operator"
    )
    assert (await send(settings, QuarantineSet(record=held))).ok
    replica = await services.add_quarantine()
    js = nc.jetstream()
    for n in range(3):
        await js.publish(subjects.outcome(SHOP, f"h{n}"), _challenged(SHOP, f"h{n}"))

    async def fired() -> bool:
        return replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="kept") == 1

    await wait_for(fired, 30.0, "the rule met on the held identity")
    assert await records(settings) == [held]


async def test_a_firing_waits_for_a_leaser_that_is_down_however_long(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quarantine_service, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(quarantine_service, "RETRY_CAP_S", 0.1)
    assert services.leaser is not None
    await services.leaser.drain()
    replica = await services.add_quarantine()
    js = nc.jetstream()
    for n in range(3):
        await js.publish(subjects.outcome(SHOP, f"d{n}"), _challenged(SHOP, f"d{n}"))

    async def asked_often() -> bool:
        # More tries than the five the service used to give up after.
        return any(p.attempts >= 8 for p in replica.pending)

    await wait_for(asked_often, 30.0, "the firing asked again while no leaser answers")
    await services.start_leaser()

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the pending firing set once the leaser is back")
    assert replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="set") == 1
    assert replica.pending == []


async def test_names_the_leaser_would_refuse_are_skipped_not_asked_for(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replica = await services.add_quarantine()
    js = nc.jetstream()
    for n, identity in enumerate(["x" * 300, "id\x1bforged", "x" * 300]):
        event = msgspec.structs.replace(
            msgspec.json.decode(_challenged(SHOP, f"m{n}"), type=Outcome), identity=identity
        )
        await js.publish(subjects.outcome(SHOP, f"m{n}"), msgspec.json.encode(event))
    await read_everything(nc, replica)
    assert replica.events.get(verdict="skipped") == 3
    assert replica.fired.values == {}
    assert replica.pending == []


async def test_two_replicas_meeting_a_rule_set_it_once(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    replicas = [await services.add_quarantine(), await services.add_quarantine()]
    js = nc.jetstream()
    for n in range(3):
        await js.publish(subjects.outcome(SHOP, f"t{n}"), _challenged(SHOP, f"t{n}"))

    def total(outcome: str) -> int:
        return sum(r.fired.get(rule=RETIRE.label, target=SHOP, outcome=outcome) for r in replicas)

    async def both_met() -> bool:
        return total("set") + total("already-fired") == 2

    await wait_for(both_met, 30.0, "both replicas meeting the rule")
    assert (total("set"), total("already-fired")) == (1, 1)


async def test_events_newer_than_the_fired_marker_count_on(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    js = nc.jetstream()
    seqs = []
    for n in range(3):
        ack = await js.publish(subjects.outcome(SHOP, f"r{n}"), _challenged(SHOP, f"r{n}"))
        seqs.append(ack.seq)
    # Another replica fired on evidence up to r1: r2 did not fire anything yet.
    control = await js.key_value(subjects.BUCKET_CONTROL)
    fired_before = Firing(RETIRE, IDENTITY, SHOP, ())
    await control.create(
        marker_key(fired_before), msgspec.json.encode(QuarantineFired(seq=seqs[1]))
    )
    replica = await services.add_quarantine()
    await read_everything(nc, replica)
    assert replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="already-fired") == 1
    assert await records(settings) == []

    for n in range(3, 5):
        await js.publish(subjects.outcome(SHOP, f"r{n}"), _challenged(SHOP, f"r{n}"))

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "r2, r3 and r4 retiring the identity")
    (record,) = await records(settings)
    assert [e.job_id for e in record.evidence] == ["r2", "r3", "r4"]


async def test_a_firing_answered_busy_stays_pending_and_is_set_once_the_leaser_has_room(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quarantine_service, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(quarantine_service, "RETRY_CAP_S", 0.1)
    assert services.leaser is not None
    responder = services.leaser.responder
    room = responder.limit
    responder.limit = 0  # full: every command is answered busy, unread
    replica = await services.add_quarantine()
    js = nc.jetstream()
    for n in range(3):
        await js.publish(subjects.outcome(SHOP, f"b{n}"), _challenged(SHOP, f"b{n}"))

    async def answered_busy_often() -> bool:
        return responder.refused.get(subject=subjects.QUARANTINE, reason="busy") >= 3

    await wait_for(answered_busy_often, 30.0, "the firing answered busy again and again")
    assert [p.firing.name for p in replica.pending] == [IDENTITY]
    assert replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="failed") == 0
    responder.limit = room

    async def retired() -> bool:
        return bool(await records(settings))

    await wait_for(retired, 30.0, "the busy firing set once the leaser has room")
    assert replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="set") == 1
    assert replica.fired.get(rule=RETIRE.label, target=SHOP, outcome="failed") == 0
    assert replica.pending == []


async def test_a_rule_replaces_a_record_that_would_lapse_before_its_own_and_keeps_a_longer_one(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """Kept or replaced by the time a record has left by the server's clock: a rule kept
    under a record that lapses first would be lost when it lapses (its marker claimed)."""
    js = nc.jetstream()
    # id-a: an operator's --for just over the rule's, aged until less than the rule's is
    # left. id-b: an operator's twice the rule's.
    for name, for_s in (("id-a", RETIRE.for_s + 2), ("id-b", RETIRE.for_s * 2)):
        record = QuarantineRecord(
            scope="identity", name=name, target=SHOP, reason="op", set_by="operator", for_s=for_s
        )
        assert (await send(settings, QuarantineSet(record=record))).ok

    async def id_a_has_less_left_than_the_rule() -> bool:
        view = await read_quarantines(js)
        left = [r.left_s for r in view.records if r.name == "id-a"]
        return bool(left) and left[0] is not None and left[0] < RETIRE.for_s

    await wait_for(id_a_has_less_left_than_the_rule, 30.0, "id-a's record to age past 2 s")
    replica = await services.add_quarantine()
    for name in ("id-a", "id-b"):
        for n in range(3):
            event = msgspec.structs.replace(
                msgspec.json.decode(_challenged(SHOP, f"{name}-{n}"), type=Outcome), identity=name
            )
            await js.publish(subjects.outcome(SHOP, f"{name}-{n}"), msgspec.json.encode(event))

    async def both_met() -> bool:
        return sum(replica.fired.values.values()) == 2

    await wait_for(both_met, 30.0, "the rule met on both identities")
    labels = {"rule": RETIRE.label, "target": SHOP}
    assert replica.fired.get(outcome="set", **labels) == 1
    assert replica.fired.get(outcome="kept", **labels) == 1
    in_force = {r.name: r for r in await records(settings)}
    assert (in_force["id-a"].set_by, in_force["id-a"].for_s) == (
        f"rule:{RETIRE.label}",
        RETIRE.for_s,
    )
    assert (in_force["id-b"].set_by, in_force["id-b"].for_s) == ("operator", RETIRE.for_s * 2)


async def test_a_replica_lagging_past_the_fired_markers_life_does_not_fire_again(
    nc: NatsClient,
    services: InProcessStack,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica far behind the stream meets evidence whose marker has lapsed: it skips
    it (``stale``) rather than set again a record an operator released."""
    short = msgspec.structs.replace(RETIRE, window_s=2.0)
    lagging_settings = msgspec.structs.replace(
        settings,
        quarantine=QuarantineSettings(
            rules=(short,), egress=EgressRule(identities=0), breaker=BreakerSettings(window_s=1.0)
        ),
    )
    monkeypatch.setattr(quarantine_service, "MARKER_MARGIN_S", 1.0)  # markers live 3 s
    js = nc.jetstream()
    first = QuarantineService(lagging_settings, services.connections[0])
    await first.start()
    try:
        seqs = []
        for n in range(3):
            ack = await js.publish(subjects.outcome(SHOP, f"l{n}"), _challenged(SHOP, f"l{n}"))
            seqs.append(ack.seq)

        async def retired() -> bool:
            return bool(await records(settings))

        await wait_for(retired, 30.0, "the first replica's retirement")
    finally:
        await first.drain(5.0)
    released = await send(settings, QuarantineRelease(scope="identity", name=IDENTITY, target=SHOP))
    assert released.ok
    control = await js.key_value(subjects.BUCKET_CONTROL)
    key = marker_key(Firing(short, IDENTITY, SHOP, ()))

    async def marker_lapsed() -> bool:
        try:
            await control.get(key)
        except KeyNotFoundError:
            return True
        return False

    await wait_for(marker_lapsed, 30.0, "the fired marker to lapse by its TTL")
    # A replica that had read up to the first event and fell behind reads on from there.
    lagging = QuarantineService(lagging_settings, services.connections[0])
    lagging.next_seq = seqs[0]
    await lagging.start()
    try:
        await read_everything(nc, lagging)
        labels = {"rule": short.label, "target": SHOP}
        assert lagging.fired.get(outcome="stale", **labels) == 1
        assert lagging.fired.get(outcome="set", **labels) == 0
        assert await records(settings) == []
    finally:
        await lagging.drain(5.0)
