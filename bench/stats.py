"""Small helpers shared by the bench scenarios: percentiles, process usage, log scans."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (``nan`` when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_summary(seconds: Iterable[float]) -> dict[str, float | int]:
    """p50/p90/p99/max (milliseconds) and the sample count of latencies given in seconds."""
    values = sorted(seconds)
    return {
        "n": len(values),
        "p50_ms": percentile(values, 50) * 1000.0,
        "p90_ms": percentile(values, 90) * 1000.0,
        "p99_ms": percentile(values, 99) * 1000.0,
        "max_ms": (values[-1] * 1000.0) if values else math.nan,
    }


def process_usage(pid: int | None) -> dict[str, float] | None:
    """RSS (MiB) and CPU time (user+system seconds) of ``pid``; None if it is gone."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            rss = proc.memory_info().rss
            cpu = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return {"rss_mib": rss / (1024 * 1024), "cpu_s": cpu.user + cpu.system}


def folder_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (a file removed meanwhile counts 0)."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


_PROBLEM = re.compile(r"\b(ERROR|CRITICAL|WARNING|Traceback)\b|\[ERR\]|\[WRN\]")


# Lines about the machine, not the software under test.
_BENIGN = ("Memory overcommit must be enabled",)


def scan_logs(paths: Iterable[Path], samples: int = 5) -> dict[str, dict[str, Any]]:
    """Per log file: how many lines look like problems, and the first few of them."""
    found: dict[str, dict[str, Any]] = {}
    for path in paths:
        if not path.is_file():
            continue
        lines = [
            ln
            for ln in path.read_text(errors="replace").splitlines()
            if _PROBLEM.search(ln) and not any(s in ln for s in _BENIGN)
        ]
        if lines:
            found[path.name] = {"count": len(lines), "first": [ln[:300] for ln in lines[:samples]]}
    return found


def process_tree_usage(pid: int | None) -> dict[str, float] | None:
    """As ``process_usage``, summed over ``pid`` and its live descendants (a Celery
    worker's pool processes); None if ``pid`` is gone."""
    if pid is None:
        return None
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total = {"rss_mib": 0.0, "cpu_s": 0.0}
    for proc in procs:
        usage = process_usage(proc.pid)
        if usage is not None:
            total["rss_mib"] += usage["rss_mib"]
            total["cpu_s"] += usage["cpu_s"]
    return total


def cpu_snapshot(pids: dict[str, int | None], tree: bool = False) -> dict[str, float | None]:
    """CPU seconds used so far by each named process (with its descendants if ``tree``)."""
    read = process_tree_usage if tree else process_usage
    return {name: (read(pid) or {}).get("cpu_s") for name, pid in pids.items()}


def usage_since(
    pids: dict[str, int | None], before: dict[str, float | None], tree: bool = False
) -> dict[str, dict[str, float | None]]:
    """Per named process: CPU seconds since ``before`` (``cpu_s``: the scenario's own
    work, no start-up), CPU over its life so far (``cpu_s_life``) and RSS now."""
    read = process_tree_usage if tree else process_usage
    out: dict[str, dict[str, float | None]] = {}
    for name, pid in pids.items():
        now = read(pid)
        was = before.get(name)
        out[name] = {
            "cpu_s": now["cpu_s"] - was if now is not None and was is not None else None,
            "cpu_s_life": now["cpu_s"] if now else None,
            "rss_mib": now["rss_mib"] if now else None,
        }
    return out
