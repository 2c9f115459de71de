"""``jetfleet runbook``: the five things a fleet runbook must state, from the live
configuration (the settings this process loaded, and what the servers say), as
Markdown or one JSON object (docs/runbook.md).

Each section is one function returning a ``Section``, so a section whose facts live in
another module (the versions, ``jetfleet.ops.version_view``) is wired in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.admission import known_handlers
from jetfleet.settings import Settings, retry_horizon_s
from jetfleet.topology import results_max_age
from jetfleet.version_records import approved_tuples
from jetfleet.version_tuple import local_tuple, tuple_id

Facts = dict[str, Any]


@dataclass(frozen=True)
class Section:
    """One section of the runbook: its key in ``--json``, title, lines and facts."""

    key: str
    title: str
    lines: list[str]
    facts: Facts = field(default_factory=dict)

    def markdown(self) -> str:
        """The section as Markdown."""
        return "\n".join([f"## {self.title}", "", *self.lines, ""])


@dataclass(frozen=True)
class Runbook:
    """Every section, in order."""

    sections: list[Section]

    def markdown(self) -> str:
        """The whole runbook as Markdown."""
        head = "# jetfleet runbook\n\nFrom the live configuration; `jetfleet runbook --json` "
        head += "prints the same facts as one object.\n"
        return "\n".join([head, *(s.markdown() for s in self.sections)])

    def as_json(self) -> Facts:
        """The whole runbook as one object: each section's facts under its key."""
        return {s.key: {"title": s.title, **s.facts} for s in self.sections}


async def build_runbook(settings: Settings, js: JetStreamContext | None) -> Runbook:
    """The runbook for ``settings``; ``js`` (None: servers not reachable) adds what the
    servers hold."""
    return Runbook(
        [
            lease_section(settings),
            await dedupe_section(settings, js),
            quarantine_section(settings),
            await versions_section(settings, js),
            escape_hatch_section(settings),
        ]
    )


def lease_section(settings: Settings) -> Section:
    """(a) The lease contract."""
    fleet = settings.fleet
    ttl = fleet.lease_ttl_s
    renew = ttl / 3
    server_ttl = max(1, math.ceil(ttl))
    lines = [
        f"- Lease TTL: **{ttl:g} s** (`fleet.lease_ttl_s`), judged by the NATS server's "
        f"clock: a per-key TTL of {server_ttl} s on `{subjects.BUCKET_LEASES}`. No worker "
        "clock decides whether a lease lives.",
        f"- Renewal: every **{renew:g} s** (TTL/3): a leaser renew plus `msg.in_progress()` "
        f"on the delivery, whose `ack_wait` is {fleet.ack_wait_s:g} s (`fleet.ack_wait_s`).",
        "- When a renewal fails, someone else owns the job: the worker **stops** the "
        "attempt (it cancels the handler), **keeps nothing of it** (no report to the "
        "sink; the attempt's outcome, if a request was sent, is published as retryable), "
        "and **does not ack** (nor nak or term) the delivery; the sink would refuse a "
        "report anyway (`rejected:fenced-out` / `rejected:lease-expired`). The identity's "
        "cookie jar is the identity's, shared by its jobs: cookies the target set during "
        "the attempt stay, it is not rolled back (a challenge discards the target's "
        "cookies: docs/identities.md).",
        "- Every grant has a fence (a KV revision, only growing). The sink commits only "
        "under the live lease's fence, and only the job, target and idempotency key that "
        "lease was granted for (`rejected:not-granted` otherwise).",
    ]
    facts = {
        "lease_ttl_s": ttl,
        "server_ttl_s": server_ttl,
        "renew_every_s": renew,
        "ack_wait_s": fleet.ack_wait_s,
        "on_renewal_failure": [
            "stop (cancel the handler)",
            "keep nothing of the attempt",
            "do not ack, nak or term",
        ],
    }
    return Section("lease", "Lease contract", lines, facts)


