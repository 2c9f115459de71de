"""The rollout guard (docs/versions.md#the-rollout-guard): per version tuple, the share
of outcomes that succeeded (``ok``) and that were blocked, over ``versions.guard_window_s``;
a tuple approved after the incumbent whose success rate falls below
``versions.guard_fraction`` x the incumbent's, each side with at least
``versions.guard_min_sample`` outcomes, is withdrawn from the approved set.

The incumbent is the approved tuple approved earliest, before the one judged, that has
the minimum sample in the window: what ran before the rollout and still runs beside it.
A newer tuple's outcomes count from its approval on (by the server's timestamps), so a
replica replaying the window after a restart does not withdraw a tuple an operator
approved again on evidence from before.

The guard withdraws through the leaser (a ``VersionsRevoke`` on ``jf.versions``, by
``rollout-guard``, with its figures): the leaser deletes the approval with a
compare-and-set, so of several quarantine replicas judging alike only one withdraws and
alerts. An unanswered ask is made again on a later event of the tuple.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import msgspec
from jetfleet.schemas.versions import GuardFigures, VersionsReply, VersionsRevoke
from jetfleet.services.quarantine.rule_windows import Seen
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.metrics import CounterFamily
from jetfleet.settings import Settings
from jetfleet.version_records import approved_tuples, guard_state
from jetfleet.version_tuple import tuple_id

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(VersionsReply)
GUARD_BY = "rollout-guard"
ASK_TIMEOUT_S = 10.0
# A tuple is judged at most this often (each judgement reads the approved set).
JUDGE_EVERY_S = 2.0


@dataclass
class Rates:
    """Outcomes counted, and the shares that succeeded and were blocked."""

    sample: int = 0
    ok: int = 0
    blocked: int = 0

    @property
    def success_rate(self) -> float:
        return self.ok / self.sample if self.sample else 0.0

    @property
    def block_rate(self) -> float:
        return self.blocked / self.sample if self.sample else 0.0


@dataclass
class TupleWindow:
    """One tuple's outcomes in the window: (stored at, ok, blocked), oldest first."""

    events: collections.deque[tuple[float, bool, bool]] = field(default_factory=collections.deque)

    def forget_before(self, at_s: float) -> None:
        while self.events and self.events[0][0] < at_s:
            self.events.popleft()

    def rates(self, since_s: float = float("-inf")) -> Rates:
        rates = Rates()
        for at_s, ok, blocked in self.events:
            if at_s >= since_s:
                rates.sample += 1
                rates.ok += ok
                rates.blocked += blocked
        return rates


class RolloutGuard:
    """Counts outcomes per tuple and withdraws a newly approved tuple that does worse."""

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.windows: dict[str, TupleWindow] = {}
        self._judged_at: dict[str, float] = {}
        self._due: set[str] = set()
        """Tuples with outcomes counted since they were last judged."""
        self.withdrawals = CounterFamily(
            "jetfleet_rollout_guard_asks_total",
            "Withdrawals the rollout guard asked the leaser for, by what came of it",
        )

    async def observe(self, seen: Seen) -> None:
        """Count one outcome event; judge its tuple when both sides have the sample."""
        versions = self.settings.versions
        if not versions.guard_enabled:
            return
        tid = tuple_id(seen.outcome.versions)
        window = self.windows.setdefault(tid, TupleWindow())
        kind = seen.outcome.kind
        window.events.append((seen.at_s, kind == "ok", kind == "blocked"))
        horizon = seen.at_s - versions.guard_window_s
        for each in self.windows.values():
            each.forget_before(horizon)
        if len(window.events) < versions.guard_min_sample:
            return
        if not any(
            other != tid and len(w.events) >= versions.guard_min_sample
            for other, w in self.windows.items()
        ):
            return  # nothing to compare with yet
        self._due.add(tid)
        await self.judge_due()

    async def judge_due(self) -> None:
        """Judge the tuples with new outcomes not judged for ``JUDGE_EVERY_S`` (the
        reader calls this between fetches too, so the last events of a burst count)."""
        now = time.monotonic()
        for tid in list(self._due):
            if now - self._judged_at.get(tid, -JUDGE_EVERY_S) < JUDGE_EVERY_S:
                continue
            self._due.discard(tid)
            self._judged_at[tid] = now
            try:
                await self._judge(tid)
            except Exception as exc:  # judged again on its next event
                log.warning("rollout guard could not judge version tuple %s: %r", tid, exc)

    async def _judge(self, tid: str) -> None:
        approved = await approved_tuples(self.js)
        ids = [other for other, _ in approved]
        if tid not in ids:
            return  # not approved: the gate keeps it off, nothing to withdraw
        incumbent = self.incumbent(ids[: ids.index(tid)])
        if incumbent is None:
            return  # the earliest that runs, or nothing older runs to compare with
        figures = self.figures(tid, incumbent, dict(approved)[tid])
        if figures is None or figures.success_rate >= figures.fraction * (
            figures.incumbent_success_rate
        ):
            return
        if await guard_state(self.js) == "off":
            return
        await self._withdraw(tid, figures)

    def incumbent(self, older: list[str]) -> str | None:
        """Of the tuples approved before the one judged (oldest first), the earliest
        with the minimum sample in the window: what runs beside the rollout. An older
        approval whose workers are all gone (a finished rollout nobody revoked) would
        otherwise have no sample, and the guard would judge no later canary at all."""
        minimum = self.settings.versions.guard_min_sample
        for other in older:
            window = self.windows.get(other)
            if window is not None and window.rates().sample >= minimum:
                return other
        return None

    def figures(self, tid: str, incumbent: str, approved_at_s: float) -> GuardFigures | None:
        """Both sides' rates, if both have the minimum sample (the new tuple's counted
        from its approval on); None otherwise."""
        versions = self.settings.versions
        new = self.windows[tid].rates(since_s=approved_at_s)
        old = self.windows.get(incumbent, TupleWindow()).rates()
        if min(new.sample, old.sample) < versions.guard_min_sample:
            return None
        return GuardFigures(
            window_s=versions.guard_window_s,
            fraction=versions.guard_fraction,
            sample=new.sample,
            success_rate=round(new.success_rate, 4),
            block_rate=round(new.block_rate, 4),
            incumbent=incumbent,
            incumbent_sample=old.sample,
            incumbent_success_rate=round(old.success_rate, 4),
            incumbent_block_rate=round(old.block_rate, 4),
        )

    async def _withdraw(self, tid: str, figures: GuardFigures) -> None:
        why = (
            f"success rate {figures.success_rate:.1%} over {figures.sample} outcomes is "
            f"below {figures.fraction:g} x the incumbent {figures.incumbent}'s "
            f"{figures.incumbent_success_rate:.1%} over {figures.incumbent_sample} within "
            f"{figures.window_s:g} s (blocked {figures.block_rate:.1%} against "
            f"{figures.incumbent_block_rate:.1%})"
        )
        command = VersionsRevoke(id=tid, by=GUARD_BY, why=why, figures=figures)
        answer = await self.nc.request(
            subjects.VERSIONS, _encoder.encode(command), timeout=ASK_TIMEOUT_S
        )
        reply = _reply_decoder.decode(answer.data)
        self.withdrawals.inc(outcome="done" if reply.ok else "refused")
        log.warning("rollout guard asked to withdraw %s (%s): %s", tid, why, reply.detail)
