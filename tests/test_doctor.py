"""``jetfleet doctor``: durations read from real JF_OUTCOMES streams, and the arithmetic."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import Outcome, OutcomeBatch, Versions
from jetfleet.schemas.events import OutcomeKind
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.cli import doctor_command
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.ops.doctor import (
    NO_ATTEMPTS,
    Attempt,
    DoctorReport,
    ReadSummary,
    attempt_of,
    build_report,
    diagnose,
    duration_stats,
    fleet_rules,
    percentile,
    read_attempts,
    target_rules,
)
from jetfleet.outcome_events import BATCH_HEADER, JOB_HEADER, read_outcomes
from jetfleet.settings import FleetSettings, NatsSettings, Settings, TargetSettings
from jetfleet.stream_reader import read_stream
from tests.conftest import make_settings, wait_for
from tests.stack import InProcessStack

SLOW_DELAY_S = 1.0
TIGHT_ACK_WAIT_S = 0.5
"""Between the slow jobs and the fast pages: a fast page's attempt (a few ms alone) must
stay under it on a loaded machine; at 0.25 s against slow jobs of 0.3 s, four of five
did not in one CI run (three test processes on two cores)."""
SLOW_JOBS = 20
FAST_JOBS = 5


def _settings(
    ack_wait_s: float = 60.0, lease_ttl_s: float = 10.0, timeout_s: float = 30.0
) -> Settings:
    """Settings for the arithmetic tests: one target, built without validation."""
    target = TargetSettings(base_url="http://127.0.0.1:9/", timeout_s=timeout_s)
    return make_settings(
        "nats://127.0.0.1:4222",
        "redis://127.0.0.1:6379/0",
        {"demo": target},
        ack_wait_s=ack_wait_s,
        lease_ttl_s=lease_ttl_s,
    )


def _codes(report: DoctorReport) -> list[str]:
    return [w.code for w in report.all_warnings()]


async def _stored_outcomes(js: JetStreamContext) -> int:
    """Outcome events stored (a worker's batch of ok events counted event by event)."""
    try:
        return sum(
            [
                len(read_outcomes(m.subject, m.data, m.headers))
                async for m in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>")
            ]
        )
    except Exception:
        return 0


# ------------------------------------------------------------------------- pure arithmetic


def test_percentiles_interpolate_between_closest_ranks() -> None:
    assert percentile([0.1, 0.2, 0.3, 0.4], 50) == pytest.approx(0.25)
    values = [float(n) for n in range(1, 101)]
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)

    attempts = [Attempt("demo", d) for d in values] + [Attempt("demo", 200.0, timed_out=True)]
    stats = duration_stats(attempts)
    assert stats.count == 101
    assert stats.p50_s == pytest.approx(51.0)
    assert stats.p95_s == pytest.approx(96.0)
    assert stats.p99_s == pytest.approx(100.0)
    assert (stats.max_s, stats.timeouts) == (200.0, 1)


def test_fleet_rules_show_lease_and_ack_wait_arithmetic() -> None:
    recs, warnings = fleet_rules(_settings(ack_wait_s=60.0, lease_ttl_s=30.0))
    assert warnings == []
    ttl, ack = recs
    assert (ttl.setting, ttl.recommended_s, ttl.ok) == ("fleet.lease_ttl_s", 30.0, True)
    # 30 + max(5, 0.5 x 30) = 45
    assert (ack.setting, ack.recommended_s, ack.ok) == ("fleet.ack_wait_s", 45.0, True)
    assert "30 s + max(5 s, 15 s) = 45 s" in ack.rule

    recs, warnings = fleet_rules(_settings(ack_wait_s=12.0, lease_ttl_s=3.0))
    assert [w.code for w in warnings] == ["lease-ttl-short"]
    # The recommendation starts from the recommended TTL: 10 + max(5, 5) = 15.
    assert [r.recommended_s for r in recs] == [10.0, 15.0]
    assert [r.ok for r in recs] == [False, False]

    _, warnings = fleet_rules(_settings(ack_wait_s=14.0, lease_ttl_s=10.0))
    assert [w.code for w in warnings] == ["ack-wait-close-to-lease"]
    assert "10 s + 5 s = 15 s" in warnings[0].message

    # Settings built without validation may even have ack_wait <= lease TTL.
    _, warnings = fleet_rules(_settings(ack_wait_s=10.0, lease_ttl_s=10.0))
    assert [w.code for w in warnings] == ["ack-wait-not-above-lease"]

    # Without leases there is no lease to size.
    unleased = _settings(ack_wait_s=2.0, lease_ttl_s=3.0)
    unleased = msgspec.structs.replace(
        unleased, fleet=msgspec.structs.replace(unleased.fleet, leases=False)
    )
    assert fleet_rules(unleased) == ([], [])


