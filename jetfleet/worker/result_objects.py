"""Bodies (and later attachments such as screenshots) too large to ride in a message.

A result travels whole in one NATS message twice: the worker's report to the sink and the
sink's committed record. Both must fit the server's ``max_payload`` (1 MiB by default),
so a body above ``fleet.max_inline_bytes`` goes to the ``jf-result-objects`` object store
instead and the result carries a ``StoredObject`` reference. The bucket keeps objects as
long as the results stream keeps results (jetfleet/topology.py).

Each put gets a name of its own, so two holders of one job (a lost lease) never write
over each other: the committed result names the object its own attempt stored. The
objects of attempts that were not committed stay until the bucket's age limit.

The worker writes the object itself, in nats-py's object store format (so any object
store reader reads it), but with two publishes only: the chunks on
``$O.jf-result-objects.C.<nuid>`` and the description on ``$O.jf-result-objects.M.<name>``.
Unlike nats-py's ``put`` it neither reads the name first nor purges anything (a unique
name overwrites nothing; chunks of a put that failed half-way age out with the bucket),
so a worker needs no purge or other ``$JS.API`` right beyond those two subject families.
Another holder of such rights could still overwrite an object's description: the
committed result (written only by the sink) carries the body's SHA-256, and readers
check it (``jetfleet.results.stored_bytes``), so a changed body is detected, never served.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
)

from jetfleet import subjects
from jetfleet.errors import ConfigError
from jetfleet.schemas import StoredObject, WorkOrder
from jetfleet.settings import Settings

RESULT_TOO_LARGE = "result-too-large"
# Room in a report for everything but the output and the job: the order's other fields,
# the version tuple, identity and fence, JSON punctuation.
ENVELOPE_BYTES = 16 * 1024
# Room in a report for everything but the inline body and the job: the order's other
# fields, kept headers (aiohttp allows 8 KiB a line), versions, JSON punctuation.
REPORT_ROOM_BYTES = 64 * 1024
# nats-py's default chunk; each chunk is one message, so it must also fit max_payload
# (nats-py does not check: a chunk too large fails the put).
CHUNK_BYTES = 128 * 1024
CHUNK_ROOM_BYTES = 4096


def check_payload_room(settings: Settings, max_payload: int) -> None:
    """Refuse to start when a result with an inline body could exceed ``max_payload``.

    Raises:
        ConfigError: naming ``fleet.max_inline_bytes``, the sum, and the largest value
            this server allows.
    """
    fleet = settings.fleet
    needed = fleet.max_inline_bytes + fleet.max_job_bytes + REPORT_ROOM_BYTES
    if needed <= max_payload:
        return
    room = max_payload - fleet.max_job_bytes - REPORT_ROOM_BYTES
    fix = (
        f"set fleet.max_inline_bytes to at most {room} (larger bodies go to the "
        f"{subjects.OBJECTS_RESULTS} object store)"
        if room >= 0
        else "lower fleet.max_job_bytes"
    )
    raise ConfigError(
        f"config: fleet.max_inline_bytes is invalid: a result may carry "
        f"fleet.max_inline_bytes ({fleet.max_inline_bytes}) + fleet.max_job_bytes "
        f"({fleet.max_job_bytes}) + {REPORT_ROOM_BYTES} bytes of other fields = {needed} "
        f"bytes, more than this NATS server's max_payload ({max_payload}); {fix}, or raise "
        "max_payload on the server"
    )


class ResultObjects:
    """Puts one job's large bytes into the bucket and says where they are."""

    def __init__(
        self,
        js: JetStreamContext,
        max_inline_bytes: int,
        max_payload: int,
        max_job_bytes: int,
        bucket: str = subjects.OBJECTS_RESULTS,
    ) -> None:
        self._js = js
        self.bucket = bucket
        self.max_inline_bytes = max_inline_bytes
        self._chunk_bytes = min(CHUNK_BYTES, max_payload - CHUNK_ROOM_BYTES)
        self.max_output_bytes = max_payload - max_job_bytes - ENVELOPE_BYTES

    @classmethod
    async def open(
        cls, js: JetStreamContext, settings: Settings, max_payload: int
    ) -> ResultObjects:
        """Check the caps against the server, then bind to the declared bucket.

        Raises:
            ConfigError: see ``check_payload_room``.
            nats.js.errors.BucketNotFoundError: the topology was not declared.
        """
        check_payload_room(settings, max_payload)
        await js.object_store(subjects.OBJECTS_RESULTS)  # raises unless declared
        fleet = settings.fleet
        return cls(js, fleet.max_inline_bytes, max_payload, fleet.max_job_bytes)

    def fits_inline(self, encoded_size: int) -> bool:
        """Whether ``encoded_size`` bytes (as the result's JSON carries them) stay inline."""
        return encoded_size <= self.max_inline_bytes

    def fits_message(self, encoded_size: int) -> bool:
        """Whether a handler output of ``encoded_size`` JSON bytes fits a result message."""
        return encoded_size <= self.max_output_bytes

    async def put(self, order: WorkOrder, label: str, data: bytes) -> StoredObject:
        """Store ``data`` for ``order``'s result under a name no other put uses."""
        name = f"{order.target}/{order.key}/{uuid.uuid4().hex}/{label}"
        digest = hashlib.sha256(data).digest()
        await self._write(name, data, digest)
        return StoredObject(bucket=self.bucket, name=name, size=len(data), sha256=digest.hex())

    async def _write(self, name: str, data: bytes, digest: bytes) -> None:
        """Publish ``data`` as object ``name``: its chunks, then its description (an
        object exists for readers once its description is stored)."""
        nuid = uuid.uuid4().hex
        chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=nuid)
        step = self._chunk_bytes
        for start in range(0, len(data), step):
            await self._js.publish(chunks, data[start : start + step])
        info = js_api.ObjectInfo(
            name=name,
            bucket=self.bucket,
            nuid=nuid,
            size=len(data),
            chunks=-(-len(data) // step),
            # No mtime: this host's clock decides nothing here (I9), and a reader has
            # the stored message's server time.
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest).decode()),
            options=js_api.ObjectMetaOptions(max_chunk_size=step),
        )
        meta = OBJ_META_PRE_TEMPLATE.format(
            bucket=self.bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
        )
        await self._js.publish(meta, json.dumps(info.as_dict()).encode())
