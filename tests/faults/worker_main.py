"""``python -m tests.faults.worker_main --id w-3 --events DIR/events-w-3.jsonl ...``

Runs a ``FaultyWorker`` (settings from ``JETFLEET_CONFIG``) until SIGTERM/SIGINT, then
drains it like ``jetfleet worker`` does. Run from the project root so ``tests`` imports.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from jetfleet.connection import connect_nats
from jetfleet.service import serve_until_signalled
from jetfleet.settings import load_settings
from tests.faults.plan import EventLog, FaultPlan
from tests.faults.worker import FaultyWorker


class _AsService:
    name = "faulty-worker"

    def __init__(self, worker: FaultyWorker) -> None:
        self.worker = worker
        self.metrics = worker.metrics

    async def start(self) -> None:
        await self.worker.start()
        # Signal handlers are installed before start(): a SIGTERM from now on drains.
        self.worker.events.write("ready")

    async def drain(self, timeout_s: float = 30.0) -> None:
        await self.worker.drain(timeout_s)
        self.worker.events.write("drained", stats=dict(self.worker.stats))


async def _run(args: argparse.Namespace, plan: FaultPlan) -> int:
    settings = load_settings(None, os.environ)
    events = EventLog(Path(args.events), args.id)
    nc = await connect_nats(settings.nats, f"faulty-worker-{args.id}")
    try:
        worker = FaultyWorker(settings, nc, args.id, plan, events)
        await serve_until_signalled(_AsService(worker))
    finally:
        await nc.close()
        events.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.faults.worker_main")
    parser.add_argument("--id", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--stall-per-mille", type=int, default=0)
    parser.add_argument("--drop-ack-per-mille", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--effect-min-s", type=float, default=0.05)
    parser.add_argument("--effect-max-s", type=float, default=0.35)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    plan = FaultPlan(
        stall_per_mille=args.stall_per_mille,
        drop_ack_per_mille=args.drop_ack_per_mille,
        stall_s=args.stall_s,
        effect_min_s=args.effect_min_s,
        effect_max_s=args.effect_max_s,
    )
    return asyncio.run(_run(args, plan))


if __name__ == "__main__":
    raise SystemExit(main())