def test_target_rules_recommend_three_p95_and_count_slow_attempts() -> None:
    # 80 fast attempts of 0.1 s, 20 slow ones of 2.0 s: p95 = p99 = 2.0 s.
    attempts = [Attempt("demo", 0.1)] * 80 + [Attempt("demo", 2.0)] * 20
    report = target_rules("demo", attempts, _settings(ack_wait_s=1.5, timeout_s=30.0))
    no_heartbeat = report.recommendations[0]
    assert no_heartbeat.setting == "fleet.ack_wait_s"
    assert no_heartbeat.recommended_s == 6.0  # 3 x 2.0 s
    assert "3 x p95 = 3 x 2.000 s = 6.000 s" in no_heartbeat.rule
    assert not no_heartbeat.ok
    (warning,) = report.warnings
    assert warning.code == "ack-wait-below-p99"
    assert "delivered twice: 20 of 100 observed attempts (20.0 %)" in warning.message

    # p99 of 2.0 s against a 2.4 s timeout is 83 %: cut off; 10 % timed out.
    attempts = [Attempt("demo", 0.1)] * 90 + [Attempt("demo", 2.0, timed_out=True)] * 10
    report = target_rules("demo", attempts, _settings(ack_wait_s=60.0, timeout_s=2.4))
    assert [w.code for w in report.warnings] == ["timeout-near-p99", "timeouts-observed"]
    assert "83 % of targets.demo.timeout_s = 2.4 s" in report.warnings[0].message
    assert "10 of 100 observed attempts (10.0 %)" in report.warnings[1].message
    timeout = report.recommendations[1]
    assert (timeout.setting, timeout.recommended_s) == ("targets.demo.timeout_s", 2.5)

    # A target no longer declared still gets its stats, but no timeout rule.
    report = target_rules("gone", attempts, _settings())
    assert not report.declared and len(report.recommendations) == 1


def test_only_attempts_that_ran_count_and_exhausted_timeouts_are_timeouts() -> None:
    versions = Versions(jetfleet="0", handler="http.get@1")

    def event(kind: OutcomeKind, reason: str = "", detail: str = "") -> Outcome:
        return Outcome(
            job_id="j",
            target="demo",
            worker="w",
            attempt=1,
            kind=kind,
            duration_s=1.0,
            versions=versions,
            reason=reason,
            detail=detail,
        )

    assert attempt_of(event("blocked", "rate-limited")) is None
    assert attempt_of(event("ok")) == Attempt("demo", 1.0)
    assert attempt_of(event("retryable", "timeout")) == Attempt("demo", 1.0, timed_out=True)
    stopped = event("retryable", "handler-timeout")
    assert attempt_of(stopped) == Attempt("demo", 1.0, timed_out=True)
    exhausted_stop = event("permanent", "attempts-exhausted", "last: handler-timeout no verdict")
    assert attempt_of(exhausted_stop) == Attempt("demo", 1.0, timed_out=True)
    exhausted = event("permanent", "attempts-exhausted", "last: timeout no answer within 5 s")
    assert attempt_of(exhausted) == Attempt("demo", 1.0, timed_out=True)
    assert attempt_of(event("permanent", "http-404")) == Attempt("demo", 1.0)


def test_no_attempts_means_nothing_to_check_and_exit_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    read = ReadSummary(filter_subject="jf.outcome.>", limit=10)
    report = build_report([], _settings(lease_ttl_s=3.0, ack_wait_s=4.0), read)
    assert report.message == NO_ATTEMPTS
    assert report.all_warnings() == [] and report.exit_code == 0
    assert doctor_command.show(report) == 0
    assert capsys.readouterr().out.strip() == "no attempts observed yet; run some jobs first"


# ------------------------------------------------------------------- against real servers


