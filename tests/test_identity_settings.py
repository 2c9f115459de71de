"""Identities in config: declared as ``[identities.NAME]``, a worker's identity must be
one of them, and an identity never leaves its region. Pure unit tests (no servers)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from jetfleet.dev.settings_file import settings_toml, toml_value
from jetfleet.errors import ConfigError
from jetfleet.settings import IdentitySettings, owned_identity, with_identity
from jetfleet.worker.runtime import Worker
from tests.test_settings import config_error, load_text

TARGET = '[targets.demo]\nbase_url = "https://example.org/"\n'
ALICE = '[identities.alice]\nstate_dir = "/var/lib/jetfleet/alice"\negress = "eu-1"\n'
ALICE += 'subnet = "10.1.0.0/24"\nregion = "eu"\n'


def test_identities_are_declared_as_tables_with_state_egress_subnet_and_region(
    tmp_path: Path,
) -> None:
    settings = load_text(tmp_path, TARGET + ALICE + '[worker]\nidentity = "alice"\n')
    assert settings.identities == {
        "alice": IdentitySettings(
            state_dir="/var/lib/jetfleet/alice", egress="eu-1", subnet="10.1.0.0/24", region="eu"
        )
    }


def test_a_worker_identity_that_is_not_declared_is_refused_naming_the_declared_ones(
    tmp_path: Path,
) -> None:
    message = config_error(tmp_path, TARGET + ALICE + '[worker]\nidentity = "bob"\n')
    assert "worker.identity" in message and "'bob' is not declared" in message
    assert '[identities."bob"]' in message and "alice" in message


def test_an_undeclared_identity_from_the_environment_is_refused_too(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + ALICE, {"JETFLEET_WORKER__IDENTITY": "bob"})
    assert "'bob' is not declared" in message


def test_with_no_identities_declared_an_identity_is_free_text_as_before(tmp_path: Path) -> None:
    settings = load_text(tmp_path, TARGET + '[worker]\nidentity = "p-osaka"\nregion = "ap"\n')
    assert settings.identities == {}
    worker = with_identity(settings, "anything at all").worker
    assert (worker.identity, worker.region, worker.egress) == ("anything at all", "ap", "")


def test_an_identity_never_leaves_its_region(tmp_path: Path) -> None:
    text = TARGET + ALICE + '[worker]\nidentity = "alice"\nregion = "us"\n'
    message = config_error(tmp_path, text)
    assert "worker.region is 'us'" in message
    assert "identities.alice.region is 'eu'" in message
    assert "never leaves its region" in message


def test_an_identity_named_on_the_command_line_is_checked_against_the_worker_region(
    tmp_path: Path,
) -> None:
    settings = load_text(tmp_path, TARGET + ALICE + '[worker]\nregion = "us"\n')
    with pytest.raises(ConfigError, match="never leaves its region"):
        with_identity(settings, "alice")  # what `jetfleet worker --identity alice` does
    with pytest.raises(ConfigError, match="'carol' is not declared"):
        with_identity(settings, "carol")


def test_an_identity_brings_its_region_and_egress_to_a_worker_that_sets_none(
    tmp_path: Path,
) -> None:
    settings = load_text(tmp_path, TARGET + ALICE)
    worker = with_identity(settings, "alice").worker
    assert (worker.identity, worker.region, worker.egress) == ("alice", "eu", "eu-1")
    same = load_text(tmp_path, TARGET + ALICE + '[worker]\nregion = "eu"\negress = "eu-1"\n')
    assert with_identity(same, "alice").worker.region == "eu"


def test_a_worker_egress_other_than_its_identity_egress_is_refused(tmp_path: Path) -> None:
    message = config_error(
        tmp_path, TARGET + ALICE + '[worker]\nidentity = "alice"\negress = "us-2"\n'
    )
    assert "worker.egress is 'us-2'" in message and "identities.alice.egress" in message


def test_a_subnet_that_is_not_a_network_is_refused_with_an_example(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + '[identities.x]\nsubnet = "10.1.0.5/24"\n')
    assert "identities.x.subnet is invalid" in message and "10.1.0.0/24" in message
    assert "identities.x.subnet" in config_error(
        tmp_path, TARGET + '[identities.x]\nsubnet = "eu-west"\n'
    )


def test_a_subnet_spelled_other_than_canonically_is_refused_with_its_canonical_spelling(
    tmp_path: Path,
) -> None:
    # Egress records and subnet lanes compare subnets as text.
    message = config_error(tmp_path, TARGET + '[identities.x]\nsubnet = "2001:DB8::/64"\n')
    assert "identities.x.subnet is '2001:DB8::/64'" in message and "'2001:db8::/64'" in message
    message = config_error(tmp_path, TARGET + '[worker]\nsubnet = "2001:db8:0::/64"\n')
    assert "worker.subnet" in message and "'2001:db8::/64'" in message


def test_an_unknown_key_inside_an_identity_is_named_with_the_identity(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + '[identities.alice]\ncookies = "x"\n')
    assert "unknown key 'identities.alice.cookies'" in message


def test_identities_must_be_a_table_of_tables(tmp_path: Path) -> None:
    message = config_error(tmp_path, 'identities = "alice"\n' + TARGET)
    assert "[identities.NAME]" in message


def test_the_claim_ttl_is_bounded(tmp_path: Path) -> None:
    assert load_text(tmp_path, TARGET).worker.claim_ttl_s == 30.0
    message = config_error(tmp_path, TARGET + "[worker]\nclaim_ttl_s = 1\n")
    assert "worker.claim_ttl_s is invalid" in message and "from 2 to 600" in message


def test_two_identities_with_one_state_dir_are_refused_naming_both(tmp_path: Path) -> None:
    bob = '[identities."bob smith"]\nstate_dir = "/var/lib/jetfleet/alice/"\n'
    message = config_error(tmp_path, TARGET + ALICE + bob)
    assert 'identities."alice".state_dir' in message
    assert 'identities."bob smith".state_dir' in message
    assert "/var/lib/jetfleet/alice" in message


def test_an_undeclared_identity_is_suggested_as_a_toml_table_that_loads_whole(
    tmp_path: Path,
) -> None:
    name = "p.lisbon 2 " + "x" * 150  # a dot and a space, and longer than 80
    settings = load_text(tmp_path, TARGET + ALICE)
    with pytest.raises(ConfigError) as refused:
        owned_identity(settings, name)
    message = str(refused.value)
    table = message.split("declare it as ")[1].split(" or use one of")[0]
    assert list(tomllib.loads(table + "\n")["identities"]) == [name]
    assert repr(name) in message, "the name was cut short"


def test_a_worker_identity_with_a_control_character_is_refused_as_such(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + ALICE + '[worker]\nidentity = "al\\u0001ice"\n')
    assert "worker.identity is invalid" in message and "control characters" in message
    assert "not declared" not in message


def test_settings_written_for_jetfleet_dev_load_back_with_any_identity_name(
    tmp_path: Path,
) -> None:
    name = "bot \U0001f600 n\u00e9e"  # beyond the BMP: JSON's \\u escapes are surrogates
    settings = load_text(tmp_path, TARGET + ALICE)
    identities = {**settings.identities, name: IdentitySettings(region="eu")}
    settings = msgspec.structs.replace(settings, identities=identities)
    assert list(load_text(tmp_path, settings_toml(settings)).identities) == ["alice", name]
    assert tomllib.loads("k = " + toml_value("a\x7fb\U0001f600"))["k"] == "a\x7fb\U0001f600"


def test_an_identity_on_the_command_line_with_a_control_character_is_refused_as_such(
    tmp_path: Path,
) -> None:
    settings = load_text(tmp_path, TARGET + ALICE)
    with pytest.raises(ConfigError) as refused:
        # Refused before the connection is touched.
        Worker(settings, None, "w-1", identity="al\x01ice")  # type: ignore[arg-type]
    message = str(refused.value)
    assert "worker.identity (or --identity)" in message and "control characters" in message
    assert "not declared" not in message
