"""``python -m tests.faults.ack_dropping_worker worker --id W ...``: the ``jetfleet``
command whose worker loses the ack of some jobs it committed (bench/chaos.py runs one
in its fleet, through ``WorkerSpec.module``).

After the sink answers ``committed`` for a job the plan picks (``FaultPlan.drops_ack``, a
hash of the job id, ``DROP_ACK_PER_MILLE`` of them), the worker gives its lease back as
usual but never acks, as if the ``+ACK`` were lost on the wire: JetStream redelivers the
job after ack_wait and the next holder must hear ``already-done`` from the leaser (no
second request to the target). Each drop is written to the event log ``EVENTS``
(``ack-dropped``, one JSON line, kept across a SIGKILL). Run from the project root (or
with it on ``PYTHONPATH``) so ``tests`` imports. No fault knob is in product code: the
worker class the command builds is replaced here, before the command runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jetfleet.schemas import SinkReply, WorkOrder
from nats.aio.msg import Msg

import jetfleet.worker
from jetfleet.cli.main import main
from jetfleet.worker import Worker
from jetfleet.worker.verdict import Held, Verdict
from tests.faults.plan import EventLog, FaultPlan

DROP_ACK_PER_MILLE = "DROP_ACK_PER_MILLE"
"""The variable naming how many jobs in 1,000 lose their ack (by job id hash)."""
EVENTS = "ACK_DROP_EVENTS"
"""The variable naming the event log to write ``ack-dropped`` lines to."""


class AckDroppingWorker(Worker):
    """The product worker, minus the ack of the plan's committed jobs."""

    plan = FaultPlan()
    events: EventLog | None = None

    async def _settle(
        self, msg: Msg, order: WorkOrder, held: Held, verdict: Verdict, reply: SinkReply | None
    ) -> None:
        if reply is not None and reply.status == "committed" and self.plan.drops_ack(order.job.id):
            self.stats["committed"] += 1
            self.stats["ack-dropped"] += 1
            if self.events is not None:
                self.events.write("ack-dropped", job=order.job.id, fence=held.fence)
            await self._give_back(order, held)
            return
        await super()._settle(msg, order, held, verdict, reply)


def _configure(environ: dict[str, str]) -> None:
    per_mille = int(environ.get(DROP_ACK_PER_MILLE, "0"))
    AckDroppingWorker.plan = FaultPlan(drop_ack_per_mille=per_mille)
    events = environ.get(EVENTS, "")
    if events:
        AckDroppingWorker.events = EventLog(Path(events), environ.get("ACK_DROP_WORKER", ""))
    # `jetfleet worker` imports the class from jetfleet.worker when it starts one.
    jetfleet.worker.Worker = AckDroppingWorker  # type: ignore[misc]


if __name__ == "__main__":
    _configure(dict(os.environ))
    sys.exit(main())
