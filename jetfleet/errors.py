"""The one exception root, and the control-flow signals that are not crashes."""

from __future__ import annotations


class JetfleetError(Exception):
    """Root of every error jetfleet raises on purpose."""


class ConfigError(JetfleetError):
    """The configuration is invalid; the message names the key and says what to fix."""


class IdentityOwned(JetfleetError):
    """Another live worker owns the identity this worker was to claim (the message names
    it and how long its claim lasts unrenewed), or has taken it from this one."""


class NotConnectedError(JetfleetError):
    """A client call was made before connecting or after closing."""


class StackError(JetfleetError):
    """An embedded server (nats-server, redis-server) could not be started or found."""


class SubmitError(JetfleetError):
    """A submission could not be published (the server refused it or was unreachable)."""


class ControlSignal(JetfleetError):
    """Base of the control-flow signals a handler or the runtime raises.

    They steer a job (retry later, give up, stop) and are never logged as crashes.
    """


class RetryLater(ControlSignal):
    """The attempt failed for a reason worth retrying after ``delay_s`` seconds."""

    def __init__(self, reason: str, delay_s: float | None = None, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay_s = delay_s
        self.detail = detail


class PermanentFailure(ControlSignal):
    """The job can never succeed as submitted; it is dead-lettered with ``reason``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class Blocked(ControlSignal):
    """The target refused us: rate-limited (429), blocked (403) or challenged.

    A signal to back off and contain, never an obstacle to get around. It does not spend
    the job's attempt budget: the worker gives the attempt back and stops pulling the
    target for ``retry_after_s`` (or the policy's backoff).
    """

    def __init__(
        self, kind: str, retry_after_s: float | None = None, detail: str = "", status: int = 0
    ) -> None:
        super().__init__(kind)
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.detail = detail
        self.status = status
        """The HTTP status the target answered (0 when not HTTP)."""


class NotSent(ControlSignal):
    """Raised by ``HandlerContext.ready``: the attempt's first request may not go now (no
    permit, or the lease went). The worker ends the attempt unrun, as it would have
    before the handler started; a handler lets it through unchanged."""

    def __init__(self, verdict: object) -> None:
        super().__init__("the first request may not be sent now")
        self.verdict = verdict
        """The worker's verdict for the attempt (jetfleet.worker.verdict.Verdict)."""


class LeaseLost(ControlSignal):
    """Someone else now owns the job: stop, discard state built for it, never ack."""


class WrongRevision(JetfleetError):
    """A compare-and-set write lost: the key moved since the revision it named was read
    (or, for a create, the key holds something)."""


class PresenceRefused(JetfleetError):
    """A presence write (jetfleet/presence_writer.py) was refused or not answered; the
    message says why. Like a KV outage: the caller tries again or does without."""
