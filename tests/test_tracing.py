"""One job is one trace: a dev stack's processes (each service and a worker, all child
processes) and `jetfleet submit` export their spans over OTLP/HTTP to a receiver here;
a job's spans share one trace id, link parent to child across processes, and a retried
job's attempts are siblings under its submit span."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from jetfleet.dev.devstack import DevStack
from jetfleet.dev.stack_env import read_env
from tests.conftest import wait_for
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # opentelemetry.proto SpanKind values
SPANS_TIMEOUT_S = 60.0


class TracedStack:
    def __init__(self, stack: DevStack, receiver: OtlpReceiver) -> None:
        self.stack = stack
        self.receiver = receiver

    async def cli(self, *args: str, traced: bool = True) -> str:
        """``jetfleet ARGS`` from another process (exporting spans unless not ``traced``);
        its output."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("JETFLEET_")}
        env.update(read_env(self.stack.data_dir / "env"))
        if traced:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.receiver.endpoint
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "jetfleet", *args),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    async def submit(self, path: str, traced: bool = True, *more: str) -> str:
        """``jetfleet submit demo PATH [MORE]`` from another process; the job id."""
        out = await self.cli("submit", "demo", path, "--json", *more, traced=traced)
        job_ids: list[str] = json.loads(out)["submitted"]
        return job_ids[0]

    def submit_span(self, job_id: str, service: str = "jetfleet-cli") -> ReceivedSpan | None:
        """The span of ``service`` that started job ``job_id``'s trace (the submitter's,
        or the scheduler's admission when the submitter traced nothing)."""
        return next(
            (
                s
                for s in self.receiver.spans
                if s.service == service
                and s.attribute("jetfleet.job.id") == job_id
                and s.name.startswith("process " if service == "scheduler" else "send ")
            ),
            None,
        )

    async def settled_trace(
        self, job_id: str, root_service: str = "jetfleet-cli"
    ) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
        """The job's submit span (``root_service``'s) and its trace, once the sink's
        commit and the worker's ack have been exported."""

        async def settled() -> bool:
            root = self.submit_span(job_id, root_service)
            if root is None:
                return False
            names = {(s.service, s.name) for s in self.receiver.trace(root.trace_id)}
            return ("sink", "commit") in names and ("worker", "ack jf.work.demo.normal") in names

        await wait_for(settled, SPANS_TIMEOUT_S, f"job {job_id}'s commit and ack spans")
        root = self.submit_span(job_id, root_service)
        assert root is not None
        return root, self.receiver.trace(root.trace_id)


@pytest.fixture(scope="module")
async def traced(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TracedStack]:
    receiver = OtlpReceiver()
    await receiver.start()
    with pytest.MonkeyPatch.context() as patch:
        # The children inherit OTEL_*: export every 0.1 s rather than every 5 s.
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
            patch.delenv(name, raising=False)
        folder = Path(tmp_path_factory.mktemp("traced"))
        # The worker drives Chromium too (found on PATH), for browser.page page visits.
        user_config = folder / "browser.toml"
        user_config.write_text("[worker.browser]\nenabled = true\n")
        stack = DevStack(
            folder / "stack",
            workers=1,
            user_config=user_config,
            trace_endpoint=receiver.endpoint,
        )
        await stack.start()
        try:
            yield TracedStack(stack, receiver)
        finally:
            await stack.stop()
            await receiver.stop()


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id and s.name == name]


