"""Egress proposals: several identities of one subnet blocked by one target in a window
propose an egress quarantine of (subnet, target), which an operator approves or rejects
(``jetfleet quarantine approve|reject``), because it stops every worker of the subnet
there: a larger blast radius than any one identity (docs/quarantine.md#egress-proposals).

Counting is pure (``egress_windows``); this writes the proposal. The fired marker of the
egress rule per (subnet, target) is claimed before the proposal is written, exactly as a
rule's is before its record is sent, so a second replica or a replay never proposes
again from the same evidence, and a proposal an operator rejected stays rejected.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from jetfleet.schemas.lease import Evidence, QuarantineProposal
from jetfleet.services.leaser.quarantine_book import record_key
from jetfleet.services.quarantine.egress_windows import EgressFiring, EgressWindows
from jetfleet.services.quarantine.fired_markers import Claim, FiredMarkers
from jetfleet.services.quarantine.rule_windows import Seen
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.metrics import CounterFamily
from jetfleet.quarantine_proposals import proposal_id, write_proposal
from jetfleet.settings import Settings

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 500
# A proposal a KV error kept from being written is tried again after this, doubling.
RETRY_FIRST_S = 1.0
RETRY_CAP_S = 30.0
SHOWN_IN_REASON = 5


def egress_marker_key(rule_name: str, subnet: str, target: str) -> str:
    """The fired marker of the egress rule for one (subnet, target)."""
    token = hashlib.sha256(f"egress\0{subnet}".encode()).hexdigest()[:32]
    return f"{subjects.QUARANTINE_FIRED_PREFIX}.{target}.{rule_name}.{token}"


def proposal_for(firing: EgressFiring, settings: Settings) -> QuarantineProposal:
    """The proposal a firing makes: its reason names the rule, the identities and jobs."""
    rule = settings.quarantine.egress
    identities = firing.identities
    jobs = [seen.outcome.job_id[:64] for seen in firing.evidence]

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - SHOWN_IN_REASON} more" if len(names) > SHOWN_IN_REASON else ""
        return ", ".join(n[:64] for n in names[:SHOWN_IN_REASON]) + more

    reason = (
        f"rule {rule.name}: {len(identities)} identities of subnet {firing.subnet} "
        f"({listed(identities)}) had {'/'.join(rule.reasons)} outcome(s) on {firing.target} "
        f"within {rule.window_s:g} s (jobs {listed(jobs[::-1])})"
    )
    max_evidence = settings.quarantine.max_evidence
    return QuarantineProposal(
        id=proposal_id(firing.subnet, firing.target),
        subnet=firing.subnet,
        target=firing.target,
        # Names are free text: keep reasons printable (they go into log lines).
        reason="".join(c if c.isprintable() else "?" for c in reason[:MAX_REASON_CHARS]),
        for_s=rule.for_s,
        set_by=f"rule:{rule.name}",
        identities=[i[:256] for i in identities[:max_evidence]],
        evidence=[
            Evidence(job_id=s.outcome.job_id[:128], seq=s.seq, reason=s.outcome.reason[:64])
            for s in firing.evidence[-max_evidence:]
        ],
    )


@dataclass
class EgressPending:
    """A proposal a KV error kept from being written, to try again."""

    firing: EgressFiring
    claim: Claim | None
    attempts: int = 0
    due: float = 0.0
    first: float = field(default_factory=time.monotonic)


class EgressProposals:
    """Counts blocked outcomes per (subnet, target) and writes the proposals they make."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rule = settings.quarantine.egress
        self.windows = EgressWindows(self.rule)
        self.proposed = CounterFamily(
            "jetfleet_quarantine_proposals_total",
            "Egress proposals met, by target and what came of it (proposed, "
            "already-fired, stale, in-force, failed)",
        )
        self.metrics = [self.proposed]
        self.pending: list[EgressPending] = []
        self._js: JetStreamContext | None = None
        self._control: KeyValue | None = None
        self._markers: FiredMarkers | None = None

    @property
    def window_s(self) -> float:
        """How far back a (re)started replica must read for this rule (0: it is off)."""
        return self.rule.window_s if self.rule.identities else 0.0

    def start(self, js: JetStreamContext, control: KeyValue, markers: FiredMarkers) -> None:
        """Use ``control`` for proposals and ``markers`` for the fired markers."""
        self._js, self._control, self._markers = js, control, markers

    def forget_before(self, at_s: float) -> None:
        """Drop windows nothing can count in again (see ``EgressWindows.forget_before``)."""
        self.windows.forget_before(at_s)

    async def observe(self, seen: Seen) -> None:
        """Count one outcome event; propose if it makes the rule fire."""
        firing = self.windows.observe(seen)
        if firing is not None:
            await self.propose(firing)

    async def propose(self, firing: EgressFiring, pending: EgressPending | None = None) -> None:
        """Claim the firing's marker and write its proposal, unless the evidence proposed
        before, is older than a marker lives (``stale``), or the subnet is already
        quarantined there. A KV error keeps the firing pending (its claim held) and it is
        tried again by ``retry_due``; given up (``failed``, its marker put back, so a
        replay proposes it) once its evidence is older than the rule's window."""
        assert self._js is not None and self._control is not None and self._markers is not None
        claim = pending.claim if pending is not None else None
        try:
            if claim is None:
                if await self._markers.outlived(firing.evidence[-1].at_s):
                    self._count(firing, "stale")
                    return
                key = egress_marker_key(self.rule.name, firing.subnet, firing.target)
                claimed = await self._markers.claim(
                    key, firing.evidence[0].seq, firing.evidence[-1].seq
                )
                if isinstance(claimed, int):
                    self._count(firing, "already-fired")
                    # Events newer than the marker did not propose anything: they count on.
                    self.windows.restore(firing, after_seq=claimed)
                    return
                claim = claimed
            if await self._in_force(firing):
                self._count(firing, "in-force")
                return
            proposal = proposal_for(firing, self.settings)
            await write_proposal(self._js, proposal, self.rule.proposal_ttl_s)
        except Exception as exc:
            log.warning(
                "rule %s: the egress proposal for %s on %s could not be written now, "
                "trying again: %r",
                self.rule.name,
                firing.subnet,
                firing.target,
                exc,
            )
            again = pending or EgressPending(firing, claim)
            again.claim = claim
            again.attempts += 1
            again.due = time.monotonic() + min(
                RETRY_FIRST_S * 2 ** (again.attempts - 1), RETRY_CAP_S
            )
            self.pending.append(again)
            return
        self._count(firing, "proposed")
        log.warning(
            "rule %s proposes an egress quarantine of %s on %s (proposal %s): approve it "
            "with `jetfleet quarantine approve %s`, or reject it",
            self.rule.name,
            firing.subnet,
            firing.target,
            proposal.id,
            proposal.id,
        )

    async def retry_due(self) -> None:
        """Try again the pending proposals whose wait is over; give up (``failed``) on
        those waiting longer than the rule's window (their evidence is stale by then)."""
        assert self._markers is not None
        now = time.monotonic()
        due = [p for p in self.pending if p.due <= now]
        self.pending = [p for p in self.pending if p.due > now]
        for pending in due:
            if now - pending.first > self.rule.window_s:
                log.error(
                    "rule %s: gave up the egress proposal for %s on %s: it could not be "
                    "written for %g s",
                    self.rule.name,
                    pending.firing.subnet,
                    pending.firing.target,
                    self.rule.window_s,
                )
                self._count(pending.firing, "failed")
                await self._markers.unclaim(pending.claim)
                continue
            await self.propose(pending.firing, pending)

    async def stop(self) -> None:
        """Put back the markers of proposals still unwritten (a replay proposes them)."""
        if self._markers is None:
            return
        for pending in self.pending:
            log.error(
                "stopping: egress proposal for %s on %s unwritten",
                pending.firing.subnet,
                pending.firing.target,
            )
            await self._markers.unclaim(pending.claim)
        self.pending = []

    async def _in_force(self, firing: EgressFiring) -> bool:
        """Whether the subnet is quarantined on the target already."""
        assert self._control is not None
        try:
            entry = await self._control.get(record_key("egress", firing.subnet, firing.target))
        except KeyNotFoundError:
            return False
        return bool(entry.value)

    def _count(self, firing: EgressFiring, outcome: str) -> None:
        self.proposed.inc(target=firing.target, outcome=outcome)
