"""The simulator's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SimulatorConfig:
    """Knobs of a simulated target website.

    Attributes:
        latency_s: Delay added before answering every counted (non ``/__sim``) request.
        pages: How many pages exist: ``/page/N`` answers 200 for ``0 <= N < pages``.
    """

    latency_s: float = 0.0
    pages: int = 1_000_000

    def __post_init__(self) -> None:
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if self.pages < 0:
            raise ValueError(f"pages must be >= 0, got {self.pages!r}")