def key_format() -> str:
    """How an idempotency key is made (jetfleet.canonical.idempotency_key)."""
    return (
        "`u-` + SHA-256 prefix of: handler, pinned identity, canonical URL (scheme and host "
        "lower-cased, default port dropped, path normalised, query sorted, fragment "
        "dropped), then the handler's args (sorted JSON) if any, `store-body` if the body "
        "is kept, `region:<pin>` if the job is pinned to a region; or `x-` + SHA-256 prefix "
        "of the job's own `idempotency_key` when it gives one"
    )


async def dedupe_section(settings: Settings, js: JetStreamContext | None) -> Section:
    """(b) The dedupe key per job kind, its TTL and its store."""
    fleet = settings.fleet
    needed = retry_horizon_s(settings) + fleet.ack_wait_s
    handlers = list(known_handlers(settings))
    kept = results_max_age(settings)
    live = await _stream_max_age(js, subjects.STREAM_RESULTS)
    lines = [f"- Key, for every handler ({', '.join(f'`{h}`' for h in handlers)}): {key_format()}."]
    lines += [
        f"- Store: the result record is the key: `{subjects.STREAM_RESULTS}` subject "
        "`jf.results.<target>.<key>`, written put-if-absent "
        "(`Nats-Expected-Last-Subject-Sequence: 0`).",
        f"- TTL: **{kept:g} s**: a committed key is remembered as long as its result "
        f"record is kept, the max of `fleet.dedupe_ttl_s` ({fleet.dedupe_ttl_s:g} s) and "
        f"`fleet.retention_s` ({fleet.retention_s:g} s); a job with the key submitted "
        "again within it is suppressed, not run"
        + (f"; the server says max_age {live:g} s." if live is not None else "."),
        f"- Config check: dedupe TTL {fleet.dedupe_ttl_s:g} s >= retry horizon "
        f"{retry_horizon_s(settings):g} s + visibility timeout {fleet.ack_wait_s:g} s = "
        f"{needed:g} s: **{'holds' if fleet.dedupe_ttl_s >= needed else 'VIOLATED'}** "
        "(a config that violates it is refused at start).",
    ]
    facts = {
        "handlers": {h: key_format() for h in handlers},
        "store": {"stream": subjects.STREAM_RESULTS, "subject": "jf.results.<target>.<key>"},
        "dedupe_ttl_s": fleet.dedupe_ttl_s,
        "key_kept_s": kept,
        "results_max_age_s": kept,
        "results_max_age_s_on_server": live,
        "retry_horizon_s": retry_horizon_s(settings),
        "needed_s": needed,
        "check_holds": fleet.dedupe_ttl_s >= needed,
    }
    return Section("dedupe", "Dedupe keys", lines, facts)


def quarantine_section(settings: Settings) -> Section:
    """(c) The quarantine triggers, as counts over windows."""
    q = settings.quarantine
    rules = [
        {
            "name": r.label,
            "count": r.count,
            "reasons": list(r.reasons),
            "scope": r.scope,
            "window_s": r.window_s,
            "action": r.action,
            "for_s": r.for_s,
        }
        for r in q.rules
    ]
    lines = [
        f"- `{r.label}`: {r.count} outcome(s) {'/'.join(r.reasons)} from one {r.scope} on "
        f"one target within {r.window_s:g} s -> {r.action} for {r.for_s:g} s"
        for r in q.rules
    ] or ["- No quarantine rules (`quarantine.rules = []`)."]
    egress, breaker = q.egress, q.breaker
    if egress.identities:
        lines.append(
            f"- Egress proposal `{egress.name}`: {egress.identities} distinct identities of "
            f"one subnet with {'/'.join(egress.reasons)} on one target within "
            f"{egress.window_s:g} s -> an egress quarantine proposed for {egress.for_s:g} s; "
            f"an operator approves it (`jetfleet quarantine approve ID`) within "
            f"{egress.proposal_ttl_s:g} s or it lapses."
        )
    if breaker.enabled:
        lines.append(
            f"- Circuit breaker: refusals ({'/'.join(breaker.reasons)}) on one target from "
            f"{breaker.identities} distinct identities within {breaker.window_s:g} s -> the "
            f"target is paused fleet-wide for {breaker.cool_s:g} s, then one probe; a "
            f"refused probe doubles the cooling up to {breaker.max_cool_s:g} s."
        )
    facts = {
        "rules": rules,
        "egress": {
            "identities": egress.identities,
            "reasons": list(egress.reasons),
            "window_s": egress.window_s,
            "for_s": egress.for_s,
            "proposal_ttl_s": egress.proposal_ttl_s,
        },
        "breaker": {
            "enabled": breaker.enabled,
            "identities": breaker.identities,
            "reasons": list(breaker.reasons),
            "window_s": breaker.window_s,
            "cool_s": breaker.cool_s,
            "max_cool_s": breaker.max_cool_s,
        },
    }
    return Section("quarantine", "Quarantine triggers", lines, facts)