async def test_doctor_sees_slow_jobs_and_warns_when_ack_wait_is_below_p99(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = nc.jetstream()
    paths = [f"/slow/{n}?delay={SLOW_DELAY_S}" for n in range(SLOW_JOBS)]
    paths += [f"/page/{n}" for n in range(FAST_JOBS)]
    results = await submit_jobs(js, settings, "demo", jobs_for("demo", settings, paths))
    assert all(r.published and r.rejection is None for r in results)
    total = SLOW_JOBS + FAST_JOBS

    async def all_outcomes_stored() -> bool:
        return await _stored_outcomes(js) >= total

    await wait_for(all_outcomes_stored, 60, f"{total} outcome events")

    # The test settings: ack_wait 10 s, lease TTL 3 s, timeout 5 s.
    report = await diagnose(js, settings)
    assert report.read.attempts == total and not report.read.limit_reached
    (demo,) = report.targets
    assert demo.target == "demo" and demo.stats.count == total
    assert demo.stats.p95_s >= SLOW_DELAY_S
    assert demo.stats.p50_s >= SLOW_DELAY_S  # 20 of 25 are slow
    assert demo.stats.timeouts == 0
    no_heartbeat = demo.recommendations[0]
    assert no_heartbeat.recommended_s >= 3 * demo.stats.p95_s >= 3 * SLOW_DELAY_S
    assert no_heartbeat.ok  # 10 s covers 3 x p95
    # Only the fleet-wide lease TTL of the test settings (3 s < 10 s) is worth a warning.
    assert _codes(report) == ["lease-ttl-short"]
    assert doctor_command.show(report) == 1
    out = capsys.readouterr().out
    assert "target demo" in out and "p95_s" in out
    assert "fleet.ack_wait_s >= " in out and "3 x p95 = 3 x " in out
    assert "[lease-ttl-short] fleet:" in out

    # The same observations against an ack_wait below the p99 (TIGHT_ACK_WAIT_S: such
    # settings fail validation, so no worker ever ran on them: the doctor takes them as
    # given).
    tight = make_settings(
        settings.nats.url,
        settings.redis.url,
        dict(settings.targets),
        ack_wait_s=TIGHT_ACK_WAIT_S,
        lease_ttl_s=0.1,
    )
    attempts, _ = await read_attempts(js)
    longer = sum(a.duration_s > TIGHT_ACK_WAIT_S for a in attempts)
    assert longer == SLOW_JOBS  # the slow jobs, and none of the fast pages
    report = await diagnose(js, tight, target="demo")
    (warning,) = report.targets[0].warnings
    assert warning.code == "ack-wait-below-p99" and warning.target == "demo"
    assert (
        f"delivered twice: {SLOW_JOBS} of {total} observed attempts "
        f"({100 * SLOW_JOBS / total:.1f} %) ran longer than ack_wait_s" in warning.message
    )
    assert doctor_command.show(report, as_json=True) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["targets"][0]["warnings"][0]["code"] == "ack-wait-below-p99"
    assert printed["targets"][0]["stats"]["count"] == total
    assert msgspec.convert(printed, DoctorReport) == report

    # A target without events has nothing to check.
    other = make_settings(
        settings.nats.url,
        settings.redis.url,
        {**settings.targets, "other": settings.targets["demo"]},
    )
    report = await diagnose(js, other, target="other")
    assert report.message == NO_ATTEMPTS and report.exit_code == 0


async def test_empty_or_missing_stream_yields_no_attempts_observed(
    settings: Settings, nc: NatsClient, capsys: pytest.CaptureFixture[str]
) -> None:
    # A dev server: its R1 is a note, not a warning (tests/test_durability.py).
    settings = msgspec.structs.replace(
        settings, nats=msgspec.structs.replace(settings.nats, dev=True)
    )
    report = await doctor_command.collect(settings)
    assert report.message == NO_ATTEMPTS and report.targets == []
    assert doctor_command.show(report) == 0
    assert NO_ATTEMPTS in capsys.readouterr().out

    await nc.jetstream().delete_stream(subjects.STREAM_OUTCOMES)
    report = await doctor_command.collect(settings, target="demo", since_s=60)
    assert report.message == NO_ATTEMPTS and report.read.events == 0


async def _publish_outcomes(
    js: JetStreamContext, target: str, durations: list[float], per_target: bool | None = None
) -> None:
    """Events of ``target`` with ``durations``: on the per-target subject with the Jf-Job
    header (``per_target``), else on the per-job subject of events stored before that;
    None: alternately, the first per-job."""
    versions = Versions(jetfleet="0", handler="http.get@1")
    for n, duration in enumerate(durations):
        event = Outcome(
            job_id=f"{target}-{n}",
            target=target,
            worker="w-test",
            attempt=1,
            kind="ok",
            duration_s=duration,
            versions=versions,
        )
        if per_target if per_target is not None else n % 2 == 1:
            await js.publish(
                subjects.outcomes(target),
                msgspec.json.encode(event),
                headers={JOB_HEADER: event.job_id},
            )
        else:
            await js.publish(subjects.outcome(target, event.job_id), msgspec.json.encode(event))


async def test_read_is_bounded_to_the_most_recent_events_and_the_since_window(
    nc: NatsClient,
) -> None:
    js = nc.jetstream()
    # 600 events of target "a" with 30 of "b" spread among them; b's durations are their
    # order, so the most recent ones are the largest.
    # Both subject forms, as after outcomes moved to per-target subjects while older
    # events still live: the target filter reads both.
    for n in range(30):
        await _publish_outcomes(js, "a", [0.01] * 20)
        await _publish_outcomes(js, "b", [float(n)], per_target=n % 2 == 1)
    blocked = Outcome(
        job_id="b-blocked",
        target="b",
        worker="w-test",
        attempt=1,
        kind="blocked",
        duration_s=99.0,
        versions=Versions(jetfleet="0", handler="http.get@1"),
        reason="rate-limited",
    )
    await js.publish(
        subjects.outcomes("b"), msgspec.json.encode(blocked), headers={JOB_HEADER: blocked.job_id}
    )

    attempts, read = await read_attempts(js, target="b")
    assert [a.duration_s for a in attempts] == [float(n) for n in range(30)]
    assert (read.events, read.attempts, read.skipped_blocked) == (31, 30, 1)
    assert not read.limit_reached

    # The newest 11 events of b: the blocked one and the last 10 attempts. b is sparse
    # (1 in 21 messages), so the start is searched well back from the end of the stream.
    attempts, read = await read_attempts(js, target="b", limit=11)
    assert [a.duration_s for a in attempts] == [float(n) for n in range(20, 30)]
    assert read.limit_reached and read.events == 11

    attempts, read = await read_attempts(js, limit=100)
    assert read.events == 100 and read.limit_reached
    assert {a.target for a in attempts} == {"a", "b"}

    # The time window, by the server's timestamps: 5 more b events (reusing job ids
    # b-0..b-4); the window starts just before the first of them.
    await _publish_outcomes(js, "b", [100.0 + n for n in range(5)])
    first_new = await js.get_last_msg(subjects.STREAM_OUTCOMES, subjects.outcome("b", "b-0"))
    assert first_new.data is not None and b'"duration_s":100.0' in first_new.data
    assert first_new.time is not None
    _, read = await read_attempts(js, target="b")
    newest = datetime.datetime.fromisoformat(read.newest)
    since_s = (newest - first_new.time).total_seconds() + 1e-6
    attempts, read = await read_attempts(js, target="b", since_s=since_s, now=newest)
    assert [a.duration_s for a in attempts] == [100.0 + n for n in range(5)]
    assert read.since_s == since_s and not read.limit_reached

    # A window holding more than the limit falls back to the newest ``limit`` events.
    attempts, read = await read_attempts(js, target="b", since_s=3600, limit=3)
    assert [a.duration_s for a in attempts] == [102.0, 103.0, 104.0]
    assert read.limit_reached


async def test_item10_bad_outcome_events_are_skipped_and_counted_never_read_as_attempts(
    nc: NatsClient,
) -> None:
    # Anyone may publish on jf.outcome.>: none of these may become an attempt, enter the
    # report under a made-up target, or be held whole in memory.
    js = nc.jetstream()
    await _publish_outcomes(js, "a", [0.5, 1.5])
    versions = Versions(jetfleet="0", handler="http.get@1")

    def event(job_id: str, target: str, duration_s: float = 1.0, detail: str = "") -> bytes:
        outcome = Outcome(
            job_id=job_id,
            target=target,
            worker="w-forged",
            attempt=1,
            kind="ok",
            duration_s=duration_s,
            versions=versions,
            detail=detail,
        )
        return msgspec.json.encode(outcome)

    bad = [
        (subjects.outcome("a", "big"), event("big", "a", detail="x" * 500_000)),
        (subjects.outcome("a", "mine"), event("mine", "made-up-target")),
        (subjects.outcome("a", "other"), event("not-other", "a")),
        (subjects.outcome("a", "neg"), event("neg", "a", duration_s=-3.0)),
        (subjects.outcome("a", "junk"), b"not json"),
    ]
    for subject, payload in bad:
        await js.publish(subject, payload)
    await _publish_outcomes(js, "a", [2.5])

    attempts, read = await read_attempts(js)
    assert sorted(a.duration_s for a in attempts) == [0.5, 1.5, 2.5]
    assert {a.target for a in attempts} == {"a"}
    assert (read.events, read.attempts, read.skipped_undecodable) == (8, 3, 5)


# ------------------------------------------------------------------------------- the CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetfleet")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--stack", type=Path, default=None)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_command.register(commands)
    return parser


def test_cli_parses_options_and_refuses_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["doctor", "--target", "demo", "--since", "90", "--json"])
    assert (args.target, args.since_s, args.limit, args.json) == ("demo", 90.0, 100_000, True)
    for bad in (["--since", "0"], ["--since", "soon"], ["--limit", "0"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["doctor", *bad])
    capsys.readouterr()


def test_cli_end_to_end_with_no_events(
    nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "jetfleet.toml"
    config.write_text(
        f'[nats]\nurl = "{nats_url}"\ndev = true\n'
        '[targets.demo]\nbase_url = "http://127.0.0.1:9/"\n'
    )
    args = _parser().parse_args(["--config", str(config), "--stack", str(tmp_path), "doctor"])
    assert args.run(args) == 0
    # Then the dev server's durability note (tests/test_durability.py).
    assert capsys.readouterr().out.splitlines()[0] == NO_ATTEMPTS


def test_a_cluster_wants_a_lease_ttl_that_outlives_a_leader_election() -> None:
    """On R3 streams a 10 s TTL let a second holder run a job whose first holder had
    sent its request (tests/test_cluster_failover.py): the doctor asks for 30 s there."""
    fleet = FleetSettings(lease_ttl_s=10.0, ack_wait_s=60.0)
    single = Settings(fleet=fleet)
    cluster = Settings(fleet=fleet, nats=NatsSettings(replicas=3))
    assert not [w for w in fleet_rules(single)[1] if w.code == "lease-ttl-short"]
    warnings = [w for w in fleet_rules(cluster)[1] if w.code == "lease-ttl-short"]
    assert len(warnings) == 1 and "at least 30 s" in warnings[0].message
    ttl_rec = fleet_rules(cluster)[0][0]
    assert ttl_rec.recommended_s == 30.0 and not ttl_rec.ok


async def test_the_bound_counts_the_events_of_a_batch_not_its_messages(nc: NatsClient) -> None:
    # Workers send ok events 64 to a message: --limit still means events.
    js = nc.jetstream()
    versions = Versions(jetfleet="0", handler="http.get@1")
    for batch in range(10):
        events = [
            Outcome(
                job_id=f"a-{batch}-{n}",
                target="a",
                worker="w-test",
                attempt=1,
                kind="ok",
                duration_s=float(batch),
                versions=versions,
            )
            for n in range(64)
        ]
        await js.publish(
            subjects.outcomes("a"),
            msgspec.json.encode(OutcomeBatch(events)),
            headers={BATCH_HEADER: "64"},
        )
    attempts, read = await read_attempts(js, limit=100)
    assert (read.events, read.attempts, read.limit_reached) == (100, 100, True)
    # The newest 100: the last batch whole and 36 of the one before.
    assert sorted({a.duration_s for a in attempts}) == [8.0, 9.0]
    assert [a.duration_s for a in attempts].count(9.0) == 64
    attempts, read = await read_attempts(js, limit=128)  # two batches whole, none left
    assert (read.events, read.limit_reached) == (128, True)
    attempts, read = await read_attempts(js, limit=1000)
    assert (read.events, read.limit_reached) == (640, False)
    # A forged header is not believed: the message is what it holds when read (junk is
    # one skipped event, whatever it claims), and no header can stop the doctor.
    for claim in ("64", "99999", "\u00b2", "0", "x"):
        await js.publish(subjects.outcomes("a"), b"junk", headers={BATCH_HEADER: claim})
    attempts, read = await read_attempts(js, limit=100)
    assert (read.events, read.skipped_undecodable, read.attempts) == (100, 5, 95)
    assert read.limit_reached
