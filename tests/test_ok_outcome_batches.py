"""A worker's ok outcome events go out in batches (jetfleet/worker/ok_outcomes.py): one
message per target holds up to 64, and every reader takes each event once, through
``read_outcomes``. Failures stay one event a message. Pure reading rules first, then the
batcher against a real nats-server, and the gateway's tail counting a batch."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import Outcome, OutcomeBatch
from jetfleet.schemas.report import Versions
from jetfleet.services.gateway.outcome_tail import OutcomeTail
from jetfleet.services.quarantine import service as quarantine_service
from jetfleet.services.quarantine.rule_windows import Seen
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.outcome_events import (
    BATCH_HEADER,
    JOB_HEADER,
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    MAX_OUTCOME_BYTES,
    read_outcomes,
)
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream
from jetfleet.worker.ok_outcomes import OkOutcomeBatches
from tests.conftest import wait_for
from tests.stack import InProcessStack

SUBJECT = subjects.outcomes("demo")


def _event(n: int, kind: str = "ok", target: str = "demo") -> Outcome:
    return Outcome(
        job_id=f"j{n}",
        worker="w-0",
        attempt=1,
        kind=kind,  # type: ignore[arg-type]
        duration_s=0.01,
        target=target,
        versions=Versions(jetfleet="0", id="v"),
    )


def _batch(*events: Outcome) -> tuple[bytes, dict[str, str]]:
    return msgspec.json.encode(OutcomeBatch(list(events))), {BATCH_HEADER: str(len(events))}


# ------------------------------------------------------------------------- reading rules


def test_a_batch_reads_as_its_events_in_order() -> None:
    data, headers = _batch(_event(1), _event(2), _event(3))
    read = read_outcomes(SUBJECT, data, headers)
    assert [e.job_id for e in read if isinstance(e, Outcome)] == ["j1", "j2", "j3"]
    assert len(read) == 3


def test_a_plain_event_reads_as_before() -> None:
    data = msgspec.json.encode(_event(7))
    assert read_outcomes(SUBJECT, data, {JOB_HEADER: "j7"}) == [_event(7)]
    [why] = read_outcomes(SUBJECT, data, {})
    assert isinstance(why, str) and "Jf-Job" in why


def test_only_ok_events_of_the_subjects_target_count_in_a_batch() -> None:
    # A failure is evidence by its own stream sequence; in a batch it would share one.
    data, headers = _batch(_event(1), _event(2, kind="blocked"), _event(3, target="other"))
    first, blocked, other = read_outcomes(SUBJECT, data, headers)
    assert first == _event(1)
    assert isinstance(blocked, str) and "only ok events are batched" in blocked
    assert isinstance(other, str) and "not the job and target" in other


def test_unreadable_batches_are_one_reason_each() -> None:
    cases = [
        (SUBJECT, b"[", "does not decode"),
        (SUBJECT, msgspec.json.encode([_event(1)]), "does not decode as an OutcomeBatch"),
        (SUBJECT, b'{"events":[]}', "a batch of 0 events"),
        (SUBJECT, _batch(*(_event(n) for n in range(MAX_BATCH_EVENTS + 1)))[0], "65"),
        (SUBJECT, b" " * (MAX_BATCH_BYTES + 1), "over the"),
        (subjects.outcome("demo", "j1"), _batch(_event(1))[0], "per-job subject"),
    ]
    for subject, data, expected in cases:
        [why] = read_outcomes(subject, data, {BATCH_HEADER: str(data.count(b'"job_id"'))})
        assert isinstance(why, str) and expected in why, (expected, why)


def test_an_event_in_a_batch_has_a_lone_events_bound_and_the_count_must_match() -> None:
    # A batch is no way around the 8 KiB a lone event may have (the gateway keys its
    # tallies by worker name, for one).
    big = msgspec.structs.replace(_event(2), worker="w" * MAX_OUTCOME_BYTES)
    data, headers = _batch(_event(1), big)
    first, why = read_outcomes(SUBJECT, data, headers)
    assert first == _event(1)
    assert isinstance(why, str) and f"over {MAX_OUTCOME_BYTES}" in why
    data, _ = _batch(_event(1), _event(2))
    [why] = read_outcomes(SUBJECT, data, {BATCH_HEADER: "3"})
    assert isinstance(why, str) and "the batch holds 2" in why


# -------------------------------------------------------------- the batcher, real server


async def _stored(nc: NatsClient) -> list[tuple[dict[str, str], list[Outcome | str]]]:
    js = nc.jetstream()
    return [
        (dict(m.headers or {}), read_outcomes(m.subject, m.data, m.headers))
        async for m in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>")
    ]


async def test_held_events_go_out_a_batch_per_target_each_once(nc: NatsClient) -> None:
    batches = OkOutcomeBatches(nc, wait_s=60.0)  # only the size and the drain send here
    for n in range(100):
        batches.add(SUBJECT, f"j{n}", msgspec.json.encode(_event(n)))
    batches.add(subjects.outcomes("news"), "n1", msgspec.json.encode(_event(1, target="news")))
    await batches.drain()
    await nc.flush()

    async def all_stored() -> bool:
        return sum(len(events) for _, events in await _stored(nc)) == 101

    await wait_for(all_stored, 10.0, "101 ok events stored")
    stored = await _stored(nc)
    # 64 sent as the batch filled, 36 at the drain; news's one event as a plain event.
    assert sorted(len(events) for _, events in stored) == [1, 36, 64]
    demo = [e for _, events in stored for e in events if isinstance(e, Outcome)]
    assert sorted(e.job_id for e in demo if e.target == "demo") == sorted(
        f"j{n}" for n in range(100)
    )
    [(plain_headers, _)] = [(h, e) for h, e in stored if len(e) == 1]
    assert plain_headers == {JOB_HEADER: "n1"}
    assert batches.batches_sent == 3


async def test_a_held_event_goes_out_after_the_wait_without_a_drain(nc: NatsClient) -> None:
    batches = OkOutcomeBatches(nc, wait_s=0.05)
    batches.add(SUBJECT, "j1", msgspec.json.encode(_event(1)))
    batches.add(SUBJECT, "j2", msgspec.json.encode(_event(2)))

    async def sent() -> bool:
        return [len(events) for _, events in await _stored(nc)] == [2]

    await wait_for(sent, 10.0, "the batch sent by its timer")


async def test_the_gateway_tail_counts_every_event_of_a_batch(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    data, headers = _batch(*(_event(n) for n in range(10)))
    await js.publish(SUBJECT, data, headers=headers)
    await js.publish(SUBJECT, msgspec.json.encode(_event(10)), headers={JOB_HEADER: "j10"})
    tail = OutcomeTail(js, ServerClock(nc))
    tail.start()
    try:

        async def all_counted() -> bool:
            return tail.series.events >= 11

        await wait_for(all_counted, 30.0, "11 events counted")
        [row] = tail.series.rows("worker", tail.series.newest_s)
        assert (tail.series.events, row.ok, tail.skipped) == (11, 11, 0)
    finally:
        await tail.stop()


async def test_an_error_mid_batch_costs_the_quarantine_reader_that_event_alone(
    nc: NatsClient, services: InProcessStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One event of a batch raising (a control-bucket read timing out, say) makes the
    # reader subscribe again: the rest of the batch is still taken, none twice.
    monkeypatch.setattr(quarantine_service, "ERROR_RETRY_S", 0.1)
    replica = await services.add_quarantine()
    observed: list[str] = []
    observe = replica.breaker.observe

    async def failing_once(seen: Seen) -> None:
        observed.append(seen.outcome.job_id)
        if observed.count("j2") == 1 and seen.outcome.job_id == "j2":
            raise TimeoutError("control bucket read timed out")
        await observe(seen)

    monkeypatch.setattr(replica.breaker, "observe", failing_once)
    data, headers = _batch(*(_event(n) for n in range(10)))
    await nc.jetstream().publish(SUBJECT, data, headers=headers)

    async def all_seen() -> bool:
        return len(observed) >= 10

    await wait_for(all_seen, 30.0, "the batch's 10 events observed")
    last = (await nc.jetstream().stream_info(subjects.STREAM_OUTCOMES)).state.last_seq

    async def caught_up() -> bool:
        return (replica.next_seq or 0) > last

    await wait_for(caught_up, 30.0, "the reader past the batch")
    assert observed == [f"j{n}" for n in range(10)]
    assert replica.events.get(verdict="counted") == 10
