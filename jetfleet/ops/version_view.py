"""The approved version set, the tuples seen lately and the withdrawn ones, for operators
(``jetfleet versions list``, the runbook): read from ``jf-control`` by
``jetfleet.version_records``, which the leaser (serving ``versions list``) and the
rollout guard read with too, since the core imports no operator tooling."""

from __future__ import annotations

from jetfleet.version_records import approved_tuples, guard_state, version_view

__all__ = ["approved_tuples", "guard_state", "version_view"]
