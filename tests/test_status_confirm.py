"""`jetfleet status` reads again before it flags a difference, so a job caught between
two states is not reported as missing, and a lasting difference still is."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.data_commands import _status
from jetfleet.ops.status import (
    CONFIRM_READS,
    FleetStatus,
    TargetCounts,
    confirmed_status,
    read_until_conserved,
)
from jetfleet.settings import Settings
from tests.leasing import order_for
from tests.stack import InProcessStack


def _reads(*offsets: int) -> tuple[list[FleetStatus], Callable[[], Awaitable[FleetStatus]]]:
    answers = [
        FleetStatus(totals=TargetCounts(), targets={}, unaccounted=n, conserved=n == 0)
        for n in offsets
    ]
    served: list[FleetStatus] = []

    async def read() -> FleetStatus:
        served.append(answers[len(served)])
        return served[-1]

    return served, read


async def test_a_moments_difference_is_read_again_and_not_flagged() -> None:
    served, read = _reads(2, 0, 5)
    status = await read_until_conserved(read, reads=3, gap_s=0.01)
    assert status.conserved and status.reads == 2 and len(served) == 2


async def test_a_difference_in_every_read_is_flagged() -> None:
    served, read = _reads(1, -1, 1)
    status = await read_until_conserved(read, reads=3, gap_s=0.01)
    assert not status.conserved and status.reads == 3 and status.unaccounted == 1
    assert len(served) == 3


async def test_a_status_that_adds_up_is_read_once() -> None:
    served, read = _reads(0)
    status = await read_until_conserved(read, reads=3, gap_s=10.0)
    assert status.conserved and status.reads == 1 and len(served) == 1


async def test_at_least_one_read_is_asked_for() -> None:
    _, read = _reads(0)
    with pytest.raises(ValueError, match="at least 1"):
        await read_until_conserved(read, reads=0, gap_s=0.0)


async def test_a_job_nobody_submitted_is_flagged_by_the_cli(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (await confirmed_status(nc.jetstream(), settings)).reads == 1
    # A work order that skipped the submit stream: queued, but never submitted.
    order = order_for(settings, "/stray")
    await nc.jetstream().publish(subjects.work("demo", "normal"), msgspec.json.encode(order))
    status = await confirmed_status(nc.jetstream(), settings)
    assert (status.conserved, status.reads, status.unaccounted) == (False, CONFIRM_READS, -1)
    assert await _status(settings, as_json=False) == 0
    err = capsys.readouterr().err
    assert f"in each of {CONFIRM_READS} reads over 0.5 s (last off by -1)" in err
