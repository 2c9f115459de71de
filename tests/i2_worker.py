"""The ``jetfleet`` command with one test-only handler, for worker processes in tests.

``python -m tests.i2_worker worker --id W`` is ``jetfleet worker --id W`` plus the handler
``test.slow``: one polite GET of the job's URL (the side effect the target counts), then a
sleep of ``args.sleep_s`` seconds (longer than the lease TTL for the jobs that must be kept
alive by renewals). Its output records this process's wall clock, so a test can show the
result came from a worker whose clock is skewed.

On start it prints ``i2-worker clock=<time.time()> pid=<pid>`` on stdout.
"""

from __future__ import annotations

import asyncio
import os
import time

from jetfleet.schemas import DataOutput, HandlerOutput, HttpFetch

from jetfleet.cli.main import main
from jetfleet.worker.builtin import http_get
from jetfleet.worker.handlers import HandlerContext, handler


@handler("test.slow")
async def slow(ctx: HandlerContext) -> HandlerOutput:
    """Fetch the page once, then take ``args.sleep_s`` seconds."""
    fetched = await http_get(ctx)
    await asyncio.sleep(float(ctx.order.job.args.get("sleep_s", "0")))
    status = fetched.status if isinstance(fetched, HttpFetch) else 0
    return DataOutput(data={"status": status, "clock": time.time(), "worker": ctx.worker_id})


if __name__ == "__main__":
    print(f"i2-worker clock={time.time():.3f} pid={os.getpid()}", flush=True)
    raise SystemExit(main())
