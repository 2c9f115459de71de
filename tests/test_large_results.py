"""Issue 8 item 6: results larger than a message.

A body over the server's max_payload (1 MiB) used to raise inside the report: the page
was fetched three times and the job dead-lettered with three ``ok`` attempts. A body
above ``fleet.max_inline_bytes`` now goes to the ``jf-result-objects`` object store and
the result refers to it; a body above the target's own ``max_body_bytes`` fails the job
permanently as ``result-too-large`` after one request; a worker whose inline results
could exceed the server's max_payload refuses to start.

Real servers: a fresh nats-server (default max_payload, 1 MiB), the target simulator
(counting every request on arrival), scheduler + leaser + sink + one worker in this
process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, DataOutput, DeadLetter, HandlerOutput, HttpFetch
from nats.js import JetStreamContext

import jetfleet.cli.main as cli_main
from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import ConfigError
from jetfleet.results import iter_results, stored_bytes, with_stored_body
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.simulator.pages import big_html
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from jetfleet.worker import HandlerContext, Worker, handler
from tests.conftest import make_settings, wait_for
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack

MIB = 1024 * 1024
HUGE_OUTPUT = "tests.huge-output"
BROKEN_TEXT = "tests.broken-text"
BIG = 3 * MIB
SMALL = 100_000
CAP = 2 * MIB


@handler(HUGE_OUTPUT)
async def huge_output(ctx: HandlerContext) -> HandlerOutput:
    """A user handler that puts 2 MiB into its output instead of the object store."""
    return DataOutput(data={"blob": "x" * (2 * MIB)})


@handler(BROKEN_TEXT)
async def broken_text(ctx: HandlerContext) -> HandlerOutput:
    """A user handler whose output holds a lone UTF-16 surrogate (a page's broken text):
    no JSON encoder can write it."""
    return DataOutput(data={"title": "caf\ud800"})


@dataclass
class Env:
    settings: Settings
    js: JetStreamContext
    sim: TargetSimulator


@pytest.fixture
async def env(nats_url: str, redis_url: str) -> AsyncIterator[Env]:
    async with TargetSimulator(SimulatorConfig()) as sim:
        targets = {
            "pages": target(sim.base_url),
            "capped": target(sim.base_url, max_body_bytes=CAP),
        }
        settings = queue_settings(nats_url, redis_url, targets, concurrency=2)
        fleet = msgspec.structs.replace(
            settings.fleet, handlers=(*settings.fleet.handlers, HUGE_OUTPUT, BROKEN_TEXT)
        )
        settings = msgspec.structs.replace(settings, fleet=fleet)
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        try:
            yield Env(settings, stack.connections[0].jetstream(), sim)
        finally:
            await stack.stop()


async def results_of(js: JetStreamContext, name: str) -> dict[str, CommittedResult]:
    return {r.job_id: r async for r in iter_results(js, name)}


async def test_item6_a_3_mib_page_commits_once_from_one_request_and_comes_back_intact(
    env: Env,
) -> None:
    paths = [f"/big/1?bytes={BIG}", f"/big/2?bytes={SMALL}"]
    big_job, small_job = await submit_paths(
        env.js, env.settings, "pages", paths, "big", store_body=True
    )

    async def both_committed() -> bool:
        return await committed(env.js, "pages") == 2

    # Before the fix the report could not be sent: three fetches, then a dead letter.
    await wait_for(both_committed, 30, "both pages to commit")
    assert env.sim.counts()["by_path_kind"] == {"big": 2}  # one request per page
    assert await dead(env.js, "pages") == 0
    results = await results_of(env.js, "pages")
    big = results[big_job.id].output
    assert isinstance(big, HttpFetch) and big.body is None, big
    assert big.body_object is not None and big.body_object.size == BIG, big
    data = await stored_bytes(env.js, big.body_object)
    assert data == big_html(1, BIG)
    assert big.body_sha256 == big.body_object.sha256 and big.body_bytes == BIG
    inline = await with_stored_body(env.js, results[big_job.id])
    assert isinstance(inline.output, HttpFetch) and inline.output.body == data.decode()
    # Below fleet.max_inline_bytes a body still rides in the result itself.
    small = results[small_job.id].output
    assert isinstance(small, HttpFetch) and small.body_object is None, small
    assert small.body is not None and small.body.encode() == big_html(2, SMALL)


async def test_item6_results_export_with_bodies_puts_a_stored_body_back_inline(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (job,) = await submit_paths(
        env.js, env.settings, "pages", [f"/big/4?bytes={BIG}"], "cli", store_body=True
    )

    async def one_committed() -> bool:
        return await committed(env.js, "pages") == 1

    await wait_for(one_committed, 30, "the page to commit")
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(env.settings))
    argv = ["--config", str(config), "--stack", str(tmp_path / "no-stack"), "results", "export"]
    capsys.readouterr()
    plain = await asyncio.to_thread(cli_main.main, [*argv, "--target", "pages"])
    (line,) = capsys.readouterr().out.splitlines()
    assert plain == 0 and "body_object" in json.loads(line)["output"], line[:500]
    code = await asyncio.to_thread(cli_main.main, [*argv, "--target", "pages", "--bodies"])
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    assert code == 0, err
    record = json.loads(line)
    assert record["job_id"] == job.id
    assert record["output"]["body"] == big_html(4, BIG).decode()


async def test_item6_a_body_over_the_targets_cap_fails_as_result_too_large_after_one_request(
    env: Env,
) -> None:
    await submit_paths(env.js, env.settings, "capped", [f"/big/3?bytes={BIG}"], "huge")

    async def dead_lettered() -> bool:
        return await dead(env.js, "capped") == 1

    await wait_for(dead_lettered, 30, "the oversized page to be dead-lettered")
    decoder = msgspec.json.Decoder(DeadLetter)
    (letter,) = [
        decoder.decode(m.data)
        async for m in read_stream(env.js, subjects.STREAM_DLQ, subjects.dlq("capped"))
    ]
    assert letter.reason == "result-too-large", letter
    assert "targets.capped.max_body_bytes" in letter.detail, letter.detail
    assert [r.outcome for r in letter.history] == ["permanent"], letter.history
    assert env.sim.counts()["total"] == 1
    assert await committed(env.js, "capped") == 0


async def test_item6_a_handler_output_too_large_for_a_message_fails_once_not_thrice(
    env: Env,
) -> None:
    await submit_paths(env.js, env.settings, "pages", ["/page/1"], "blob", handler=HUGE_OUTPUT)

    async def dead_lettered() -> bool:
        return await dead(env.js, "pages") == 1

    # Sent as it is, the report would raise inside the worker and the job be run again.
    await wait_for(dead_lettered, 30, "the oversized output to be dead-lettered")
    decoder = msgspec.json.Decoder(DeadLetter)
    (letter,) = [
        decoder.decode(m.data)
        async for m in read_stream(env.js, subjects.STREAM_DLQ, subjects.dlq("pages"))
    ]
    assert letter.reason == "result-too-large", letter
    assert "ctx.objects.put" in letter.detail, letter.detail
    assert [(r.attempt, r.outcome) for r in letter.history] == [(1, "permanent")], letter


async def test_an_output_no_encoder_can_write_fails_once_with_its_reason_not_forever(
    env: Env,
) -> None:
    await submit_paths(env.js, env.settings, "pages", ["/page/2"], "text", handler=BROKEN_TEXT)

    async def dead_lettered() -> bool:
        return await dead(env.js, "pages") == 1

    # Encoded in the report, it used to raise outside the handler's error handling: the
    # job was never settled and ran again until JetStream gave up on it.
    await wait_for(dead_lettered, 30, "the unencodable output to be dead-lettered")
    decoder = msgspec.json.Decoder(DeadLetter)
    (letter,) = [
        decoder.decode(m.data)
        async for m in read_stream(env.js, subjects.STREAM_DLQ, subjects.dlq("pages"))
    ]
    assert letter.reason == "output-unencodable", letter
    assert [(r.attempt, r.outcome) for r in letter.history] == [(1, "permanent")], letter


async def test_item6_a_worker_refuses_to_start_when_an_inline_result_could_exceed_max_payload(
    nats_url: str, redis_url: str
) -> None:
    targets = {"demo": target("http://127.0.0.1:1/")}
    settings = make_settings(nats_url, redis_url, targets, max_inline_bytes=2 * MIB)
    nc = await connect_nats(settings.nats, "too-big")
    try:
        await declare(nc.jetstream(), settings)
        worker = Worker(settings, nc, "w-big")
        with pytest.raises(ConfigError) as info:
            await worker.start()
        message = str(info.value)
        assert "fleet.max_inline_bytes" in message, message
        assert f"max_payload ({nc.max_payload})" in message, message
        assert "set fleet.max_inline_bytes to at most" in message, message
        await worker.drain(1.0)
    finally:
        await nc.close()
