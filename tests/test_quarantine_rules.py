"""The quarantine rules' windows: counts at N-1 and N, and the window's edges, by the
events' own (server) times."""

from __future__ import annotations

from jetfleet.schemas import Outcome, Versions
from jetfleet.services.quarantine.rule_windows import RuleWindows, Seen

from jetfleet.settings import QuarantineRule

RETIRE = QuarantineRule(
    name="retire-3",
    on=("challenged", "blocked"),
    scope="identity",
    count=3,
    window_s=600.0,
    action="retire",
    for_s=3600.0,
)
COOL = QuarantineRule(
    name="cool-1", on="blocked", scope="worker", count=1, window_s=60.0, action="cool", for_s=300
)
T0 = 1_800_000_000.0


class Events:
    """Outcome events with increasing stream sequences."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(
        self,
        at_s: float,
        reason: str = "challenged",
        identity: str = "id-a",
        target: str = "shop",
        kind: str = "blocked",
        worker: str = "w-0",
    ) -> Seen:
        self.seq += 1
        outcome = Outcome(
            job_id=f"j{self.seq}",
            target=target,
            worker=worker,
            attempt=1,
            kind=kind,  # type: ignore[arg-type]
            duration_s=0.1,
            versions=Versions(jetfleet="0", handler="http.get@0"),
            identity=identity,
            reason=reason,
        )
        return Seen(at_s=T0 + at_s, seq=self.seq, outcome=outcome)


def test_n_minus_1_challenges_fire_nothing_and_the_nth_retires() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    assert windows.observe(event(0)) == []
    assert windows.observe(event(100)) == []
    fired = windows.observe(event(200, reason="blocked"))
    assert [(f.rule.name, f.name, f.target) for f in fired] == [("retire-3", "id-a", "shop")]
    assert [s.outcome.job_id for s in fired[0].evidence] == ["j1", "j2", "j3"]


def test_an_event_exactly_window_s_older_is_outside_the_window() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0))
    windows.observe(event(300))
    assert windows.observe(event(600)) == []  # the first is exactly 600 s older: out
    assert len(windows.observe(event(899.999))) == 1  # 300, 600, 899.999: inside 600 s


def test_an_event_just_inside_the_window_counts() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0))
    windows.observe(event(300))
    assert len(windows.observe(event(599.999))) == 1


def test_counts_are_per_identity_and_per_target() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0, identity="id-a", target="shop"))
    windows.observe(event(1, identity="id-b", target="shop"))
    windows.observe(event(2, identity="id-a", target="news"))
    windows.observe(event(3, identity="id-a", target="shop"))
    assert windows.observe(event(4, identity="id-b", target="news")) == []
    assert len(windows.observe(event(5, identity="id-a", target="shop"))) == 1


def test_other_reasons_and_kinds_are_not_counted() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0, reason="rate-limited"))
    windows.observe(event(1, kind="retryable", reason="challenged"))
    windows.observe(event(2, kind="ok", reason=""))
    windows.observe(event(3))
    assert windows.observe(event(4)) == []
    assert len(windows.observe(event(5))) == 1


def test_a_redelivered_event_is_counted_once() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    first = event(0)
    windows.observe(first)
    windows.observe(first)
    assert windows.observe(event(1)) == []
    assert len(windows.observe(event(2))) == 1


def test_evidence_that_fired_starts_a_new_window() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    for at_s in (0, 1):
        windows.observe(event(at_s))
    assert len(windows.observe(event(2))) == 1
    assert windows.observe(event(3)) == []
    assert windows.observe(event(4)) == []
    assert len(windows.observe(event(5))) == 1


def test_the_window_ends_at_the_newest_time_even_if_a_later_event_is_stamped_earlier() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0))
    windows.observe(event(700))  # the first is now out of the window
    assert windows.observe(event(50)) == []  # stamped far earlier: out at once
    assert windows.observe(event(640)) == []  # stamped earlier (a new leader): second
    assert len(windows.observe(event(701))) == 1


def test_a_block_cools_the_worker_and_counts_towards_the_identity() -> None:
    windows, event = RuleWindows((COOL, RETIRE)), Events()
    fired = windows.observe(event(0, reason="blocked", worker="w-7"))
    assert [(f.rule.action, f.name) for f in fired] == [("cool", "w-7")]
    assert windows.observe(event(1, reason="challenged", worker="w-8")) == []


def test_an_event_without_the_scope_s_name_is_not_counted() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    for at_s in range(5):
        assert windows.observe(event(at_s, identity="")) == []


def test_stale_windows_are_forgotten_and_fresh_ones_kept() -> None:
    windows, event = RuleWindows((RETIRE,)), Events()
    windows.observe(event(0, identity="old"))
    windows.observe(event(1000, identity="new"))
    assert windows.tracked == 2
    windows.forget_before(T0 + 1000)
    assert windows.tracked == 1
    windows.observe(event(1001, identity="new"))
    assert len(windows.observe(event(1002, identity="new"))) == 1
