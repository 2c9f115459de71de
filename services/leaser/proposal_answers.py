"""An operator's answer to an egress proposal (``jetfleet quarantine approve|reject``).

Approved, the proposal becomes an egress record in force (set by the operator, with the
rule that proposed it and its evidence), set as any record is: the subnet's held leases
on the target are revoked and their jobs requeued. Rejected, it stays in ``jf-control``,
marked so, until its TTL; the rule's fired marker already keeps the same evidence from
proposing it again (docs/quarantine.md#egress-proposals).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from jetfleet.schemas.lease import (
    QuarantineApprove,
    QuarantineRecord,
    QuarantineReject,
    QuarantineReply,
)
from jetfleet.services.leaser.call_checks import (
    QUARANTINE_MAX_REASON_CHARS,
    record_objection,
)
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from jetfleet.quarantine_proposals import drop_proposal, read_proposal, write_proposal
from jetfleet.settings import Settings

log = logging.getLogger(__name__)


class ProposalAnswers:
    """Approves and rejects egress proposals."""

    def __init__(
        self,
        settings: Settings,
        js: JetStreamContext,
        control: KeyValue,
        set_record: Callable[[QuarantineRecord], Awaitable[QuarantineReply]],
    ) -> None:
        self.settings = settings
        self.js = js
        self.control = control
        self.set_record = set_record

    async def answer(self, command: QuarantineApprove | QuarantineReject) -> QuarantineReply:
        """Approve or reject the proposal ``command.id``."""
        proposal = await read_proposal(self.control, command.id)
        if proposal is None:
            return QuarantineReply(
                ok=False,
                detail=f"no egress proposal {command.id}: it was approved already, lapsed "
                "unanswered (quarantine.egress.proposal_ttl_s), or never was; `jetfleet "
                "quarantine list` shows the pending ones",
            )
        if proposal.state == "rejected":
            return QuarantineReply(
                ok=False,
                proposals=[proposal],
                detail=f"egress proposal {command.id} was rejected ({proposal.answered_by}); "
                f"to quarantine the subnet anyway: `jetfleet quarantine set --subnet "
                f"{proposal.subnet} --target {proposal.target}`",
            )
        if isinstance(command, QuarantineReject):
            rejected = msgspec.structs.replace(
                proposal,
                state="rejected",
                answered_by=f"operator: {command.reason}" if command.reason else "operator",
            )
            await write_proposal(self.js, rejected, self.settings.quarantine.egress.proposal_ttl_s)
            log.warning(
                "egress proposal %s (%s on %s) rejected",
                proposal.id,
                proposal.subnet,
                proposal.target,
            )
            return QuarantineReply(ok=True, proposals=[rejected])
        reason = f"approved egress proposal {proposal.id}: {proposal.reason}"
        record = QuarantineRecord(
            scope="egress",
            name=proposal.subnet,
            target=proposal.target,
            reason=reason[:QUARANTINE_MAX_REASON_CHARS],
            for_s=proposal.for_s,
            set_by="operator",
            evidence=proposal.evidence,
            proposed_by=proposal.set_by,
        )
        why = record_objection(self.settings, record)
        if why:
            return QuarantineReply(
                ok=False, detail=f"egress proposal {proposal.id} not approved: {why}"
            )
        reply = await self.set_record(record)
        if reply.ok:
            await drop_proposal(self.control, proposal.id)
        return msgspec.structs.replace(reply, proposals=[proposal])
