"""The wire contract: msgspec Structs for every message jetfleet puts on a subject.

Rules: evolve only compatibly (new fields get defaults), carry durations never wall-clock
deadlines (I9), and keep internal types out of here. ``jetfleet.wire_catalog.CHANNELS``
maps each subject family to the type (or tagged union) it carries; ``jetfleet schemas
export`` writes the JSON Schema and AsyncAPI documents from it.
"""

# One import name per module: imported as plain `schemas` (the source folder on sys.path)
# every module here would exist twice, and isinstance checks between the copies fail.
if __name__ != "jetfleet.schemas":
    raise ImportError(
        f"import jetfleet.schemas, not {__name__}: the folder installs as jetfleet.schemas"
    )


from jetfleet.schemas.events import (
    CommittedResult,
    DeadLetter,
    Duplicate,
    Outcome,
    OutcomeBatch,
    Rejection,
)
from jetfleet.schemas.job import Job, WorkOrder
from jetfleet.schemas.lease import (
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseReply,
    LeaseRequest,
)
from jetfleet.schemas.output import DataOutput, HandlerOutput, HttpFetch, NoopOutput, StoredObject
from jetfleet.schemas.report import AttemptRecord, Failure, Report, SinkReply, Success, Versions

__all__ = [
    "AttemptRecord",
    "CommittedResult",
    "DataOutput",
    "DeadLetter",
    "Duplicate",
    "Failure",
    "HandlerOutput",
    "HttpFetch",
    "Job",
    "LeaseAlreadyDone",
    "LeaseGrant",
    "LeaseRefusal",
    "LeaseRelease",
    "LeaseRenew",
    "LeaseReply",
    "LeaseRequest",
    "NoopOutput",
    "Outcome",
    "OutcomeBatch",
    "Rejection",
    "Report",
    "SinkReply",
    "StoredObject",
    "Success",
    "Versions",
    "WorkOrder",
]