async def test_one_job_is_one_trace_across_every_process(traced: TracedStack) -> None:
    job_id = await traced.submit("/page/1")
    root, spans = await traced.settled_trace(job_id)

    services = {s.service for s in spans}
    assert {"jetfleet-cli", "scheduler", "leaser", "ratelimit", "sink", "worker"} <= services
    ids = {s.span_id for s in spans}
    assert [s for s in spans if not s.parent_id] == [root]
    assert all(s.parent_id in ids for s in spans if s is not root), "a parent outside the trace"
    assert root.span.kind == PRODUCER and root.name == "send jf.submit.demo"
    assert root.attribute("messaging.system") == "nats"

    admission = one(spans, "scheduler", "process jf.submit.demo")
    assert admission.parent_id == root.span_id and admission.span.kind == CONSUMER
    assert admission.attribute("jetfleet.outcome") == "admitted"

    delivery = one(spans, "worker", "process jf.work.demo.normal")
    assert delivery.parent_id == root.span_id and delivery.span.kind == CONSUMER
    assert delivery.attribute("jetfleet.job.id") == job_id
    assert delivery.attribute("jetfleet.worker.id") == "w-0"
    assert delivery.attribute("jetfleet.attempt") == 1
    assert delivery.attribute("jetfleet.outcome") == "ok"
    version_id = delivery.attribute("jetfleet.version_tuple.id")
    assert isinstance(version_id, str) and version_id

    grant = one(spans, "worker", "lease grant")
    assert grant.parent_id == delivery.span_id and grant.span.kind == CLIENT
    granted = one(spans, "leaser", "lease grant")
    assert granted.parent_id == grant.span_id and granted.span.kind == SERVER
    assert granted.attribute("jetfleet.outcome") == "granted"

    permits = [s for s in spans if s.service == "ratelimit" and s.name == "permit"]
    asked = {s.span_id for s in spans if s.service == "worker" and s.name == "permit"}
    assert permits and all(p.parent_id in asked for p in permits)

    handler = one(spans, "worker", "handler http.get")
    assert handler.parent_id == delivery.span_id
    page = [
        s for s in children(spans, handler, "GET") if str(s.attribute("url.full")).endswith("/1")
    ]
    assert len(page) == 1 and page[0].span.kind == CLIENT
    assert page[0].attribute("http.request.method") == "GET"
    assert page[0].attribute("http.response.status_code") == 200

    report = one(spans, "worker", "send jf.sink.report.demo")
    assert report.parent_id == delivery.span_id
    commit = one(spans, "sink", "commit")
    assert commit.parent_id == report.span_id and commit.span.kind == SERVER
    assert commit.attribute("jetfleet.outcome") == "committed"
    assert commit.attribute("jetfleet.version_tuple.id") == version_id
    assert commit.attribute("jetfleet.job.id") == job_id

    ack = one(spans, "worker", "ack jf.work.demo.normal")
    assert ack.parent_id == delivery.span_id
    assert ack.attribute("messaging.operation.type") == "settle"


async def test_a_browser_jobs_page_visit_and_its_document_request_are_in_its_trace(
    traced: TracedStack,
) -> None:
    page = '{"wait_for": "h1.title", "extract": {"price": {"selector": ".price"}}}'
    job_id = await traced.submit("/shop/item/3", True, "--handler", "browser.page", "--page", page)
    _root, spans = await traced.settled_trace(job_id)

    handler = one(spans, "worker", "handler browser.page")
    visit = one(spans, "worker", "page visit")
    assert visit.parent_id == handler.span_id and visit.span.kind == CLIENT
    assert str(visit.attribute("url.full")).endswith("/shop/item/3")
    # Sent from Playwright's route task, the document request still names the visit.
    (document,) = children(spans, visit, "GET")
    assert document.span.kind == CLIENT
    assert str(document.attribute("url.full")).endswith("/shop/item/3")
    assert document.attribute("http.response.status_code") == 200
    commit = one(spans, "sink", "commit")
    assert commit.attribute("jetfleet.outcome") == "committed"


async def test_a_retried_jobs_attempts_are_siblings_in_its_trace(traced: TracedStack) -> None:
    job_id = await traced.submit("/error/1?times=1")  # a 500 once, then the page
    root, spans = await traced.settled_trace(job_id)

    handlers = [s for s in spans if s.name == "handler http.get"]
    attempts = {h.parent_id for h in handlers}  # deliveries that ran (not handed back)
    by_outcome = {
        str(s.attribute("jetfleet.outcome")): s
        for s in spans
        if s.name == "process jf.work.demo.normal" and s.span_id in attempts
    }
    assert set(by_outcome) == {"retryable", "ok"}, [s.attribute("jetfleet.outcome") for s in spans]
    failed, passed = by_outcome["retryable"], by_outcome["ok"]
    assert failed.parent_id == passed.parent_id == root.span_id
    assert failed.span_id != passed.span_id
    assert failed.attribute("jetfleet.reason") == "http-500"
    assert failed.span.status.code == 2  # STATUS_CODE_ERROR: a retry is not a success
    assert failed.attribute("jetfleet.attempt") == 1 and passed.attribute("jetfleet.attempt") == 2
    failed_handler = next(h for h in handlers if h.parent_id == failed.span_id)
    assert not any(e.name == "exception" for e in failed_handler.span.events), (
        "a signal, not a crash"
    )


async def test_a_job_submitted_untraced_is_one_trace_from_its_admission(
    traced: TracedStack,
) -> None:
    # A submitter that traces nothing (a replayed dead letter, a client without tracing):
    # the admission is the trace's root, and the work order must carry its context, or
    # each delivery would start a trace of its own.
    job_id = await traced.submit("/page/2", traced=False)
    root, spans = await traced.settled_trace(job_id, root_service="scheduler")

    assert not root.parent_id and root.span.kind == CONSUMER
    assert [s for s in spans if not s.parent_id] == [root]
    delivery = one(spans, "worker", "process jf.work.demo.normal")
    assert delivery.parent_id == root.span_id
    assert delivery.attribute("jetfleet.job.id") == job_id
    assert one(spans, "sink", "commit").attribute("jetfleet.job.id") == job_id


