"""Runs the simulator from the command line: ``python -m jetfleet.simulator``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from jetfleet.simulator.app import TargetSimulator
from jetfleet.simulator.config import SimulatorConfig


async def _serve(host: str, port: int, config: SimulatorConfig) -> None:
    sim = TargetSimulator(config)
    url = await sim.start(host, port)
    print(f"target simulator listening on {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await sim.stop()


def main() -> None:
    """Parses arguments and serves until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m jetfleet.simulator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    parser.add_argument("--pages", type=int, default=1_000_000, help="pages /page/N that exist")
    args = parser.parse_args()
    config = SimulatorConfig(latency_s=args.latency, pages=args.pages)
    # Ctrl-C is the normal way to stop it; no traceback for that.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.host, args.port, config))


if __name__ == "__main__":
    main()
