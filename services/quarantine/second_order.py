"""Second-order retirements: an identity retired on a target within
``quarantine.second_order_window_s`` after a neighbour (another identity of the same
subnet) was retired there. Containment is working when this stays near zero: a block that
spreads from identity to identity of one egress means the egress, not the identity, is
what the target refuses (docs/quarantine.md#second-order-retirements).

Each retirement the service sets leaves a mark in ``jf-control``
(``quarantine-retired.<target>.<subnet hash>.<identity hash>``) that the server removes
after the window (per-key TTL). So the window is the server's clock, the marks outlive a
record released early, and a restarted or second replica sees the same neighbours. The
subnet of a retirement is its newest evidence's ``Outcome.subnet``.
"""

from __future__ import annotations

import hashlib
import logging

import msgspec
from jetfleet.schemas.lease import QuarantineRecord, QuarantineRetired
from jetfleet.services.quarantine.rule_windows import Firing
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.metrics import CounterFamily
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(QuarantineRetired)


def _token(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def retired_prefix(target: str, subnet: str) -> str:
    """The keys of the retirement marks of one subnet on one target."""
    return f"{subjects.QUARANTINE_RETIRED_PREFIX}.{target}.{_token(subnet)}"


class SecondOrder:
    """Tells a retirement second-order, and marks each retirement for the next."""

    def __init__(self, settings: Settings) -> None:
        self.window_s = settings.quarantine.second_order_window_s
        self.counted = CounterFamily(
            "jetfleet_quarantine_second_order_total",
            "Identities retired on a target within quarantine.second_order_window_s after "
            "a neighbour of the same subnet was retired there, by target",
        )
        self.metrics = [self.counted]
        self._js: JetStreamContext | None = None

    def start(self, js: JetStreamContext) -> None:
        """Read and write the marks through ``js``."""
        self._js = js

    async def neighboured(self, firing: Firing, record: QuarantineRecord) -> QuarantineRecord:
        """``record`` with its subnet and, if a neighbour was retired on the target within
        the window, that neighbour (``second_order_of``). A mark that cannot be read
        leaves the record as it was: the retirement must not wait on it."""
        subnet = firing.evidence[-1].outcome.subnet if firing.evidence else ""
        if firing.rule.action != "retire" or not subnet:
            return record
        try:
            neighbour = await self._neighbour(firing.target, subnet, firing.name)
        except Exception as exc:
            log.warning(
                "the retirements of %s on %s cannot be read: %r", subnet, firing.target, exc
            )
            neighbour = ""
        return msgspec.structs.replace(record, subnet=subnet[:256], second_order_of=neighbour[:256])

    async def retired(self, firing: Firing, record: QuarantineRecord) -> None:
        """The leaser set ``record``: count it if second-order, and mark it."""
        if firing.rule.action != "retire" or not record.subnet:
            return
        if record.second_order_of:
            self.counted.inc(target=record.target)
            log.warning(
                "second-order retirement: identity %s retired on %s after its neighbour %s "
                "of subnet %s",
                record.name,
                record.target,
                record.second_order_of,
                record.subnet,
            )
        assert self._js is not None
        key = f"{retired_prefix(record.target, record.subnet)}.{_token(record.name)}"
        try:
            await self._js.publish(
                f"$KV.{subjects.BUCKET_CONTROL}.{key}",
                _encoder.encode(QuarantineRetired(identity=record.name, subnet=record.subnet)),
                msg_ttl=ttl_whole_seconds(self.window_s),
            )
        except Exception as exc:  # the retirement stands; only its neighbours' count misses it
            log.warning(
                "the retirement of %s on %s was not marked: %r", record.name, record.target, exc
            )

    async def _neighbour(self, target: str, subnet: str, identity: str) -> str:
        """The identity of the subnet retired on ``target`` most recently within the
        window, other than ``identity``; empty if none."""
        assert self._js is not None
        found = ""
        stream = f"KV_{subjects.BUCKET_CONTROL}"
        filter_ = f"$KV.{subjects.BUCKET_CONTROL}.{retired_prefix(target, subnet)}.*"
        async for msg in read_stream(self._js, stream, filter_):
            if not msg.data or (msg.headers or {}).get("KV-Operation"):
                continue
            mark = _decoder.decode(msg.data)
            if mark.identity != identity and mark.subnet == subnet:
                found = mark.identity  # stream order: the last is the newest
        return found
