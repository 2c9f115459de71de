"""Submit-to-commit latency at half of the measured peak, beside the raw round trip.

    python bench/latency_bench.py [--peak JOBS_PER_S] [--seconds S] [--workers W] [--json]

1. The peak: jetfleet's full path (noop, W workers) with N jobs submitted at once
   (bench/jetfleet_bench.py), unless ``--peak`` gives it (``python -m bench`` passes
   the jetfleet-noop figure of the same run).
2. jetfleet at half of it: a fresh DevStack, 200 warm-up jobs run to their commit (not
   counted), then jobs submitted at a steady peak/2 per second for S seconds; latency is
   submit -> CommittedResult seen, per job.
3. The raw round trip at the same rate: bench/floor_bench.py's flow floor paced at
   peak/2, its W consumer processes acking with ``ack_sync``; latency is publish ->
   fetch -> ack confirmed by the server, per message.

The issue's targets: jetfleet's p50 within 5x and p99 within 10x of the raw round trip's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

from floor_bench import flow_floor  # noqa: E402
from harness import fmt_table, run_with_tree  # noqa: E402
from jetfleet_bench import run_jetfleet  # noqa: E402

PEAK_JOBS = 5000
WARMUP_JOBS = 200  # jetfleet's, run to their commit before the paced jobs, not counted
DEFAULT_SECONDS = 10.0
P50_TARGET = 5.0
P99_TARGET = 10.0
TIMEOUT_S = 300.0


async def latency_at_half_peak(
    peak: float | None, workers: int = 2, seconds: float = DEFAULT_SECONDS, keep: bool = False
) -> dict[str, Any]:
    """Both latencies at half of ``peak`` jobs/s (measured first when None)."""
    result: dict[str, Any] = {"workers": workers, "seconds": seconds}
    if peak is None:
        measured = await run_jetfleet("noop", PEAK_JOBS, workers, TIMEOUT_S, keep=keep)
        result["peak_run"] = measured
        peak = measured.get("jobs_per_s") or 0.0
    result["peak_jobs_per_s"] = peak
    if not peak:
        result["error"] = "no peak measured: the jetfleet-noop run failed"
        return result
    rate = peak / 2.0
    jobs = max(1, round(rate * seconds))
    result.update({"rate_per_s": rate, "jobs": jobs})
    result["jetfleet"] = await run_jetfleet(
        "noop", jobs, workers, TIMEOUT_S, keep=keep, rate=rate, warmup=WARMUP_JOBS
    )
    result["raw"] = await flow_floor(jobs, workers, rate=rate)
    result["ratios"] = latency_ratios(result["jetfleet"], result["raw"])
    return result


def latency_ratios(full: dict[str, Any], raw: dict[str, Any]) -> dict[str, float | None]:
    """jetfleet's p50 and p99 over the raw round trip's (None where one is missing)."""
    out: dict[str, float | None] = {}
    for pct in ("p50_ms", "p99_ms"):
        a = (full.get("latency") or {}).get(pct)
        b = (raw.get("latency") or {}).get(pct)
        out[pct] = a / b if a is not None and b else None
    return out


def render(r: dict[str, Any]) -> str:
    rows = []
    for name in ("jetfleet", "raw"):
        x = r.get(name) or {}
        lat = x.get("latency") or {}
        rows.append(
            [
                name,
                x.get("jobs"),
                x.get("committed"),
                x.get("jobs_per_s"),
                lat.get("p50_ms"),
                lat.get("p99_ms"),
                x.get("latency_label"),
            ]
        )
    head = (
        f"peak {r.get('peak_jobs_per_s') or 0:.0f} jobs/s, paced at "
        f"{r.get('rate_per_s') or 0:.0f}/s for {r.get('seconds')} s"
    )
    table = fmt_table(["path", "jobs", "done", "jobs/s", "p50 ms", "p99 ms", "latency"], rows)
    ratios = r.get("ratios") or {}
    tail = ", ".join(
        f"{k[:3]} {v:.2f}x" if v is not None else f"{k[:3]} -" for k, v in ratios.items()
    )
    return f"{head}\n{table}\njetfleet / raw: {tail} (targets p50 <= {P50_TARGET:g}x, " + (
        f"p99 <= {P99_TARGET:g}x)" + (f"\nERROR {r['error']}" if r.get("error") else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak", type=float, default=None, help="skip measuring the peak")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="paced seconds")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folders")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = asyncio.run(latency_at_half_peak(args.peak, args.workers, args.seconds, args.keep))
    print(json.dumps(result, indent=2, default=str) if args.json else render(result))
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
