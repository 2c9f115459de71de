"""``jetfleet quarantine``: what the CLI itself refuses before asking the leaser."""

from __future__ import annotations

import argparse

import pytest
from jetfleet.schemas.lease import QuarantineRelease, QuarantineSet

from jetfleet.cli.quarantine_commands import _command
from jetfleet.errors import JetfleetError
from tests.conftest import make_settings
from tests.queueing.helpers import target


def _args(action: str, target_name: str) -> argparse.Namespace:
    return argparse.Namespace(
        quarantine_action=action,
        target=target_name,
        worker="w1",
        identity=None,
        reason="r",
        for_s=0.0,
        actor="ana",
        why="",
    )


def test_the_cli_releases_a_quarantine_on_a_target_the_settings_no_longer_declare() -> None:
    """The leaser lifts records of a dropped target; the CLI must not refuse it first."""
    settings = make_settings(
        "nats://127.0.0.1:1", "redis://127.0.0.1:1", {"demo": target("http://127.0.0.1:1/")}
    )
    release = _command(_args("release", "gone"), settings)
    assert release == QuarantineRelease(scope="worker", name="w1", target="gone", by="ana")
    with pytest.raises(JetfleetError, match="not a target name"):
        _command(_args("release", "Not A Target"), settings)
    with pytest.raises(JetfleetError):
        _command(_args("set", "gone"), settings)


def test_a_quarantine_set_from_the_cli_says_an_operator_set_it() -> None:
    settings = make_settings(
        "nats://127.0.0.1:1", "redis://127.0.0.1:1", {"demo": target("http://127.0.0.1:1/")}
    )
    command = _command(_args("set", "demo"), settings)
    assert isinstance(command, QuarantineSet)
    assert (command.record.set_by, command.record.evidence) == ("operator", [])


def test_the_cli_sets_and_releases_an_egress_quarantine_by_subnet() -> None:
    settings = make_settings(
        "nats://127.0.0.1:1", "redis://127.0.0.1:1", {"demo": target("http://127.0.0.1:1/")}
    )
    args = _args("set", "demo")
    args.worker, args.subnet = None, "10.1.0.0/24"
    command = _command(args, settings)
    assert isinstance(command, QuarantineSet)
    assert (command.record.scope, command.record.name) == ("egress", "10.1.0.0/24")
    args.quarantine_action = "release"
    assert _command(args, settings) == QuarantineRelease(
        scope="egress", name="10.1.0.0/24", target="demo", by="ana"
    )
