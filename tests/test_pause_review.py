"""Adversarial review of the pause switch (issue #11): a pause keeps to the scope it
names. Real NATS."""

from __future__ import annotations

from jetfleet.schemas.control import PauseRecord
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.pause_book import PauseBook, pause_key
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings


async def test_a_worker_pause_does_not_cover_a_worker_named_like_its_key(
    settings: Settings, nc: NatsClient
) -> None:
    del settings
    js = nc.jetstream()
    control = await js.key_value(subjects.BUCKET_CONTROL)
    book = PauseBook(js, control)
    await book.start()
    try:
        # "a.b" is not a plain key token, so its key is spelled in base32 ...
        spelled = pause_key("worker", "a.b").rsplit(".", 1)[-1]
        assert spelled.startswith("b32-")
        # ... and a worker whose id is that very spelling is another worker.
        await book.put(PauseRecord(scope="worker", name="a.b", by="test"))
        now = await ServerClock(nc).now()
        assert await book.covering("demo", "", "a.b", "", now) is not None
        assert await book.covering("demo", "", spelled, "", now) is None
        # Resuming the other worker leaves the pause of "a.b" alone.
        assert await book.remove("worker", spelled) is None
        assert await book.covering("demo", "", "a.b", "", now) is not None
    finally:
        await book.stop()
