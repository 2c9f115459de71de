"""Dead letters against real servers: what makes one, what it holds, and the ``jetfleet
dlq`` commands (list, show, replay, purge). DESIGN.md section 2, steps 8-9.

The module runs two targets, ``demo`` and ``other``, both on the simulator, and a slower
retry base than the suite's default so the growing backoff between attempts is
measurable on the server's clock.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jetfleet.schemas import AttemptRecord, CommittedResult, DeadLetter, Job, WorkOrder
from jetfleet.schemas.lease import JobLeaseHistory
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

import jetfleet.cli.main as cli_main
from jetfleet import subjects
from jetfleet.admission import job_key
from jetfleet.attempt_history import MAX_HISTORY
from jetfleet.canonical import idempotency_key
from jetfleet.cli import dlq_commands
from jetfleet.client import submit_jobs
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import JetfleetError
from jetfleet.ops.dead_letters import (
    REPLAY_HEADER,
    DeadLetterEntry,
    dead_letter_total,
    get_dead_letter,
    list_dead_letters,
    purge,
    purged_counts,
    record_purged,
    replay,
    replay_job_id,
)
from jetfleet.outcome_events import JOB_HEADER
from jetfleet.publish import publish_durably
from jetfleet.results import iter_results
from jetfleet.settings import Settings, TargetSettings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import ROBOTS_OFF_REASON, make_settings, wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

RETRY_BASE_S = 0.3
TARGETS = ("demo", "other")
SLOW_S = 2.0  # simulator latency while the "cause" is in place
JOB_TIMEOUT_S = 0.5  # per-attempt budget of the jobs that meet that latency


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """Two targets on the simulator; backoff floors of 0.15 s, 0.3 s, ... per attempt."""

    def target() -> TargetSettings:
        return TargetSettings(
            base_url=simulator.base_url + "/",
            rate=1000,
            burst=100,
            max_in_flight=64,
            timeout_s=5.0,
            obey_robots=False,
            robots_off_reason=ROBOTS_OFF_REASON,
        )

    return make_settings(
        nats_url,
        redis_url,
        {name: target() for name in TARGETS},
        retry_base_s=RETRY_BASE_S,
        retry_max_backoff_s=2.0,
    )


# --- the CLI, run as `jetfleet --config FILE dlq ...` -----------------------------------


def write_config(settings: Settings, path: Path) -> Path:
    """``settings`` as a jetfleet.toml the CLI loads."""
    path.write_text(settings_toml(settings))
    return path


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


@pytest.fixture
def dlq_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``main`` know ``dlq`` even before jetfleet/cli/main.py registers it (a no-op
    once it does; ``test_the_main_parser_registers_dlq`` checks that it does)."""
    original = cli_main.build_parser

    def build() -> argparse.ArgumentParser:
        parser = original()
        commands = _subcommands(parser)
        if "dlq" not in commands.choices:
            dlq_commands.register(commands)
        return parser

    monkeypatch.setattr(cli_main, "build_parser", build)


Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def cli(
    dlq_cli: None, settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Cli:
    """Run ``jetfleet dlq ARGS`` (in a thread: the CLI runs its own event loop)."""
    config = write_config(settings, tmp_path / "jetfleet.toml")

    async def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        argv = ["--config", str(config), "--stack", str(tmp_path / "no-stack"), "dlq", *args]
        code = await asyncio.to_thread(cli_main.main, argv)
        out, err = capsys.readouterr()
        return code, out, err

    return run


class _Terminal(io.StringIO):
    """A stdin that says it is a terminal, with the operator's typed answer."""

    def isatty(self) -> bool:
        return True


# --- helpers ----------------------------------------------------------------------------


def page(simulator: TargetSimulator, path: str) -> str:
    return simulator.base_url + path


async def submit(js: JetStreamContext, settings: Settings, target: str, *jobs: Job) -> None:
    results = await submit_jobs(js, settings, target, list(jobs))
    assert all(r.published and r.rejection is None for r in results), results


async def letter_of(js: JetStreamContext, job_id: str) -> DeadLetterEntry:
    """Wait for the dead letter of ``job_id`` and return it."""
    found: list[DeadLetterEntry] = []

    async def present() -> bool:
        found[:] = [e for e in await list_dead_letters(js) if e.letter.order.job.id == job_id]
        return bool(found)

    await wait_for(present, 60, f"the dead letter of {job_id}")
    assert len(found) == 1, found
    return found[0]


async def results_for(js: JetStreamContext, key: str) -> list[CommittedResult]:
    return [r async for r in iter_results(js) if r.key == key]


async def work_stream_empty(js: JetStreamContext) -> bool:
    return (await js.stream_info(subjects.STREAM_WORK)).state.messages == 0


async def submitted(js: JetStreamContext) -> int:
    return (await js.stream_info(subjects.STREAM_SUBMIT)).state.messages


async def put_letter(
    js: JetStreamContext,
    simulator: TargetSimulator,
    target: str,
    job_id: str,
    reason: str,
    key: str = "",
) -> None:
    """A dead letter written as the sink writes one (for reasons the built-in handlers
    do not produce, and for keys no current derivation gives)."""
    job = Job(id=job_id, url=page(simulator, "/page/1"))
    order = WorkOrder(
        job=job,
        target=target,
        key=key or idempotency_key(job.handler, job.url),
        max_attempts=3,
        timeout_s=5.0,
    )
    letter = DeadLetter(
        order=order,
        reason=reason,
        detail="written by the test",
        history=[AttemptRecord(attempt=1, worker="w-x", fence=1, outcome="blocked", reason=reason)],
    )
    await publish_durably(
        js,
        subjects.dead_letter(target, job_id),
        msgspec.json.encode(letter),
        msg_id=f"dlq-{job_id}",
        headers={"Jf-Reason": reason, "Jf-Job": job_id},
    )


@pytest.fixture
def slow_target(simulator: TargetSimulator) -> Iterator[Callable[[bool], None]]:
    """Switch the target's 'cause' on and off: every answer takes SLOW_S, longer than the
    JOB_TIMEOUT_S budget, so attempts time out; off, pages answer at once."""

    def switch(on: bool) -> None:
        simulator.set_latency(SLOW_S if on else 0.0)

    yield switch
    switch(False)


# --- 1. permanent failure ----------------------------------------------------------------


async def test_a_permanent_failure_is_tried_once_and_dead_lettered_with_its_reason(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    cli: Cli,
) -> None:
    js = nc.jetstream()
    job = Job(id="perm-1", url=page(simulator, "/missing/1"))
    await submit(js, settings, "demo", job)
    entry = await letter_of(js, "perm-1")
    await wait_for(lambda: work_stream_empty(js), 10, "the terminated message to go")

    assert simulator.counts()["by_path_kind"] == {"missing": 1}
    code, out, _ = await cli("list", "--json")
    assert code == 0
    listed = json.loads(out)
    assert len(listed) == 1
    item = listed[0]
    assert item["id"] == entry.id
    assert (item["job"], item["target"], item["reason"]) == ("perm-1", "demo", "http-404")
    assert item["url"] == job.url
    assert "404" in item["detail"]
    [attempt] = item["attempts"]
    assert set(attempt) == {
        "attempt",
        "worker",
        "identity",
        "fence",
        "duration_s",
        "outcome",
        "reason",
    }
    assert (attempt["attempt"], attempt["worker"], attempt["outcome"], attempt["reason"]) == (
        1,
        "w-0",
        "permanent",
        "http-404",
    )
    assert attempt["fence"] > 0 and attempt["duration_s"] >= 0 and attempt["identity"] == ""

    code, out, _ = await cli("list")
    assert code == 0
    header, _, row = out.splitlines()[:3]
    assert header.split() == ["id", "target", "job", "reason", "attempts"]
    assert row.split() == [str(entry.id), "demo", "perm-1", "http-404", "1"]

    code, out, _ = await cli("show", str(entry.id), "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["order"]["job"] == {"id": "perm-1", "url": job.url}
    assert shown["order"]["key"] == entry.letter.order.key
    assert shown["order"]["max_attempts"] == 3
    assert shown["attempts"] == item["attempts"]
    code, out, _ = await cli("show", str(entry.id))
    assert code == 0
    assert "http-404" in out and "perm-1" in out and "w-0" in out

    status = (await stack.status()).targets["demo"]
    assert (status.submitted, status.dead, status.queued, status.leased) == (1, 1, 0, 0)


async def test_an_undecodable_outcome_event_does_not_keep_a_job_from_its_dead_letter(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    # Outcome subjects are plain subjects anyone may publish on.
    js = nc.jetstream()
    await js.publish(subjects.outcome("demo", "perm-junk"), b"not an outcome")
    await submit(js, settings, "demo", Job(id="perm-junk", url=page(simulator, "/missing/2")))
    entry = await letter_of(js, "perm-junk")
    [attempt] = entry.letter.history
    assert (entry.letter.reason, attempt.outcome, attempt.worker) == (
        "http-404",
        "permanent",
        "w-0",
    )


def forged_outcome(job_id: str, fence: int, **fields: Any) -> bytes:
    """An outcome event as any NATS client could publish it for ``job_id`` of demo."""
    event: dict[str, Any] = {
        "job_id": job_id,
        "target": "demo",
        "worker": "w-forged",
        "attempt": 1,
        "kind": "retryable",
        "duration_s": 0.1,
        "versions": {"jetfleet": "0", "handler": "http.get@0"},
        "fence": fence,
    }
    event.update(fields)
    return json.dumps(event).encode()


async def test_item10_oversized_outcome_events_are_skipped_and_the_letter_lands(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    # Four well-formed events of 300 KB: copied into the history, they would make a
    # dead letter over the server's 1 MiB payload, which could then never be written.
    js = nc.jetstream()
    for fence in range(1, 5):
        event = forged_outcome("perm-big", 10_000 + fence, reason="x" * 300_000)
        await js.publish(subjects.outcome("demo", "perm-big"), event)
    await submit(js, settings, "demo", Job(id="perm-big", url=page(simulator, "/missing/4")))
    entry = await letter_of(js, "perm-big")
    assert [(a.worker, a.reason) for a in entry.letter.history] == [("w-0", "http-404")]


async def test_item10_an_outcome_event_naming_another_job_stays_out_of_the_history(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    subject = subjects.outcome("demo", "perm-mine")
    await js.publish(subject, forged_outcome("someone-else", 10_001))
    await js.publish(subject, forged_outcome("perm-mine", 10_002, duration_s=-5.0))
    await submit(js, settings, "demo", Job(id="perm-mine", url=page(simulator, "/missing/5")))
    entry = await letter_of(js, "perm-mine")
    assert [a.worker for a in entry.letter.history] == ["w-0"]


async def test_item10_a_flood_of_outcome_events_leaves_a_bounded_history(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    subject = subjects.outcome("demo", "perm-flood")
    for fence in range(1, MAX_HISTORY + 51):
        await js.publish(subject, forged_outcome("perm-flood", fence))
    await submit(js, settings, "demo", Job(id="perm-flood", url=page(simulator, "/missing/6")))
    entry = await letter_of(js, "perm-flood")
    history = entry.letter.history
    assert len(history) == MAX_HISTORY
    # The attempt that ended the job (the worker's own record) is kept, whatever its fence.
    assert [(a.worker, a.reason) for a in history if a.worker != "w-forged"] == [
        ("w-0", "http-404")
    ]


# --- 2. retryable failure ----------------------------------------------------------------


async def test_a_retryable_failure_is_retried_with_growing_delays_then_dead_lettered(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    await submit(js, settings, "demo", Job(id="err-1", url=page(simulator, "/error/1")))
    entry = await letter_of(js, "err-1")
    budget = settings.targets["demo"].max_attempts

    letter = entry.letter
    assert letter.reason == "attempts-exhausted"
    assert "http-500" in letter.detail
    assert [a.attempt for a in letter.history] == list(range(1, budget + 1))
    # Each attempt keeps its own reason; the letter's reason says why it stopped.
    assert [a.reason for a in letter.history] == ["http-500"] * budget
    assert len({a.fence for a in letter.history}) == budget  # one lease per attempt
    assert simulator.counts()["by_path_kind"] == {"error": budget}
    # The history came from the job's ledger entry (each failed attempt's release put
    # its record there) and the last attempt's report: no per-job outcome subject.
    kept = await (await js.key_value(subjects.BUCKET_FENCES)).get("err-1")
    ledger = msgspec.json.decode(kept.value or b"", type=JobLeaseHistory)
    assert ledger.attempts == letter.history[:-1]
    assert [(a.outcome, a.worker) for a in ledger.attempts] == [("retryable", "w-0")] * (budget - 1)
    per_job = [m async for m in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.*.*")]
    assert per_job == []

    # The server's timestamps of the attempts' outcome events: each wait is at least the
    # backoff floor for that attempt (jitter is 50-100 % of base * 2^(n-1)), which doubles.
    stamps: list[datetime] = []

    async def all_outcomes() -> bool:
        stamps[:] = [
            m.metadata.timestamp
            async for m in read_stream(js, subjects.STREAM_OUTCOMES, subjects.outcomes("demo"))
            if (m.headers or {}).get(JOB_HEADER) == "err-1"
        ]
        return len(stamps) == budget

    await wait_for(all_outcomes, 10, "every attempt's outcome event")
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
    floors = [0.5 * RETRY_BASE_S * 2**n for n in range(budget - 1)]
    assert all(gap >= floor for gap, floor in zip(gaps, floors, strict=True)), (gaps, floors)

    # Nothing of it is left in the work stream.
    await wait_for(lambda: work_stream_empty(js), 10, "the terminated message to go")
    status = (await stack.status()).targets["demo"]
    assert (status.queued, status.leased, status.dead, status.submitted) == (0, 0, 1, 1)


# --- 3. replay after the cause is fixed ----------------------------------------------------


async def test_replay_after_the_cause_is_fixed_commits_once_and_a_second_replay_does_nothing(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    slow_target: Callable[[bool], None],
    cli: Cli,
) -> None:
    """The cause is the target answering too slowly (simulator latency above the job's
    timeout): the attempt times out and, with a budget of one attempt, the job is
    dead-lettered. Setting the latency back to 0 fixes the cause without touching the job,
    which is what a replay must be able to rely on."""
    js = nc.jetstream()
    slow_target(True)
    job = Job(id="slow-7", url=page(simulator, "/page/7"), timeout_s=JOB_TIMEOUT_S, max_attempts=1)
    await submit(js, settings, "demo", job)
    entry = await letter_of(js, "slow-7")
    assert entry.letter.reason == "attempts-exhausted"
    assert "timeout" in entry.letter.detail
    assert await results_for(js, entry.letter.order.key) == []

    slow_target(False)
    code, out, _ = await cli("replay", str(entry.id))
    assert code == 0
    new_id = out.strip()
    assert new_id == replay_job_id("slow-7", entry.id) == f"slow-7.r{entry.id}"

    async def committed() -> bool:
        return len(await results_for(js, entry.letter.order.key)) == 1

    await wait_for(committed, 30, "the replay's commit")
    [result] = await results_for(js, entry.letter.order.key)
    assert result.job_id == new_id and result.attempt == 1  # a fresh attempt budget
    assert result.key == entry.letter.order.key
    submission = await js.get_msg(subjects.STREAM_SUBMIT, subject=subjects.submit("demo"))
    assert (submission.headers or {}).get(REPLAY_HEADER) == str(entry.id)

    # The same letter again: the same new id, dropped by the submit stream.
    before = await submitted(js)
    code, out, _ = await cli("replay", str(entry.id))
    assert (code, out.strip()) == (0, new_id)
    assert await submitted(js) == before
    await wait_for(lambda: work_stream_empty(js), 10, "the work stream to empty")
    assert len(await results_for(js, entry.letter.order.key)) == 1
    assert simulator.counts()["by_path_kind"] == {"page": 2}  # the timed-out try + the replay
    status = (await stack.status()).targets["demo"]
    assert (status.submitted, status.committed, status.dead) == (2, 1, 1)
    assert (status.queued, status.leased) == (0, 0)


# --- 4. replay of work that is already done ------------------------------------------------


async def test_replay_of_a_letter_whose_key_is_committed_does_nothing(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    slow_target: Callable[[bool], None],
) -> None:
    js = nc.jetstream()
    slow_target(True)
    url = page(simulator, "/page/9")
    await submit(
        js, settings, "demo", Job(id="late-9", url=url, timeout_s=JOB_TIMEOUT_S, max_attempts=1)
    )
    entry = await letter_of(js, "late-9")
    slow_target(False)
    # The same unit of work (same key), submitted anew under another id, is committed.
    await submit(js, settings, "demo", Job(id="fresh-9", url=url))
    key = entry.letter.order.key

    async def committed() -> bool:
        return len(await results_for(js, key)) == 1

    await wait_for(committed, 30, "the fresh job's commit")
    requests = simulator.counts()["total"]
    worker = stack.workers[0]
    done_before = worker.stats["already-done"]

    [new_id] = await replay(js, settings, [entry])

    async def answered_already_done() -> bool:
        return worker.stats["already-done"] > done_before and await work_stream_empty(js)

    await wait_for(answered_already_done, 30, "the leaser's already-done for the replay")
    [result] = await results_for(js, key)
    assert result.job_id == "fresh-9"
    assert simulator.counts()["total"] == requests  # no request to the target
    assert [e.letter.order.job.id for e in await list_dead_letters(js)] == ["late-9"]
    assert new_id == f"late-9.r{entry.id}"
    status = (await stack.status()).targets["demo"]
    assert (status.queued, status.leased) == (0, 0)


# --- 5. purge -----------------------------------------------------------------------------


async def test_purge_asks_refuses_without_a_terminal_and_records_what_it_removed(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    cli: Cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    js = nc.jetstream()
    await submit(
        js,
        settings,
        "demo",
        Job(id="gone-1", url=page(simulator, "/missing/1")),
        Job(id="gone-2", url=page(simulator, "/missing/2")),
    )
    await submit(js, settings, "other", Job(id="gone-3", url=page(simulator, "/missing/3")))
    for job_id in ("gone-1", "gone-2", "gone-3"):
        await letter_of(js, job_id)

    # No terminal and no --yes: refused, even with the right word piped in.
    monkeypatch.setattr("sys.stdin", io.StringIO("purge\n"))
    code, _, err = await cli("purge")
    assert code == 1 and "not a terminal" in err
    # A terminal, and the wrong answer.
    monkeypatch.setattr("sys.stdin", _Terminal("yes\n"))
    code, _, err = await cli("purge")
    assert code == 1
    assert "type 'purge' to remove 3 dead letter(s)" in err and "nothing removed" in err
    assert len(await list_dead_letters(js)) == 3
    assert await purged_counts(js, TARGETS) == {"demo": 0, "other": 0}

    # A terminal, the right answer, one target.
    monkeypatch.setattr("sys.stdin", _Terminal("purge\n"))
    code, out, err = await cli("purge", "--target", "other")
    assert code == 0 and "remove 1 dead letter(s) of other" in err
    assert "purged 1 dead letter(s) of other" in out
    assert await purged_counts(js, TARGETS) == {"demo": 0, "other": 1}

    # --yes needs no terminal.
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, out, _ = await cli("purge", "--yes")
    assert code == 0 and "purged 2 dead letter(s)" in out
    assert await list_dead_letters(js) == []
    assert await purged_counts(js, TARGETS) == {"demo": 2, "other": 1}
    code, out, _ = await cli("purge", "--yes")
    assert (code, out.strip()) == (0, "no dead letters to purge")

    # Conservation still adds up: status counts purged dead letters as dead.
    status = await stack.status()
    purged = await purged_counts(js, TARGETS)
    assert status.conserved and status.unaccounted == 0
    for name in TARGETS:
        counts = status.targets[name]
        assert counts.dead == purged[name]
        assert counts.submitted == counts.dead + counts.committed + (
            counts.queued + counts.leased + counts.rejected
        )


async def test_purge_counts_add_up_under_concurrent_purges(
    settings: Settings, nc: NatsClient, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    for n in range(20):
        await put_letter(js, simulator, "demo", f"letter-{n}", "http-404")
    removed = await asyncio.gather(
        *(purge(js, "demo") for _ in range(5)), *(purge(js) for _ in range(5))
    )
    assert sum(removed) == 20
    # The counter is a compare-and-set read-modify-write: concurrent adds are not lost.
    await asyncio.gather(*(record_purged(js, "other", 1) for _ in range(10)))
    assert await purged_counts(js, TARGETS) == {"demo": 20, "other": 10}


# --- 6. filters ---------------------------------------------------------------------------


async def test_list_filters_by_target_and_reason(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    cli: Cli,
) -> None:
    js = nc.jetstream()
    await submit(
        js,
        settings,
        "demo",
        Job(id="d-missing", url=page(simulator, "/missing/4")),
        Job(id="d-selector", url=page(simulator, "/noselector/5"), args={"expect": 'id="content"'}),
    )
    await submit(js, settings, "other", Job(id="o-missing", url=page(simulator, "/missing/6")))
    await put_letter(js, simulator, "other", "o-challenged", "blocked:challenged")
    for job_id in ("d-missing", "d-selector", "o-missing", "o-challenged"):
        await letter_of(js, job_id)

    async def jobs(*args: str) -> list[str]:
        code, out, _ = await cli("list", "--json", *args)
        assert code == 0
        return sorted(item["job"] for item in json.loads(out))

    assert await jobs("--target", "demo") == ["d-missing", "d-selector"]
    assert await jobs("--target", "other") == ["o-challenged", "o-missing"]
    assert await jobs("--reason", "http-404") == ["d-missing", "o-missing"]
    assert await jobs("--target", "demo", "--reason", "http-404") == ["d-missing"]
    assert await jobs("--reason", "blocked") == ["o-challenged"]  # the part before ':'
    assert await jobs("--reason", "blocked:challenged") == ["o-challenged"]
    assert await jobs("--reason", "block") == []
    assert await jobs("--target", "other", "--reason", "selector-removed") == []

    code, out, _ = await cli("list", "--json", "--reason", "selector-removed")
    [item] = json.loads(out)
    assert item["job"] == "d-selector" and "content" in item["detail"]
    assert [a["reason"] for a in item["attempts"]] == ["selector-removed"]

    code, _, err = await cli("list", "--target", "nowhere")
    assert code == 2 and "unknown target 'nowhere'" in err


# --- replay refusals and CLI errors -------------------------------------------------------


async def test_replay_refuses_a_letter_whose_key_it_cannot_keep_and_submits_nothing(
    settings: Settings, nc: NatsClient, simulator: TargetSimulator, cli: Cli
) -> None:
    js = nc.jetstream()
    await put_letter(js, simulator, "demo", "fine", "http-500")
    await put_letter(js, simulator, "demo", "old-key", "http-500", key="u-" + "0" * 40)
    entries = await list_dead_letters(js, "demo")
    before = await submitted(js)
    with pytest.raises(JetfleetError, match="would get idempotency key"):
        await replay(js, settings, entries)
    assert await submitted(js) == before  # checked before anything is published

    code, _, err = await cli("replay", "--target", "demo")
    assert code == 2 and "refusing" in err
    assert await submitted(js) == before

    code, out, _ = await cli("replay", "--target", "demo", "--reason", "http-404")
    assert code == 1 and out == ""
    code, _, err = await cli("replay", "1", "--target", "demo")
    assert code == 2 and "exactly one of ID or --target" in err
    code, _, err = await cli("replay")
    assert code == 2 and "exactly one of ID or --target" in err
    code, _, err = await cli("show", "999")
    assert code == 2 and "no dead letter 999" in err
    with pytest.raises(JetfleetError, match="no dead letter 999"):
        await get_dead_letter(js, 999)


def test_every_dlq_command_has_help(dlq_cli: None, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["dlq"], ["dlq", "list"], ["dlq", "show"], ["dlq", "replay"], ["dlq", "purge"]):
        with pytest.raises(SystemExit) as stop:
            cli_main.build_parser().parse_args([*args, "--help"])
        assert stop.value.code == 0
        assert "usage: jetfleet " + " ".join(args) in capsys.readouterr().out


def test_the_main_parser_registers_dlq() -> None:
    """jetfleet/cli/main.py must call ``dlq_commands.register(commands)``."""
    assert "dlq" in _subcommands(cli_main.build_parser()).choices, (
        "add `dlq_commands.register(commands)` to build_parser in jetfleet/cli/main.py"
    )


async def test_a_dead_lettered_job_delivered_again_is_terminated_not_run(
    settings: Settings, nc: NatsClient, stack: InProcessStack, simulator: TargetSimulator
) -> None:
    """If the terminate after a dead letter is lost, the redelivered job must not run a
    second time (it would end both dead and committed): the leaser refuses it and the
    worker terminates the delivery."""
    js = nc.jetstream()
    job = Job(id="dead-again", url=page(simulator, "/missing/7"))
    await submit(js, settings, "demo", job)
    await letter_of(js, "dead-again")
    await wait_for(lambda: work_stream_empty(js), 10, "the terminated message to go")
    # The same work order delivered again, as after a lost +TERM.
    order = WorkOrder(job=job, target="demo", key=job_key(job), max_attempts=3, timeout_s=5.0)
    await js.publish(subjects.work("demo", "normal"), msgspec.json.encode(order))
    worker = stack.workers[0]

    async def refused_and_gone() -> bool:
        return worker.stats["refused:dead-lettered"] == 1 and await work_stream_empty(js)

    await wait_for(refused_and_gone, 10, "the redelivered dead job to be terminated")
    assert simulator.counts()["by_path_kind"] == {"missing": 1}  # not fetched again
    status = await stack.status()
    assert status.targets["demo"].dead == 1 and status.targets["demo"].committed == 0


@pytest.mark.parametrize("dot_at", [99, 98])
def test_a_replay_id_is_a_valid_job_id_wherever_a_long_id_is_cut(dot_at: int) -> None:
    original = "a" * dot_at + "." + "b" * (127 - dot_at)
    msgspec.convert({"id": original, "url": "http://t/"}, Job)
    new_id = replay_job_id(original, 123456)
    job = msgspec.convert({"id": new_id, "url": "http://t/"}, Job)  # raises if invalid
    assert job.id.endswith(".r123456") and job.id.startswith("a" * dot_at)


async def test_purge_without_a_target_empties_every_targets_letters(
    settings: Settings, nc: NatsClient, simulator: TargetSimulator
) -> None:
    js = nc.jetstream()
    for n in range(6):
        await put_letter(js, simulator, TARGETS[n % 2], f"every-{n}", "http-404")
    assert await dead_letter_total(js) == 6 and await dead_letter_total(js, "other") == 3
    assert await purge(js) == 6
    assert await dead_letter_total(js) == 0
    assert await purged_counts(js, TARGETS) == {"demo": 3, "other": 3}


@pytest.mark.parametrize(
    "stray_subject", ["jf.dlq.demo", "jf.dlq.Not_A_Target.job-1"], ids=["no-job-id", "bad-target"]
)
async def test_item10_purge_ends_on_a_letter_whose_subject_names_no_job(
    settings: Settings, nc: NatsClient, simulator: TargetSimulator, stray_subject: str
) -> None:
    # Anyone may publish on jf.dlq.>: a message whose subject has no job id part (or no
    # usable target) is no job's dead letter, yet it is the oldest one purge finds.
    js = nc.jetstream()
    await js.publish(stray_subject, b'{"not": "a dead letter"}')
    await put_letter(js, simulator, "demo", "real-1", "http-404")
    removed = await asyncio.wait_for(purge(js), 20)
    assert removed == 2
    assert await dead_letter_total(js) == 0
    # Only the job's letter was counted as dead, so only it is recorded as purged: the
    # stray was never in the status's dead count, and recording it would unbalance it.
    assert await purged_counts(js, TARGETS) == {"demo": 1, "other": 0}
