"""Bad input over real NATS JetStream: every bad submission is answered, kept on
``jf.rejected.<target>`` with its reason and bytes, counted, and never costs a valid job.

Each bad input goes in twice: through ``jetfleet.client.submit_raw`` (which also answers
at once) and as a bare ``js.publish`` (no client, no message id), interleaved with valid
jobs submitted both ways.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
from jetfleet.schemas import Job, Rejection, SinkReply, WorkOrder
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.client import jobs_for, submit_jobs, submit_raw
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream
from tests.conftest import wait_for
from tests.stack import InProcessStack

_rejection = msgspec.json.Decoder(Rejection)
_reply = msgspec.json.Decoder(SinkReply)


@dataclass(frozen=True)
class Bad:
    """One bad submission and what admission must say about it."""

    token: str
    """The subject token after ``jf.submit.``."""
    payload: bytes
    reason: str
    hints: tuple[str, ...]
    """Fragments the rejection message must contain (what was wrong, what to fix)."""
    job_id: str = ""
    filed_under: str = ""
    """The token of ``jf.rejected.<token>`` it is kept under; defaults to ``token``."""

    @property
    def rejected_subject(self) -> str:
        return subjects.rejected(self.filed_under or self.token)


MakeBad = Callable[[Settings, str], Bad]


def _job(settings: Settings, tag: str, **fields: object) -> dict[str, object]:
    body: dict[str, object] = {
        "id": f"bad-{tag}",
        "url": settings.targets["demo"].base_url + f"bad/{tag}",
    }
    body.update(fields)
    return body


def _encode(body: object) -> bytes:
    return json.dumps(body).encode()


def invalid_json(settings: Settings, tag: str) -> Bad:
    return Bad(
        "demo", f'{{"id": "bad-{tag}", "url": '.encode(), "invalid-json", ("not valid JSON",)
    )


def invalid_utf8(settings: Settings, tag: str) -> Bad:
    return Bad("demo", b"\xff\xfe" + tag.encode(), "invalid-json", ("not valid JSON",))


def empty_payload(settings: Settings, tag: str) -> Bad:
    # Both copies are b"": told apart by how many rejections carry it.
    return Bad("demo", b"", "invalid-json", ("not valid JSON",))


def wrong_type(settings: Settings, tag: str) -> Bad:
    body = _job(settings, tag, max_attempts="three")
    return Bad(
        "demo",
        _encode(body),
        "invalid-job",
        ("Job schema", "Expected `int`, got `str`", "$.max_attempts"),
    )


def wrong_type_id(settings: Settings, tag: str) -> Bad:
    body = _job(settings, tag)
    body["id"] = 12345
    body["args"] = {"tag": tag}
    return Bad(
        "demo", _encode(body), "invalid-job", ("Job schema", "Expected `str`, got `int`", "$.id")
    )


def unsafe_id(settings: Settings, tag: str) -> Bad:
    # A job id ends up in message ids and KV keys: no spaces, wildcards or line breaks.
    body = _job(settings, tag)
    body["id"] = f"evil {tag}\r\nX-Injected: 1 *>"
    return Bad("demo", _encode(body), "invalid-job", ("Job schema", "$.id"))


def not_an_object(settings: Settings, tag: str) -> Bad:
    return Bad(
        "demo",
        _encode([tag, "http://x/"]),
        "invalid-job",
        ("Job schema", "Expected `object`, got `array`"),
    )


def missing_url(settings: Settings, tag: str) -> Bad:
    body = _job(settings, tag)
    del body["url"]
    return Bad("demo", _encode(body), "invalid-job", ("Job schema", "missing required field `url`"))


def unknown_field(settings: Settings, tag: str) -> Bad:
    return Bad(
        "demo",
        _encode(_job(settings, tag, colour="blue")),
        "invalid-job",
        ("colour",),
        job_id=f"bad-{tag}",
    )


def bad_tier(settings: Settings, tag: str) -> Bad:
    return Bad(
        "demo", _encode(_job(settings, tag, tier="urgent")), "invalid-job", ("Job schema", "$.tier")
    )


def unknown_target(settings: Settings, tag: str) -> Bad:
    return Bad(
        "nosuch",
        _encode(_job(settings, tag)),
        "unknown-target",
        ("'nosuch' is not declared", "known: demo", "[targets.nosuch]"),
    )


def url_outside_target(settings: Settings, tag: str) -> Bad:
    url = f"http://elsewhere.invalid/{tag}"
    return Bad(
        "demo",
        _encode(_job(settings, tag, url=url)),
        "url-outside-target",
        (
            url,
            "not under target 'demo'",
            settings.targets["demo"].base_url,
            "submit it to the target that owns it",
        ),
        job_id=f"bad-{tag}",
    )


def not_http_url(settings: Settings, tag: str) -> Bad:
    url = f"ftp://elsewhere.invalid/{tag}"
    return Bad(
        "demo",
        _encode(_job(settings, tag, url=url)),
        "invalid-url",
        (url, "absolute http(s) URL"),
        job_id=f"bad-{tag}",
    )


def oversized(settings: Settings, tag: str) -> Bad:
    # A well-formed job, 100 KB: over fleet.max_job_bytes (64 KiB), under NATS's 1 MB.
    payload = _encode(_job(settings, tag, args={"blob": "x" * 100_000}))
    assert settings.fleet.max_job_bytes < len(payload) < 1_000_000
    return Bad(
        "demo",
        payload,
        "oversized",
        (
            f"payload is {len(payload)} bytes",
            f"fleet.max_job_bytes = {settings.fleet.max_job_bytes}",
            "keep large inputs out of the job",
        ),
    )


def unknown_handler(settings: Settings, tag: str) -> Bad:
    return Bad(
        "demo",
        _encode(_job(settings, tag, handler="browser.click")),
        "unknown-handler",
        ("'browser.click' is not known", "known: http.get, noop"),
        job_id=f"bad-{tag}",
    )


def invalid_subject(settings: Settings, tag: str) -> Bad:
    # "Demo" is not a target name (upper case): no usable target token at all.
    return Bad(
        "Demo",
        _encode(_job(settings, tag)),
        "invalid-subject",
        ("publish jobs to jf.submit.<target>", "'jf.submit.Demo'"),
        filed_under=subjects.UNPARSABLE_TARGET,
    )


def invalid_subject_leading_dash(settings: Settings, tag: str) -> Bad:
    return Bad(
        "-demo",
        _encode(_job(settings, tag)),
        "invalid-subject",
        ("publish jobs to jf.submit.<target>",),
        filed_under=subjects.UNPARSABLE_TARGET,
    )


def subject_with_extra_tokens(settings: Settings, tag: str) -> Bad:
    # jf.submit.<target> is one token of target: "demo.extra" is no target's subject.
    return Bad(
        "demo.extra",
        _encode(_job(settings, tag)),
        "invalid-subject",
        ("publish jobs to jf.submit.<target>", "'jf.submit.demo.extra'"),
        filed_under="demo",
    )


async def rejections(js: JetStreamContext) -> list[tuple[str, Rejection]]:
    """Every rejection kept on JF_REJECTED, with the subject it is filed under."""
    return [
        (msg.subject, _rejection.decode(msg.data))
        async for msg in read_stream(js, subjects.STREAM_REJECTED, "jf.rejected.>")
    ]


def _valid_raw(settings: Settings, n: int) -> tuple[str, bytes]:
    job = jobs_for("demo", settings, [f"/page/{1000 + n}"])[0]
    return job.id, msgspec.json.encode(job)


async def submit_interleaved(
    js: JetStreamContext, settings: Settings, bads: list[Bad]
) -> list[str]:
    """Submit each bad input twice (client, then bare publish) between valid jobs;
    return the ids of the valid jobs. Checks the client's immediate answer too."""
    valid_ids: list[str] = []
    for n, bad in enumerate(bads):
        job = jobs_for("demo", settings, [f"/page/{n}"])[0]
        [ok] = await submit_jobs(js, settings, "demo", [job])
        assert ok.published and ok.rejection is None
        valid_ids.append(job.id)

        [answer] = await submit_raw(js, settings, bad.token, [bad.payload])
        assert answer.published
        assert answer.rejection is not None, f"the client accepted {bad.reason} input"
        assert answer.rejection.reason == bad.reason, answer.rejection

        job_id, raw_job = _valid_raw(settings, n)
        await js.publish(subjects.submit("demo"), raw_job)
        valid_ids.append(job_id)

        await js.publish(f"jf.submit.{bad.token}", bad.payload)
    return valid_ids


