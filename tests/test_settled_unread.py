"""The leaser's ``settled`` check when the job's history cannot be read: it answers
``busy`` (ask again), never nothing. Nothing would let ``already_done`` answer next, and
a job sealed dead whose term was lost, whose key a replay committed since, would be acked
as that commit's duplicate: both dead and committed (I3, I10)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from jetfleet.schemas.lease import LeaseRefusal
from jetfleet.services.leaser.checks import GrantContext, settled
from nats.aio.client import Client as NatsClient

from jetfleet.lease_client import BUSY
from jetfleet.lease_store import HistoryEntry
from jetfleet.settings import Settings
from tests.leasing import ask, order_for


async def test_a_history_that_cannot_be_read_answers_busy_not_nothing(
    settings: Settings, nc: NatsClient
) -> None:
    failed: asyncio.Future[HistoryEntry] = asyncio.get_running_loop().create_future()
    failed.set_exception(TimeoutError("no leader for KV_jf-fences"))
    nobody = cast(Any, None)  # settled reads only the history
    ctx = GrantContext(
        ask(order_for(settings, "/page/7")),
        settings,
        nc.jetstream(),
        nobody,
        nobody,
        failed,
        nobody,
    )
    verdict = await settled(ctx)
    assert isinstance(verdict, LeaseRefusal), verdict
    assert verdict.reason == BUSY and verdict.retry_after_s > 0
    assert "history could not be read" in verdict.detail
