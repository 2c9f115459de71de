"""Issue 8 item 10 (the worker's half): a worker re-checks that a job's URL is under its
target's ``base_url``, and follows redirects only within the target unless the target
lists more hosts in ``redirect_hosts``.

Real servers: a fresh nats-server, two target simulators (the target, and another site
on another port, each counting every request on arrival), scheduler + leaser + sink +
one worker in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest
from jetfleet.schemas import DeadLetter, HttpFetch, Job, WorkOrder
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.errors import ConfigError
from jetfleet.publish import publish_durably
from jetfleet.results import iter_results
from jetfleet.settings import Settings, load_settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import wait_for
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack

HOME, OPEN = "home", "open"


@dataclass
class Env:
    settings: Settings
    js: JetStreamContext
    home: TargetSimulator
    elsewhere: TargetSimulator

    async def letters(self) -> list[DeadLetter]:
        decoder = msgspec.json.Decoder(DeadLetter)
        return [
            decoder.decode(m.data)
            async for m in read_stream(self.js, subjects.STREAM_DLQ, "jf.dlq.>")
        ]

    async def wait_dead(self, name: str) -> DeadLetter:
        async def one_dead() -> bool:
            return await dead(self.js, name) == 1

        await wait_for(one_dead, 30, f"a dead letter on {name}")
        (letter,) = await self.letters()
        return letter


@pytest.fixture
async def env(nats_url: str, redis_url: str) -> AsyncIterator[Env]:
    async with (
        TargetSimulator(SimulatorConfig()) as home,
        TargetSimulator(SimulatorConfig()) as elsewhere,
    ):
        other = urlsplit(elsewhere.base_url).netloc
        targets = {
            HOME: target(home.base_url),
            # The same site, but allowed to follow redirects to the other one.
            OPEN: target(home.base_url, redirect_hosts=(other,)),
        }
        settings = queue_settings(nats_url, redis_url, targets, concurrency=2)
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        try:
            yield Env(settings, stack.connections[0].jetstream(), home, elsewhere)
        finally:
            await stack.stop()


async def test_item10_a_job_outside_its_targets_base_url_fails_permanently_unsent(
    env: Env,
) -> None:
    # Published straight onto the work subject, as any NATS client can: admission, which
    # would have refused it, never saw it.
    job = Job(id="stray", url=env.elsewhere.base_url + "/page/1")
    order = WorkOrder(job=job, target=HOME, key="stray-key", max_attempts=3, timeout_s=5.0)
    await publish_durably(
        env.js, subjects.work(HOME, "normal"), msgspec.json.encode(order), msg_id="stray"
    )
    letter = await env.wait_dead(HOME)
    assert letter.reason == "url-outside-target", letter
    assert "base_url" in letter.detail and "nothing was sent" in letter.detail, letter.detail
    assert len(letter.history) == 1, letter.history  # permanent at once: one attempt
    assert env.elsewhere.counts()["total"] == 0
    assert env.home.counts()["total"] == 0


async def test_item10_a_redirect_off_the_target_is_not_followed(env: Env) -> None:
    away = env.elsewhere.base_url + "/page/1"
    await submit_paths(env.js, env.settings, HOME, [f"/redirect/1?to={away}"], "away")
    letter = await env.wait_dead(HOME)
    assert letter.reason == "redirect-off-target", letter
    assert away in letter.detail and "redirect_hosts" in letter.detail, letter.detail
    assert env.home.counts()["total"] == 1  # one request, no retry of a permanent failure
    assert env.elsewhere.counts()["total"] == 0


async def test_item10_redirects_within_the_target_and_to_listed_hosts_are_followed(
    env: Env,
) -> None:
    away = env.elsewhere.base_url + "/page/3"
    await submit_paths(env.js, env.settings, HOME, ["/redirect/1?to=/page/2"], "near")
    await submit_paths(env.js, env.settings, OPEN, [f"/redirect/1?to={away}"], "listed")

    async def both_committed() -> bool:
        return await committed(env.js, HOME) == 1 and await committed(env.js, OPEN) == 1

    await wait_for(both_committed, 30, "both redirected jobs to commit")
    finals = {}
    async for result in iter_results(env.js):
        assert isinstance(result.output, HttpFetch), result.output
        assert result.output.status == 200, result.output
        finals[result.target] = result.output.final_url
    assert finals == {HOME: env.home.base_url + "/page/2", OPEN: away}
    assert env.home.counts()["by_path_kind"] == {"redirect": 2, "page": 1}
    assert env.elsewhere.counts()["total"] == 1
    assert await dead(env.js, HOME) == 0 and await dead(env.js, OPEN) == 0


@pytest.mark.parametrize("host", ["https://cdn.example.org", "CDN.example.org", "cdn/x", ""])
def test_item10_a_redirect_host_that_is_not_a_host_is_refused_naming_the_key(
    tmp_path: Path, host: str
) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(
        f'[targets.demo]\nbase_url = "https://example.org/"\nredirect_hosts = ["{host}"]\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert "targets.demo.redirect_hosts" in str(info.value)
    assert "host:port" in str(info.value)
