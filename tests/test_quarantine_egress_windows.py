"""The egress rule's windows: distinct identities of one subnet blocked on one target, at
N-1 and N, and the window's edges, by the events' own (server) times."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import Outcome, Versions
from jetfleet.services.quarantine.egress_windows import EgressWindows
from jetfleet.services.quarantine.rule_windows import Seen

from jetfleet.errors import ConfigError
from jetfleet.settings import EgressRule, QuarantineSettings, Settings, validate

RULE = EgressRule(identities=3, window_s=600.0, on=("challenged", "blocked"))
SUBNET, OTHER_SUBNET = "10.1.0.0/24", "10.2.0.0/24"
T0 = 1_800_000_000.0


class Events:
    """Blocked outcome events with increasing stream sequences."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(
        self,
        at_s: float,
        identity: str,
        subnet: str = SUBNET,
        target: str = "shop",
        reason: str = "blocked",
        kind: str = "blocked",
    ) -> Seen:
        self.seq += 1
        outcome = Outcome(
            job_id=f"j{self.seq}",
            target=target,
            worker=f"w-{identity}",
            attempt=1,
            kind=kind,  # type: ignore[arg-type]
            duration_s=0.1,
            versions=Versions(jetfleet="0", handler="http.get@0"),
            identity=identity,
            reason=reason,
            subnet=subnet,
        )
        return Seen(at_s=T0 + at_s, seq=self.seq, outcome=outcome)


def test_n_minus_1_identities_propose_nothing_and_the_nth_proposes() -> None:
    windows, event = EgressWindows(RULE), Events()
    assert windows.observe(event(0, "id-a")) is None
    assert windows.observe(event(10, "id-b", reason="challenged")) is None
    firing = windows.observe(event(20, "id-c"))
    assert firing is not None
    assert (firing.subnet, firing.target) == (SUBNET, "shop")
    assert firing.identities == ["id-a", "id-b", "id-c"]
    assert [s.seq for s in firing.evidence] == [1, 2, 3]
    # The window starts empty: the same evidence never proposes twice.
    assert windows.observe(event(30, "id-d")) is None


def test_one_identity_blocked_many_times_counts_once() -> None:
    windows, event = EgressWindows(RULE), Events()
    for n in range(10):
        assert windows.observe(event(n, "id-a")) is None
    assert windows.observe(event(11, "id-b")) is None
    firing = windows.observe(event(12, "id-c"))
    assert firing is not None and len(firing.evidence) == 12


def test_an_event_exactly_window_s_older_is_outside_and_one_just_inside_counts() -> None:
    windows, event = EgressWindows(RULE), Events()
    windows.observe(event(0, "id-a"))
    windows.observe(event(1, "id-b"))
    assert windows.observe(event(600, "id-c")) is None  # id-a is out: (0, 600]
    firing = windows.observe(event(600.5, "id-d"))  # id-b (at 1) is still in
    assert firing is not None and firing.identities == ["id-b", "id-c", "id-d"]


def test_other_subnets_targets_kinds_and_reasons_count_apart_or_not_at_all() -> None:
    windows, event = EgressWindows(RULE), Events()
    assert windows.observe(event(0, "id-a")) is None
    assert windows.observe(event(1, "id-b", subnet=OTHER_SUBNET)) is None
    assert windows.observe(event(2, "id-c", target="news")) is None
    assert windows.observe(event(3, "id-d", reason="rate-limited")) is None
    assert windows.observe(event(4, "id-e", kind="retryable")) is None
    assert windows.observe(event(5, "id-f", subnet="")) is None  # no subnet: not counted
    assert windows.observe(event(6, "", subnet=SUBNET)) is None  # no identity either
    assert windows.tracked == 3
    assert windows.observe(event(7, "id-g")) is None  # only id-a and id-g on (SUBNET, shop)


def test_a_redelivered_event_counts_once_and_time_stepping_back_stays_in() -> None:
    windows, event = EgressWindows(RULE), Events()
    first = event(100, "id-a")
    windows.observe(first)
    assert windows.observe(first) is None
    windows.observe(event(99, "id-b"))  # a new leader's stamp a little earlier
    firing = windows.observe(event(101, "id-c"))
    assert firing is not None and [s.seq for s in firing.evidence] == [1, 2, 3]


def test_a_restored_firing_keeps_only_the_events_newer_than_the_marker() -> None:
    windows, event = EgressWindows(RULE), Events()
    for n, who in enumerate(["id-a", "id-b", "id-c"]):
        firing = windows.observe(event(n, who))
    assert firing is not None
    windows.restore(firing, after_seq=2)  # id-a and id-b proposed before
    assert windows.observe(event(10, "id-d")) is None
    again = windows.observe(event(11, "id-e"))
    assert again is not None and again.identities == ["id-c", "id-d", "id-e"]


def test_identities_0_proposes_nothing_and_stale_windows_are_forgotten() -> None:
    off, event = EgressWindows(EgressRule(identities=0)), Events()
    assert all(off.observe(event(n, f"id-{n}")) is None for n in range(5))
    windows = EgressWindows(RULE)
    windows.observe(event(0, "id-a"))
    windows.forget_before(T0 + 599)
    assert windows.tracked == 1
    windows.forget_before(T0 + 600)
    assert windows.tracked == 0


@pytest.mark.parametrize(
    ("egress", "key"),
    [
        (EgressRule(identities=1), "quarantine.egress.identities"),
        (EgressRule(window_s=0), "quarantine.egress.window_s"),
        (EgressRule(for_s=0.5), "quarantine.egress.for_s"),
        (EgressRule(on="ok"), "quarantine.egress.on"),
        (EgressRule(proposal_ttl_s=0), "quarantine.egress.proposal_ttl_s"),
        (EgressRule(name="Bad Name"), "quarantine.egress.name"),
        (EgressRule(name="cool-after-block"), "quarantine.egress.name"),
    ],
)
def test_bad_egress_settings_are_refused_naming_the_key(egress: EgressRule, key: str) -> None:
    settings = Settings(quarantine=QuarantineSettings(egress=egress))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(settings)


def test_a_second_order_window_of_0_is_refused() -> None:
    settings = msgspec.structs.replace(
        Settings(), quarantine=QuarantineSettings(second_order_window_s=0)
    )
    with pytest.raises(ConfigError, match=r"quarantine\.second_order_window_s"):
        validate(settings)
