"""Work orders that decode but cannot run, so they are kept instead of run.

The worker asks this before it asks for a lease, and the sink asks it again before it
keeps an order a worker reported (services/sink/malformed_orders.py): both must agree,
or a kept order would be refused its keeping and run on every delivery instead.
"""

from __future__ import annotations

import msgspec

from jetfleet import subjects
from jetfleet.schemas import WorkOrder
from jetfleet.schemas.names import IdempotencyKey

MALFORMED = "malformed-work-order"
TARGET_MISMATCH = "work-order-target-mismatch"


def unrunnable(order: WorkOrder, subject: str) -> tuple[str, str] | None:
    """Why ``order``, delivered on ``subject``, cannot run: ``(reason, what is wrong)``,
    or None when it can.

    - Its target is not its subject's: leased under the subject's target and reported
      under the body's, the sink would refuse its every report (``rejected:not-granted``).
    - Its key is no idempotency key (a space, a wildcard, an empty token, over 256
      characters): the leaser refuses every lease for it as malformed, so it would be
      asked for again on every delivery. ``WorkOrder.key`` itself stays unbounded: work
      orders are kept in dead letters and seals, which must decode as they were stored
      (docs/schemas.md).
    """
    if order.target != subjects.target_of(subject):
        return TARGET_MISMATCH, f"its order names target {order.target!r} but came on {subject}"
    try:
        msgspec.convert(order.key, IdempotencyKey)
    except msgspec.ValidationError as exc:
        return MALFORMED, f"its key {order.key[:64]!r} is not an idempotency key: {exc}"
    return None
