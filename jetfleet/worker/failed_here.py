"""Which retries a worker should offer to the other workers before running them.

A retryable failure is retried preferably by another worker (so another identity).
Pull delivery cannot pick the worker, so a worker that gets back a job whose last
attempt failed on it hands it back unrun a few times; each hand-back is one more chance
for another worker's pull to take it.
"""

from __future__ import annotations

from collections import OrderedDict

# How many times a retry is handed back before it may run on the worker it failed on.
RETRY_ELSEWHERE_TRIES = 2
# Jobs remembered per worker; the oldest are forgotten (they then just run here).
FAILED_HERE_MEMORY = 10_000


class FailedHere:
    """A worker's memory of the jobs whose last attempt failed on it."""

    def __init__(
        self, tries: int = RETRY_ELSEWHERE_TRIES, memory: int = FAILED_HERE_MEMORY
    ) -> None:
        self._tries = tries
        self._memory = memory
        # job id -> (the delivery this worker last saw, hand-backs left), oldest first
        self._jobs: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def failed(self, job_id: str, delivery: int) -> None:
        """The job's attempt on this delivery failed here, retryably."""
        self._jobs[job_id] = (delivery, self._tries)
        self._jobs.move_to_end(job_id)
        while len(self._jobs) > self._memory:
            self._jobs.popitem(last=False)

    def offer_elsewhere(self, job_id: str, delivery: int) -> bool:
        """Whether to hand this delivery of the job back for another worker.

        Yes while its last attempt failed here, no other worker has had it since (its
        delivery count moved by exactly one since this worker last saw it) and hand-backs
        are left. Once another worker has seen it, the last failure may be theirs, so it
        runs here.
        """
        seen, left = self._jobs.pop(job_id, (0, 0))
        if not left or delivery != seen + 1:
            return False
        if left > 1:
            self._jobs[job_id] = (delivery, left - 1)
        return True
