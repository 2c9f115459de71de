"""One job per job id: admission claims each id for its submission, and refuses a
later submission of an id whose earlier job still has per-job state (docs/leases.md#job-ids).

A job's grants, fences, seal and dead letter are all keyed by its id. A second job under
the same id would inherit them (be terminated unrun as dead, or acked as already done),
so it is refused with ``duplicate-job-id`` instead, whichever way it was submitted. The
claim is the job's ``jf-fences`` entry, written put-if-absent; it lives as long as that
entry, which is as long as anything else keyed by the id.
"""

from __future__ import annotations

from jetfleet.schemas import Rejection, WorkOrder

from jetfleet.admission import rejection
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings

DUPLICATE_JOB_ID = "duplicate-job-id"


async def claim_job_id(
    store: LeaseStore,
    order: WorkOrder,
    subject: str,
    data: bytes,
    settings: Settings,
    submit_seq: int,
) -> WorkOrder | Rejection:
    """``order`` if its job id is this submission's; else the rejection to keep."""
    owner = await store.claim(order.job.id, submit_seq)
    if owner == submit_seq:
        return order
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
