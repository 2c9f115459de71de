"""The simulator's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jetfleet.simulator.pages import ROBOTS_TXT


@dataclass(frozen=True)
class SimulatorConfig:
    """Knobs of a simulated target website.

    Attributes:
        latency_s: Delay added before answering every counted (non ``/__sim``) request.
        pages: How many pages exist: ``/page/N`` answers 200 for ``0 <= N < pages``.
        robots_txt: The body ``/robots.txt`` answers.
        robots_status: The status ``/robots.txt`` answers (a 4xx, a 5xx, or 200).
        storm_s: A 429 storm: from the first counted request on, every counted request
            (any path but ``/robots.txt``) for this many seconds answers 429 with
            ``Retry-After: storm_retry_after_s``; 0 (the default): no storm.
        storm_retry_after_s: The ``Retry-After`` (whole seconds) the storm's 429s send.
    """

    latency_s: float = 0.0
    pages: int = 1_000_000
    robots_txt: str = ROBOTS_TXT
    robots_status: int = 200
    storm_s: float = 0.0
    storm_retry_after_s: int = 2

    def __post_init__(self) -> None:
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if self.pages < 0:
            raise ValueError(f"pages must be >= 0, got {self.pages!r}")
        if not 200 <= self.robots_status <= 599:
            raise ValueError(f"robots_status must be from 200 to 599, got {self.robots_status!r}")
        if not math.isfinite(self.storm_s) or self.storm_s < 0:
            raise ValueError(f"storm_s must be a finite number >= 0, got {self.storm_s!r}")
        if self.storm_retry_after_s < 0:
            raise ValueError(f"storm_retry_after_s must be >= 0, got {self.storm_retry_after_s!r}")