async def gateway_post(
    stack: DevStack, paths: list[str], headers: dict[str, str] | None = None
) -> list[str]:
    """POST the jobs of ``paths`` to the stack's gateway as one batch; their ids."""
    url = f"{stack.gateway_url}/v1/targets/demo/jobs"
    sent = {"Authorization": f"Bearer {stack.gateway_token}", **(headers or {})}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json=[{"url": p} for p in paths], headers=sent) as response,
    ):
        answer = await response.json()
        assert response.status == 202, answer
    accepted: list[str] = answer["accepted"]
    return accepted


async def test_each_job_of_a_gateway_batch_is_a_trace_of_its_own(traced: TracedStack) -> None:
    job_ids = await gateway_post(traced.stack, ["/page/3", "/page/4"])
    assert len(job_ids) == 2

    traces = [await traced.settled_trace(job_id, root_service="gateway") for job_id in job_ids]
    roots = [root for root, _ in traces]
    assert len({r.trace_id for r in roots}) == 2, "one job, one trace"
    posts = [
        s
        for s in traced.receiver.spans
        if s.service == "gateway" and s.name == "POST /v1/targets/{target}/jobs"
    ]
    [post] = [p for p in posts if any(ln.span_id.hex() == p.span_id for ln in roots[0].span.links)]
    assert post.span.kind == SERVER and not post.parent_id
    assert post.attribute("http.response.status_code") == 202
    assert post.attribute("jetfleet.jobs") == 2
    for (root, spans), job_id in zip(traces, job_ids, strict=True):
        assert root.name == "send jf.submit.demo" and root.span.kind == PRODUCER
        assert not root.parent_id and [s for s in spans if not s.parent_id] == [root]
        assert [ln.span_id.hex() for ln in root.span.links] == [post.span_id]
        delivery = one(spans, "worker", "process jf.work.demo.normal")
        assert delivery.parent_id == root.span_id
        assert one(spans, "sink", "commit").attribute("jetfleet.job.id") == job_id


async def test_a_gateway_post_carrying_trace_context_joins_the_callers_trace(
    traced: TracedStack,
) -> None:
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{caller_trace}-{caller_span}-01"}
    [job_id] = await gateway_post(traced.stack, ["/page/5"], headers)

    root, spans = await traced.settled_trace(job_id, root_service="gateway")
    assert root.trace_id == caller_trace
    post = one(spans, "gateway", "POST /v1/targets/{target}/jobs")
    assert post.parent_id == caller_span and post.span.kind == SERVER
    assert root.parent_id == post.span_id and not root.span.links
    delivery = one(spans, "worker", "process jf.work.demo.normal")
    assert delivery.parent_id == root.span_id


async def test_a_replayed_dead_letter_is_one_trace_from_its_admission(
    traced: TracedStack,
) -> None:
    job_id = await traced.submit("/missing/1")  # 404: dead on its first attempt

    async def letter_id() -> int | None:
        letters = json.loads(await traced.cli("dlq", "list", "--json", traced=False))
        return next((int(e["id"]) for e in letters if e["job"] == job_id), None)

    async def dead() -> bool:
        return await letter_id() is not None

    await wait_for(dead, SPANS_TIMEOUT_S, f"job {job_id}'s dead letter")
    replay = await traced.cli("dlq", "replay", str(await letter_id()), "--json", "--why", "t")
    [copy_id] = json.loads(replay)["replayed"]

    def copy_spans() -> list[ReceivedSpan]:
        root = traced.submit_span(copy_id, "scheduler")
        return [] if root is None else traced.receiver.trace(root.trace_id)

    async def copy_dead() -> bool:
        names = {(s.service, s.name) for s in copy_spans()}
        return {("sink", "dead letter"), ("worker", "process jf.work.demo.normal")} <= names

    await wait_for(copy_dead, SPANS_TIMEOUT_S, f"the replayed copy {copy_id}'s dead letter span")
    spans = copy_spans()
    admission = one(spans, "scheduler", "process jf.submit.demo")
    assert not admission.parent_id, "the replay traces nothing: its admission is the root"
    assert [s for s in spans if not s.parent_id] == [admission]
    delivery = one(spans, "worker", "process jf.work.demo.normal")
    assert delivery.parent_id == admission.span_id
    assert one(spans, "sink", "dead letter").attribute("jetfleet.job.id") == copy_id
