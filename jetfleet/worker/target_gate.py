"""When this worker may call a target: not while it said to wait, and after a block,
one probe at a time until the target answers normally again."""

from __future__ import annotations

import time

# How long other jobs of a target wait while a probe is out after a block.
PROBE_WAIT_S = 1.0
# A job fetched while this worker may not use its target goes back this soon, for the
# other workers (the refusal was about this worker, not the job or the target).
HAND_BACK_S = 0.25


class TargetGate:
    """Per-target back-off state of one worker (monotonic time, never wall-clock)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._permit_at: dict[str, float] = {}
        self._target_said: dict[str, float] = {}
        self._suspect: set[str] = set()
        self._probing: set[str] = set()
        self._blocks: dict[str, int] = {}
        self._only_here: dict[str, float] = {}
        self._opens_at: dict[str, float] = {}

    def block_streak(self, target: str) -> int:
        """How many blocks in a row ``target`` answered this worker (0 once it answers
        normally): the hold after the next block grows with it."""
        return self._blocks.get(target, 0)

    def held_for(self, target: str) -> float:
        """Seconds this worker must still leave ``target`` alone (0 when free)."""
        return max(0.0, self._until.get(target, 0.0) - time.monotonic())

    def hold(
        self, target: str, seconds: float, only_here: bool = False, opens_in_s: float = 0.0
    ) -> None:
        """Leave ``target`` alone for ``seconds`` (a refusal that concerns the target).
        ``only_here``: the refusal is about this worker or its identity (a quarantine),
        so other workers may run the target's jobs meanwhile (``only_here_for``).
        ``opens_in_s``: the target is outside its activity window, which opens then
        (``opens_in``); the hold itself may be shorter, to ask again meanwhile."""
        now = time.monotonic()
        until = now + seconds
        self._until[target] = max(self._until.get(target, 0.0), until)
        if only_here:
            self._only_here[target] = max(self._only_here.get(target, 0.0), until)
        if opens_in_s > 0:
            self._opens_at[target] = now + opens_in_s

    def opens_in(self, target: str) -> float:
        """Seconds until ``target``'s activity window opens, while a hold for its closed
        window is in force (0 otherwise): a job put back meanwhile stays away until then,
        one delivery per closed spell."""
        if self.held_for(target) <= 0:
            return 0.0
        return max(0.0, self._opens_at.get(target, 0.0) - time.monotonic())

    def only_here(self, target: str) -> bool:
        """Whether the hold on ``target`` in force now is only about this worker: no
        hold for the whole fleet (a pause, a closed window, a permit wait) or a block
        ends later. A job put back meanwhile should go to another worker soon."""
        held = self.held_for(target) > 0
        return held and self._only_here.get(target, 0.0) >= self._until[target]

    def wait_for_permit(self, target: str, seconds: float) -> None:
        """Leave ``target`` alone until its next rate permit frees, in ``seconds``: the
        target is busy, not refusing (see ``waiting_for_permit``)."""
        until = time.monotonic() + seconds
        if until >= self._until.get(target, 0.0):  # not within a longer hold (a block)
            self._until[target] = self._permit_at[target] = until

    def waiting_for_permit(self, target: str) -> bool:
        """Whether the hold on ``target`` in force now is only the wait for its next rate
        permit (no refusal or block holds it longer): a job put back meanwhile waits
        like one refused for the rate, not longer with each delivery."""
        return self.held_for(target) > 0 and self._permit_at.get(target, 0.0) >= self._until[target]

    def blocked(self, target: str, seconds: float) -> None:
        """The target refused us (429/403/challenge): hold, then probe before the rest."""
        self.hold(target, seconds)
        until = time.monotonic() + seconds
        self._target_said[target] = max(self._target_said.get(target, 0.0), until)
        self._suspect.add(target)
        self._blocks[target] = self._blocks.get(target, 0) + 1

    def admit(self, target: str) -> float | None:
        """None when a job may call the target now (perhaps as the probe); otherwise how
        long to put the job back for."""
        wait = self.held_for(target)
        if wait > 0:
            # What the target said holds for every job; a refusal of this worker does not.
            said = self._target_said.get(target, 0.0) - time.monotonic()
            return said if said > 0 else HAND_BACK_S
        if target in self._suspect:
            if target in self._probing:
                return PROBE_WAIT_S
            self._probing.add(target)
        return None

    def done(self, target: str, answered: bool, blocked: bool) -> None:
        """A job admitted by ``admit`` ended; ``answered``: the target was called."""
        self._probing.discard(target)
        if answered and not blocked:
            self._suspect.discard(target)
            self._blocks.pop(target, None)
