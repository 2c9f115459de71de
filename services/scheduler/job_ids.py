"""One job per job id: admission claims each id for its submission, and refuses a
later submission of an id whose earlier job still has per-job state (docs/leases.md#job-ids).

A job's grants, fences, seal and dead letter are all keyed by its id. A second job under
the same id would inherit them (be terminated unrun as dead, or acked as already done),
so it is refused with ``duplicate-job-id`` instead, whichever way it was submitted. The
claim is the job's ``jf-fences`` entry, written put-if-absent; it lives as long as that
entry, which is as long as anything else keyed by the id. Once the job's work order is
stored, the claim is marked routed, so a redelivered submission is acked, not routed
again, however long after.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetfleet.schemas import Rejection, WorkOrder

from jetfleet.admission import rejection
from jetfleet.lease_store import JobClaim, LeaseStore
from jetfleet.settings import Settings

DUPLICATE_JOB_ID = "duplicate-job-id"


@dataclass(frozen=True)
class ClaimedOrder:
    """A work order whose job id is its submission's."""

    order: WorkOrder
    claim: JobClaim
    """Its claim, to mark routed once the order is stored; ``claim.routed``: an earlier
    admission of the same submission routed it already."""


async def claim_job_id(
    store: LeaseStore,
    order: WorkOrder,
    subject: str,
    data: bytes,
    settings: Settings,
    submit_seq: int,
) -> ClaimedOrder | Rejection:
    """``order`` with its claim if its job id is this submission's; else the rejection
    to keep."""
    claim = await store.claim(order.job.id, submit_seq)
    if claim.owner == submit_seq:
        return ClaimedOrder(order, claim)
    owner = claim.owner
    earlier = f"submission {owner} of JF_SUBMIT" if owner else "an earlier job"
    keep = max(settings.fleet.retention_s, settings.fleet.dedupe_ttl_s)
    return rejection(
        DUPLICATE_JOB_ID,
        f"job id {order.job.id!r} belongs to {earlier}, and its state is kept until "
        f"{keep:g} s after that job's last grant or settle (max of fleet.retention_s and "
        "fleet.dedupe_ttl_s): submit the work again under a new job id",
        subject,
        data,
        settings,
        submit_seq,
        order.job.id,
    )