async def versions_section(settings: Settings, js: JetStreamContext | None) -> Section:
    """(d) The version tuple this machine advertises, the gate, and the approved set."""
    title = "Versions"
    try:
        return await _versions(settings, js)
    except Exception as exc:  # one section must not sink the runbook
        detail = f"versions: could not be read ({type(exc).__name__}: {exc})"
        return Section("versions", title, [detail], {"available": False, "error": str(exc)})


async def _versions(settings: Settings, js: JetStreamContext | None) -> Section:
    """The versions section from the approved set's records and the local tuple."""
    local = local_tuple(settings)
    local_id = tuple_id(local)
    fields = msgspec.to_builtins(local)
    approved = [] if js is None else [tid for tid, _age in await approved_tuples(js)]
    gate = settings.versions.gate
    lines = [
        f"- This machine advertises tuple `{local_id}`: "
        + ", ".join(f"{k} `{v}`" for k, v in fields.items() if v)
        + ".",
        "- Approved set: "
        + (", ".join(f"`{tid}`" for tid in approved) if approved else "none read")
        + (" (servers not reachable)" if js is None else "")
        + f"; this tuple is {'approved' if local_id in approved else 'NOT approved'}.",
        f"- Gate `{gate}` (docs/versions.md): `when-set` refuses unapproved tuples once any "
        "tuple has been approved (while one is, or one was withdrawn), `always` refuses "
        "them always, `off` never.",
        "- `jetfleet versions list | approve | revoke` (operators); the leaser refuses an "
        "unapproved tuple `version-not-approved`.",
    ]
    facts = {
        "available": True,
        "gate": gate,
        "local": {"id": local_id, **fields},
        "approved": approved,
        "local_approved": local_id in approved,
    }
    return Section("versions", "Versions", lines, facts)


def escape_hatch_section(settings: Settings) -> Section:
    """(e) The escape hatch: the pause commands, and who may use them."""
    commands = [
        "jetfleet pause [--target T|--region R|--worker W|--identity I] [--for D] [--drain|--now]",
        "jetfleet resume [--target T|--region R|--worker W|--identity I]",
    ]
    lines = [
        *(f"- `{c}`" for c in commands),
        "- Without a scope the whole fleet pauses. `--drain` lets held leases finish; "
        "`--now` revokes them and requeues their jobs. `--for 30m` ends the pause by "
        "itself. New grants in scope stop within 1 s (I7); pause state survives restarts.",
        "- Who may: the **operator** role only (NATS permissions from `jetfleet auth "
        "init`, docs/security.md). Workers and services cannot publish the control "
        "subjects. Every pause and resume is recorded: `jetfleet audit --since 1h`.",
    ]
    facts = {"commands": commands, "role": "operator", "audit": "jetfleet audit"}
    return Section("escape_hatch", "Escape hatch", lines, facts)


async def _stream_max_age(js: JetStreamContext | None, stream: str) -> float | None:
    """A stream's max_age as the server has it; None when it cannot be read."""
    if js is None:
        return None
    try:
        info = await js.stream_info(stream)
    except Exception:  # a fact the runbook can do without
        return None
    return info.config.max_age