async def wait_settled(stack: InProcessStack, committed: int, rejected: int) -> None:
    async def settled() -> bool:
        status = await stack.status()
        return (
            status.targets["demo"].committed == committed
            and status.totals.rejected == rejected
            and status.admitting == 0
        )

    try:
        await wait_for(settled, 10, f"{committed} commits and {rejected} rejections")
    except AssertionError:
        raise AssertionError(f"not settled: {await stack.status()}") from None


def _carries(rejection: Rejection, payload: bytes) -> bool:
    if rejection.raw_truncated:
        return len(rejection.raw) > 0 and payload.startswith(rejection.raw)
    return rejection.raw == payload


async def check_raw_kept(js: JetStreamContext, rejection: Rejection, payload: bytes) -> None:
    """The submitted bytes are kept: whole on the rejection, or (when the rejection keeps
    only a prefix) whole in JF_SUBMIT at the sequence the rejection names."""
    if rejection.raw_truncated:
        assert len(rejection.raw) < len(payload) and payload.startswith(rejection.raw)
        assert rejection.raw_size == len(payload)
        assert rejection.submit_seq > 0, "a truncated rejection must point at the original"
    else:
        assert rejection.raw == payload
    if rejection.submit_seq:
        original = await js.get_msg(subjects.STREAM_SUBMIT, rejection.submit_seq)
        assert (original.data or b"") == payload  # nats-py gives None for an empty body
        assert original.subject == rejection.subject


