"""A POSTed body turned into the payloads to publish, and the answer about them.

The gateway only gives an item without an id one (it must know the id to publish under
``sub-<id>`` and to answer with it) and re-encodes each item; everything else (paths
under the target, defaults, whether a job is acceptable) is admission's
(``jetfleet.admission``), which the scheduler applies to every submission alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from jetfleet.client import SubmitResult, new_job_id
from jetfleet.settings import Settings

MAX_ITEMS = 1000
"""The most jobs one request may carry; larger batches are refused whole (413)."""
BODY_FACTOR = 4
"""A request body may be this many times ``fleet.max_job_bytes``."""


def max_body_bytes(settings: Settings) -> int:
    """The largest request body the submit route reads."""
    return BODY_FACTOR * settings.fleet.max_job_bytes


class InvalidBody(Exception):
    """The body is not JSON, or is JSON but neither a job object nor an array of them."""


class TooManyJobs(Exception):
    """The array holds more than MAX_ITEMS jobs."""


class ItemRejection(msgspec.Struct, frozen=True):
    """One item admission refused, as the submit route reports it."""

    index: int
    job_id: str | None
    """The item's id (given or assigned); None when the item had no usable string id."""
    reason: str
    message: str


class SubmitAnswer(msgspec.Struct, frozen=True):
    """The body of a 202 (nothing rejected) or item-level 400 answer."""

    accepted: list[str]
    rejected: list[ItemRejection]


@dataclass(frozen=True)
class Batch:
    """The items of one request, ready for ``jetfleet.client.submit_raw``."""

    payloads: list[bytes]
    msg_ids: list[str]
    """The id each payload is published under (its ``Nats-Msg-Id`` is ``sub-<id>``)."""
    job_ids: list[str | None]
    """The id to report per item; None where the item carried no usable id."""

    def answer(self, results: Sequence[SubmitResult]) -> SubmitAnswer:
        """What to tell the client once every item has been published.

        Args:
            results: ``submit_raw``'s results, in item order.
        """
        accepted: list[str] = []
        rejected: list[ItemRejection] = []
        for index, result in enumerate(results):
            if result.rejection is None:
                accepted.append(self.msg_ids[index])
            else:
                rejected.append(
                    ItemRejection(
                        index=index,
                        job_id=self.job_ids[index],
                        reason=result.rejection.reason,
                        message=result.rejection.message,
                    )
                )
        return SubmitAnswer(accepted=accepted, rejected=rejected)


def parse_batch(body: bytes) -> Batch:
    """Split a body into one payload per job, giving an id to each item without one.

    Args:
        body: one JSON job object, or a JSON array of them.

    Raises:
        InvalidBody: the body is not JSON, or not an object or an array of items.
        TooManyJobs: the array holds more than MAX_ITEMS items.
    """
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidBody(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's nesting limit is not a MsgspecError
        raise InvalidBody("body is nested too deeply to read") from None
    if isinstance(document, dict):
        items: list[Any] = [document]
    elif isinstance(document, list):
        items = document
    else:
        raise InvalidBody(
            "body must be a JSON job object or a JSON array of job objects, "
            f"not a JSON {_json_kind(document)}"
        )
    if not items:
        raise InvalidBody("the array is empty: send at least one job object")
    if len(items) > MAX_ITEMS:
        raise TooManyJobs(
            f"the batch holds {len(items)} jobs; at most {MAX_ITEMS} per request: "
            "split it into several requests"
        )
    batch = Batch(payloads=[], msg_ids=[], job_ids=[])
    for item in items:
        job_id: str | None = None
        if isinstance(item, dict):
            item = {"id": new_job_id(), **item}
            given = item["id"]
            job_id = given if isinstance(given, str) else None
        batch.payloads.append(msgspec.json.encode(item))
        # An item without a usable id still needs a message id; a fresh one means a bad
        # item is never mistaken for a duplicate of another and always kept.
        batch.msg_ids.append(job_id or new_job_id())
        batch.job_ids.append(job_id)
    return batch


def _json_kind(document: object) -> str:
    if isinstance(document, str):
        return "string"
    if isinstance(document, bool):
        return "boolean"
    if isinstance(document, int | float):
        return "number"
    return "null"
