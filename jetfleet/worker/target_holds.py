"""Targets that asked this worker to wait longer than it will: the operator's view.

A worker honours a target's Retry-After only up to the target's ``max_retry_after_s``
(jetfleet/worker/retry_after.py): a longer ask must not park jobs for years. It is not
ignored either: it becomes a hold an operator sees on the worker's ``/metrics``, so a
person decides (pause the target, talk to its owner) instead of a header.
"""

from __future__ import annotations

import logging

from jetfleet.metrics import CounterFamily, GaugeFamily
from jetfleet.worker.retry_after import BoundedWait

log = logging.getLogger(__name__)


class TargetHolds:
    """Per-target record of over-cap waits, exposed as two metric families."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.asked = GaugeFamily(
            "jetfleet_worker_target_hold_asked_seconds",
            "A target's last Retry-After longer than its max_retry_after_s, by worker and "
            "target; removed once the target answers normally again",
        )
        self.count = CounterFamily(
            "jetfleet_worker_target_holds_total",
            "Retry-After answers longer than the target's max_retry_after_s, by worker and target",
        )

    def record(self, target: str, wait: BoundedWait) -> None:
        """The target asked for ``wait``; show it if it is over the cap."""
        if not wait.over_cap:
            return
        log.warning(
            "target %s asked worker %s to wait %g s, over its max_retry_after_s of %g s: "
            "holding it %g s at a time; pause it or raise the cap if that ask is right",
            target,
            self.worker_id,
            wait.asked_s,
            wait.cap_s,
            wait.cap_s,
        )
        self.asked.set(wait.asked_s, worker=self.worker_id, target=target)
        self.count.inc(worker=self.worker_id, target=target)

    def answered(self, target: str) -> None:
        """The target answered normally: it no longer asks to be left alone."""
        self.asked.remove(worker=self.worker_id, target=target)

    def held(self, target: str) -> float | None:
        """The over-cap wait ``target`` last asked for, or None when it asks none."""
        return self.asked.get(worker=self.worker_id, target=target)