async def check_rejections(
    js: JetStreamContext, kept: list[tuple[str, Rejection]], bads: list[Bad], copies: int = 2
) -> None:
    """Each bad input is kept ``copies`` times, under the right subject, with its reason,
    a message saying what to fix, its job id when it had one, and its bytes."""
    assert len(kept) == copies * len(bads)
    for bad in bads:
        mine = [(subject, r) for subject, r in kept if _carries(r, bad.payload)]
        assert len(mine) == copies * sum(b.payload == bad.payload for b in bads), bad
        for subject, rejection in mine:
            assert subject == bad.rejected_subject
            assert rejection.reason == bad.reason, rejection.message
            assert rejection.subject == f"jf.submit.{bad.token}"
            assert rejection.job_id == bad.job_id
            for hint in bad.hints:
                assert hint in rejection.message, (hint, rejection.message)
            await check_raw_kept(js, rejection, bad.payload)


async def assert_nothing_valid_lost(js: JetStreamContext, valid_ids: list[str]) -> None:
    exported = [r.job_id async for r in iter_results(js, "demo")]
    assert sorted(exported) == sorted(valid_ids)


async def assert_still_admitting(
    js: JetStreamContext, settings: Settings, stack: InProcessStack, committed_before: int
) -> None:
    [job] = jobs_for("demo", settings, ["/page/9999"])
    await submit_jobs(js, settings, "demo", [job])

    async def committed() -> bool:
        return (await stack.status()).targets["demo"].committed == committed_before + 1

    await wait_for(committed, 10, "the job submitted after the bad input to commit")
    assert job.id in [r.job_id async for r in iter_results(js, "demo")]


async def run_bad_inputs(
    settings: Settings, nc: NatsClient, stack: InProcessStack, makers: list[MakeBad]
) -> None:
    js = nc.jetstream()
    bads = [make(settings, f"{make.__name__}-{n}") for n, make in enumerate(makers)]
    valid_ids = await submit_interleaved(js, settings, bads)
    await wait_settled(stack, committed=len(valid_ids), rejected=2 * len(bads))
    await check_rejections(js, await rejections(js), bads)
    status = await stack.status()
    assert status.totals.dead == 0
    assert status.totals.queued == 0
    await assert_nothing_valid_lost(js, valid_ids)
    await assert_still_admitting(js, settings, stack, len(valid_ids))


