"""Which retries a worker hands back for another worker (pure logic)."""

from __future__ import annotations

from jetfleet.worker.failed_here import FailedHere


def test_a_retry_that_comes_straight_back_is_offered_elsewhere_twice_then_runs() -> None:
    memory = FailedHere(tries=2)
    memory.failed("j", delivery=1)
    assert memory.offer_elsewhere("j", 2)
    assert memory.offer_elsewhere("j", 3)
    assert not memory.offer_elsewhere("j", 4)
    assert len(memory) == 0


def test_a_retry_another_worker_saw_in_between_runs_here() -> None:
    # Delivery 2 went to another worker (which may have failed it): the last failure is
    # not known to be ours, so delivery 3 runs here instead of ping-ponging.
    memory = FailedHere(tries=2)
    memory.failed("j", delivery=1)
    assert not memory.offer_elsewhere("j", 3)
    assert not memory.offer_elsewhere("j", 4)


def test_a_job_that_never_failed_here_runs() -> None:
    memory = FailedHere()
    memory.failed("other", delivery=1)
    assert not memory.offer_elsewhere("j", 2)


def test_a_new_failure_here_restarts_the_offers() -> None:
    memory = FailedHere(tries=1)
    memory.failed("j", delivery=1)
    assert memory.offer_elsewhere("j", 2)
    memory.failed("j", delivery=5)
    assert memory.offer_elsewhere("j", 6)
    assert not memory.offer_elsewhere("j", 7)


def test_memory_is_bounded_and_forgets_the_oldest() -> None:
    memory = FailedHere(tries=1, memory=3)
    for n in range(5):
        memory.failed(f"j{n}", delivery=1)
    assert len(memory) == 3
    assert not memory.offer_elsewhere("j0", 2)
    assert memory.offer_elsewhere("j4", 2)
