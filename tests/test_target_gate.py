"""The worker's per-target gate: hold for Retry-After, then one probe at a time."""

from __future__ import annotations

from jetfleet.worker.target_gate import HAND_BACK_S, PROBE_WAIT_S, TargetGate
from jetfleet.worker.verdict import Verdict, target_answered


def test_a_refused_target_hands_jobs_back_at_once_for_other_workers() -> None:
    gate = TargetGate()
    gate.hold("shop", 30.0)  # e.g. this worker is quarantined there
    assert 29.0 < gate.held_for("shop") <= 30.0  # this worker stops pulling it
    assert gate.admit("shop") == HAND_BACK_S  # a job already fetched goes back quickly
    assert gate.admit("other") is None


def test_a_target_that_said_retry_after_delays_jobs_for_the_rest_of_it() -> None:
    gate = TargetGate()
    gate.blocked("shop", 30.0)
    wait = gate.admit("shop")
    assert wait is not None and 29.0 < wait <= 30.0


def test_after_a_block_only_one_probe_goes_until_the_target_answers_normally() -> None:
    gate = TargetGate()
    gate.blocked("shop", 0.0)  # the hold itself has passed
    assert gate.admit("shop") is None  # the probe
    assert gate.admit("shop") == PROBE_WAIT_S  # everyone else waits for it
    gate.done("shop", answered=True, blocked=False)
    assert gate.admit("shop") is None
    assert gate.admit("shop") is None  # no longer suspect: jobs flow again


def test_a_probe_that_is_blocked_again_keeps_the_target_suspect() -> None:
    gate = TargetGate()
    gate.blocked("shop", 0.0)
    assert gate.admit("shop") is None
    gate.done("shop", answered=True, blocked=True)
    assert gate.admit("shop") is None  # the next probe
    assert gate.admit("shop") == PROBE_WAIT_S


def test_a_probe_that_never_reached_the_target_does_not_clear_it() -> None:
    gate = TargetGate()
    gate.blocked("shop", 0.0)
    assert gate.admit("shop") is None
    gate.done("shop", answered=False, blocked=False)  # e.g. its lease was refused
    assert gate.admit("shop") is None  # a new probe, not free flow
    assert gate.admit("shop") == PROBE_WAIT_S


def test_only_a_verdict_from_the_target_ends_the_probing() -> None:
    gate = TargetGate()
    gate.blocked("shop", 0.0)
    assert gate.admit("shop") is None  # the probe
    exhausted = Verdict("permanent", reason="attempts-exhausted", called=False)
    for said_nothing in (None, Verdict("lost"), exhausted, Verdict("blocked")):
        gate.done("shop", answered=target_answered(said_nothing), blocked=False)
        assert gate.admit("shop") is None  # still suspect: the next job probes
        assert gate.admit("shop") == PROBE_WAIT_S  # and the others wait
    gate.done(
        "shop", answered=target_answered(Verdict("permanent", reason="http-404")), blocked=False
    )
    assert gate.admit("shop") is None and gate.admit("shop") is None  # free again


def test_a_wait_for_the_next_permit_is_known_as_such_unless_a_longer_hold_covers_it() -> None:
    gate = TargetGate()
    assert not gate.waiting_for_permit("t")
    gate.wait_for_permit("t", 0.5)
    assert gate.admit("t") == HAND_BACK_S and gate.waiting_for_permit("t")
    gate.hold("t", 30.0)  # a refusal that concerns this worker: longer than the permit
    assert not gate.waiting_for_permit("t")
    blocked = TargetGate()
    blocked.blocked("t", 30.0)  # the target said to wait: a permit wait inside it is not
    blocked.wait_for_permit("t", 0.5)
    assert not blocked.waiting_for_permit("t")


def test_a_hold_about_this_worker_alone_is_known_as_such_until_a_fleet_hold_covers_it() -> None:
    gate = TargetGate()
    gate.hold("shop", 5.0, only_here=True)
    assert gate.only_here("shop")
    # A pause or closed window (about the target, for everyone) ends later: jobs then
    # wait like any held job, since no other worker may run them either.
    gate.hold("shop", 10.0)
    assert not gate.only_here("shop")
    assert not gate.only_here("news")


def test_a_permit_wait_inside_a_hold_about_this_worker_leaves_it_about_this_worker() -> None:
    gate = TargetGate()
    gate.hold("shop", 5.0, only_here=True)
    gate.wait_for_permit("shop", 0.5)  # shorter: within the hold, changes nothing
    assert gate.only_here("shop") and not gate.waiting_for_permit("shop")