async def test_invalid_json_is_rejected_with_reason_and_nothing_valid_is_lost(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [invalid_json, invalid_utf8])


async def test_an_empty_payload_is_rejected_as_invalid_json(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [empty_payload])


async def test_wrong_types_are_rejected_naming_the_field_and_nothing_valid_is_lost(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(
        settings, nc, stack, [wrong_type, wrong_type_id, unsafe_id, not_an_object, bad_tier]
    )


async def test_missing_and_unknown_fields_are_rejected_naming_the_field(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    # A missing id is no error: admission gives one (tests/test_entry_contract.py).
    await run_bad_inputs(settings, nc, stack, [missing_url, unknown_field])


async def test_an_unknown_target_is_rejected_and_kept_under_that_target(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [unknown_target])
    status = await stack.status()
    assert status.targets["nosuch"].rejected == 2
    assert status.targets["nosuch"].submitted == 2
    assert status.targets["demo"].rejected == 0


async def test_a_url_outside_the_target_is_rejected_with_the_targets_base_url(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [url_outside_target, not_http_url])


async def test_an_oversized_payload_is_rejected_with_the_limit_and_kept_whole(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [oversized])


async def test_an_unknown_handler_is_rejected_listing_the_known_handlers(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [unknown_handler])


async def test_a_subject_token_that_is_not_a_target_name_is_rejected_as_invalid_subject(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [invalid_subject, invalid_subject_leading_dash])
    status = await stack.status()
    assert status.targets[subjects.UNPARSABLE_TARGET].rejected == 4


async def test_item10_a_submit_subject_with_tokens_after_the_target_is_rejected(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    await run_bad_inputs(settings, nc, stack, [subject_with_extra_tokens])
    status = await stack.status()
    assert status.conserved and status.targets["demo"].rejected == 2


ALL_KINDS: list[MakeBad] = [
    invalid_json,
    invalid_utf8,
    wrong_type,
    wrong_type_id,
    unsafe_id,
    not_an_object,
    missing_url,
    unknown_field,
    bad_tier,
    unknown_target,
    url_outside_target,
    not_http_url,
    oversized,
    unknown_handler,
    invalid_subject,
    subject_with_extra_tokens,
]


async def test_every_kind_of_bad_input_mixed_with_valid_jobs_is_counted_per_target(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    js = nc.jetstream()
    bads = [make(settings, f"{make.__name__}-{n}") for n, make in enumerate(ALL_KINDS)]
    valid_ids = await submit_interleaved(js, settings, bads)
    await wait_settled(stack, committed=len(valid_ids), rejected=2 * len(bads))

    kept = await rejections(js)
    await check_rejections(js, kept, bads)
    assert {r.reason for _, r in kept} == {
        "invalid-json",
        "invalid-job",
        "unknown-target",
        "url-outside-target",
        "invalid-url",
        "oversized",
        "unknown-handler",
        "invalid-subject",
    }

    status = await stack.status()
    expected: dict[str, int] = {}
    for bad in bads:
        filed = bad.filed_under or bad.token
        expected[filed] = expected.get(filed, 0) + 2
    assert {name: c.rejected for name, c in status.targets.items() if c.rejected} == expected
    demo = status.targets["demo"]
    assert demo.committed == len(valid_ids)
    assert demo.submitted == len(valid_ids) + expected["demo"]
    assert (demo.queued, demo.leased, demo.dead) == (0, 0, 0)
    assert status.totals.rejected == 2 * len(bads)

    await assert_nothing_valid_lost(js, valid_ids)
    await assert_still_admitting(js, settings, stack, len(valid_ids))


async def test_the_same_bad_bytes_published_twice_are_kept_twice(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    # Without a message id nothing dedupes them: each is its own submission to answer.
    js = nc.jetstream()
    payload = b"{definitely not json"
    for _ in range(3):
        await js.publish(subjects.submit("demo"), payload)
    await wait_settled(stack, committed=0, rejected=3)
    kept = await rejections(js)
    assert [(s, r.reason, r.raw) for s, r in kept] == [
        ("jf.rejected.demo", "invalid-json", payload)
    ] * 3
    for _, rejection in kept:
        await check_raw_kept(js, rejection, payload)


async def test_a_kept_rejection_points_at_the_original_submission(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    # Rejection.submit_seq: "Sequence of the original in JF_SUBMIT, where it is kept whole".
    js = nc.jetstream()
    bads = [invalid_json(settings, "seq-0"), oversized(settings, "seq-1")]
    for bad in bads:
        await js.publish(subjects.submit(bad.token), bad.payload)
    await wait_settled(stack, committed=0, rejected=len(bads))
    for _, rejection in await rejections(js):
        assert rejection.submit_seq > 0, rejection.reason
        original = await js.get_msg(subjects.STREAM_SUBMIT, rejection.submit_seq)
        assert original.subject == rejection.subject and original.data is not None
        assert _carries(rejection, original.data)


# --- the sink -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "report",
    [
        b"{not json",
        b"",
        b"[]",
        b'{"type": "success"}',
        b'{"type": "teleport", "order": {}}',
        b'{"type": "failure", "order": {"job": {"id": "x", "url": "http://h/"}}}',
    ],
    ids=[
        "invalid-json",
        "empty",
        "array",
        "success-missing-fields",
        "unknown-tag",
        "failure-missing-fields",
    ],
)
async def test_a_malformed_report_gets_an_error_reply_and_the_sink_keeps_serving(
    settings: Settings, nc: NatsClient, stack: InProcessStack, report: bytes
) -> None:
    js = nc.jetstream()
    answer = await nc.request(subjects.sink_report("demo"), report, timeout=5)
    reply = _reply.decode(answer.data)
    assert reply.status == "error"
    assert reply.detail.startswith("malformed report:")
    # Fire-and-forget garbage (no reply subject) must not upset it either.
    await nc.publish(subjects.sink_report("demo"), report)
    await nc.flush()
    again = _reply.decode((await nc.request(subjects.sink_report("demo"), report, timeout=5)).data)
    assert again.status == "error"

    # Nothing was committed or dead-lettered by the garbage...
    status = await stack.status()
    assert (status.totals.committed, status.totals.dead) == (0, 0)
    # ...and a valid job still goes all the way through the sink.
    [job] = jobs_for("demo", settings, ["/page/9998"])
    await submit_jobs(js, settings, "demo", [job])

    async def committed() -> bool:
        return (await stack.status()).targets["demo"].committed == 1

    await wait_for(committed, 10, "a valid job to commit after the malformed report")
    assert [r.job_id async for r in iter_results(js, "demo")] == [job.id]


async def test_a_malformed_report_for_an_unknown_target_gets_an_error_reply(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    answer = await nc.request(subjects.sink_report("nosuch"), b"{}", timeout=5)
    assert _reply.decode(answer.data).status == "error"


def test_every_bad_input_kind_is_refused_by_admission_alone(settings: Settings) -> None:
    # The pure check the CLI and gateway rely on, without servers.
    for make in [*ALL_KINDS, empty_payload, invalid_subject_leading_dash]:
        bad = make(settings, make.__name__)
        verdict = admit(f"jf.submit.{bad.token}", bad.payload, settings)
        assert isinstance(verdict, Rejection), make.__name__
        assert verdict.reason == bad.reason, (make.__name__, verdict.message)
        assert verdict.raw_size == len(bad.payload)
        if verdict.raw_truncated:  # oversized: a prefix here, the whole in JF_SUBMIT
            assert verdict.raw == bad.payload[: settings.fleet.max_job_bytes]
        else:
            assert verdict.raw == bad.payload


def test_a_valid_job_is_admitted_by_the_same_check(settings: Settings) -> None:
    job = Job(id="ok-1", url=settings.targets["demo"].base_url + "page/1")
    verdict = admit("jf.submit.demo", msgspec.json.encode(job), settings)
    assert isinstance(verdict, WorkOrder)
    assert verdict.target == "demo"
