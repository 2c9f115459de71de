"""Settings: every config error names the key and the fix; the environment overrides the
file; the result is frozen. Pure unit tests (no servers)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from jetfleet.auth.credentials import without_secrets
from jetfleet.errors import ConfigError
from jetfleet.redis_url import parse_redis_url
from jetfleet.settings import Settings, load_settings

TARGET = '[targets.demo]\nbase_url = "https://example.org/"\n'


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "jetfleet.toml"
    path.write_text(text)
    return load_settings(path, env or {})


def config_error(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text, env)
    return str(info.value)


# --- unknown keys ---------------------------------------------------------------------


def test_an_unknown_top_level_key_is_named_and_the_fix_is_to_remove_or_respell_it(
    tmp_path: Path,
) -> None:
    message = config_error(tmp_path, "colour = 1\n" + TARGET)
    assert "unknown key 'colour'" in message
    assert "remove it or fix its spelling" in message
    assert str(tmp_path / "jetfleet.toml") in message


def test_an_unknown_key_inside_a_section_is_named_with_its_section(tmp_path: Path) -> None:
    message = config_error(tmp_path, "[fleet]\nack_wait = 90\n")
    assert "unknown key 'fleet.ack_wait'" in message
    assert "remove it or fix its spelling" in message


def test_an_unknown_key_inside_a_target_is_named_with_the_target(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + "ratee = 2\n")
    assert "unknown key 'targets.demo.ratee'" in message
    assert "remove it or fix its spelling" in message


def test_an_unknown_key_from_the_environment_is_named(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET, {"JETFLEET_FLEET__BOGUS": "1"})
    assert "'fleet.bogus'" in message
    assert "JETFLEET_FLEET__BOGUS" in message  # not in the file: name where it came from
    assert "remove it or fix its spelling" in message


# --- wrong types ----------------------------------------------------------------------


def test_a_wrong_type_in_a_target_names_the_key_the_type_and_what_to_set(
    tmp_path: Path,
) -> None:
    message = config_error(tmp_path, TARGET + 'rate = "fast"\n')
    assert "targets.demo.rate" in message
    assert "Expected `float`, got `str`" in message
    assert "set it to a number of requests per second, at least 1/86400" in message


def test_a_fractional_burst_is_refused_as_not_a_whole_number(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + "burst = 1.5\n")
    assert "targets.demo.burst" in message
    assert "Expected `int`" in message
    assert "set it to a whole number >= 1" in message


def test_a_wrong_type_in_a_section_names_the_dotted_key(tmp_path: Path) -> None:
    message = config_error(tmp_path, "[nats]\nurl = 5\n")
    assert "nats.url" in message
    assert "Expected `str`, got `int`" in message
    assert "nats://" in message


def test_a_target_without_base_url_names_the_target_and_the_missing_field(
    tmp_path: Path,
) -> None:
    message = config_error(tmp_path, "[targets.demo]\nrate = 2\n")
    assert "targets.demo" in message
    assert "base_url" in message


def test_targets_that_are_not_a_table_say_how_to_declare_them(tmp_path: Path) -> None:
    message = config_error(tmp_path, "targets = 3\n")
    assert "targets must be a table of [targets.NAME] tables" in message


# --- rules a type cannot express ------------------------------------------------------


@pytest.mark.parametrize(
    "base_url", ["ftp://example.org/", "example.org", "/relative/path", "https://", ""]
)
def test_a_base_url_that_is_not_an_absolute_http_url_is_refused(
    tmp_path: Path, base_url: str
) -> None:
    message = config_error(tmp_path, f'[targets.demo]\nbase_url = "{base_url}"\n')
    assert "targets.demo.base_url" in message
    assert "an absolute http(s) URL such as https://example.org/" in message


@pytest.mark.parametrize("name", ["Demo", "a.b", "-lead", "has space", "x" * 65, "_under"])
def test_a_target_name_that_cannot_be_a_subject_token_is_refused(tmp_path: Path, name: str) -> None:
    message = config_error(tmp_path, f'[targets."{name}"]\nbase_url = "https://example.org/"\n')
    assert f"targets.{name}" in message
    assert "lowercase letters, digits, '-' or '_'" in message
    assert "NATS subject token" in message


@pytest.mark.parametrize("rate", ["0", "-1", "0.0"])
def test_a_rate_that_is_not_positive_is_refused(tmp_path: Path, rate: str) -> None:
    message = config_error(tmp_path, TARGET + f"rate = {rate}\n")
    assert "targets.demo.rate" in message
    assert "a number of requests per second, at least 1/86400 (one a day)" in message


@pytest.mark.parametrize("seconds", ["0.01", "2.5", "0"])
def test_a_long_poll_out_of_range_is_refused_saying_the_range(tmp_path: Path, seconds: str) -> None:
    message = config_error(tmp_path, f"[fleet]\nlong_poll_s = {seconds}\n" + TARGET)
    assert "fleet.long_poll_s" in message
    assert "from 0.05 to 2 " in message


def test_a_long_poll_in_range_is_taken(tmp_path: Path) -> None:
    assert load_text(tmp_path, "[fleet]\nlong_poll_s = 0.25\n" + TARGET).fleet.long_poll_s == 0.25


def test_a_burst_of_zero_is_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET + "burst = 0\n")
    assert "targets.demo.burst" in message
    assert "a whole number >= 1" in message


@pytest.mark.parametrize(("ack_wait", "lease_ttl"), [(30, 30), (20, 30)])
def test_ack_wait_not_above_the_lease_ttl_is_refused_naming_both(
    tmp_path: Path, ack_wait: int, lease_ttl: int
) -> None:
    message = config_error(
        tmp_path, f"[fleet]\nack_wait_s = {ack_wait}\nlease_ttl_s = {lease_ttl}\n" + TARGET
    )
    assert "fleet.ack_wait_s" in message
    assert "more than fleet.lease_ttl_s (30 s)" in message


def test_ack_wait_must_exceed_the_lease_ttl_as_the_server_rounds_it(tmp_path: Path) -> None:
    # A 2.5 s lease lives 3 s on the server (per-key TTLs are whole seconds).
    message = config_error(tmp_path, "[fleet]\nack_wait_s = 2.8\nlease_ttl_s = 2.5\n" + TARGET)
    assert "more than fleet.lease_ttl_s (3 s)" in message


def test_ack_wait_a_second_above_the_lease_ttl_is_accepted(tmp_path: Path) -> None:
    settings = load_text(tmp_path, "[fleet]\nack_wait_s = 31\nlease_ttl_s = 30\n" + TARGET)
    assert settings.fleet.ack_wait_s == 31


def test_finding5_ack_wait_less_than_a_second_above_the_lease_ttl_is_refused(
    tmp_path: Path,
) -> None:
    # The worker counts its lease lost a TTL after its last renewal, then stops.
    message = config_error(tmp_path, "[fleet]\nack_wait_s = 30.5\nlease_ttl_s = 30\n" + TARGET)
    assert "fleet.ack_wait_s" in message and ">= 31 s" in message
    assert "fleet.lease_ttl_s" in message


def test_a_dedupe_ttl_shorter_than_retry_horizon_plus_visibility_shows_the_arithmetic(
    tmp_path: Path,
) -> None:
    # Worst target: 5 attempts; 5 x 20 s max backoff + 40 s ack_wait = 140 s needed.
    text = (
        "[fleet]\ndedupe_ttl_s = 100\nretry_max_backoff_s = 20\nack_wait_s = 40\n"
        "lease_ttl_s = 10\n" + TARGET + "max_attempts = 5\n"
        '[targets.other]\nbase_url = "https://other.example/"\nmax_attempts = 2\n'
    )
    message = config_error(tmp_path, text)
    assert "fleet.dedupe_ttl_s = 100 s" in message
    assert "retry horizon plus the visibility timeout" in message
    assert "5 attempts x 20 s max backoff + 40 s ack_wait = 140 s" in message
    assert "Set fleet.dedupe_ttl_s to at least 140" in message


def test_a_dedupe_ttl_equal_to_the_minimum_is_accepted(tmp_path: Path) -> None:
    text = (
        "[fleet]\ndedupe_ttl_s = 140\nretry_max_backoff_s = 20\nack_wait_s = 40\n"
        "lease_ttl_s = 10\n" + TARGET + "max_attempts = 5\n"
    )
    assert load_text(tmp_path, text).fleet.dedupe_ttl_s == 140.0


def test_the_default_dedupe_rule_without_targets_uses_three_attempts(tmp_path: Path) -> None:
    # No targets: 3 attempts x 60 s default max backoff + 60 s default ack_wait = 240 s.
    message = config_error(tmp_path, "[fleet]\ndedupe_ttl_s = 239\n")
    assert "3 attempts x 60 s max backoff + 60 s ack_wait = 240 s" in message
    assert "at least 240" in message


def test_worker_targets_must_be_declared_targets(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET, {"JETFLEET_WORKER__TARGETS": "demo,ghost"})
    assert "worker.targets" in message
    assert "'ghost'" in message


def test_worker_standby_targets_must_be_declared_targets(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET, {"JETFLEET_WORKER__STANDBY_TARGETS": "ghost"})
    assert "worker.standby_targets" in message
    assert "'ghost'" in message


# --- the file itself ------------------------------------------------------------------


def test_a_missing_config_file_is_named_with_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "jetfleet.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(missing, {})
    assert str(missing) in str(info.value)
    assert "does not exist" in str(info.value)
    assert "--config/JETFLEET_CONFIG" in str(info.value)


def test_a_missing_config_file_named_by_jetfleet_config_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "gone.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(None, {"JETFLEET_CONFIG": str(missing)})


def test_invalid_toml_is_refused_with_the_file_and_the_position(tmp_path: Path) -> None:
    message = config_error(tmp_path, "[fleet\nack_wait_s = 1\n")
    assert str(tmp_path / "jetfleet.toml") in message
    assert "is not valid TOML" in message
    assert "line 1" in message


def test_a_config_path_that_is_a_directory_is_refused_as_a_config_error(
    tmp_path: Path,
) -> None:
    # Not an OSError traceback: the CLI reports ConfigErrors as "what to fix".
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path, {})
    assert str(tmp_path) in str(info.value)


def test_a_config_file_that_is_not_utf8_is_refused_as_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_bytes(b"\xff\xfe[fleet]\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert str(path) in str(info.value)


def test_the_config_file_can_be_named_by_jetfleet_config(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.toml"
    path.write_text(TARGET)
    settings = load_settings(None, {"JETFLEET_CONFIG": str(path)})
    assert settings.targets["demo"].base_url == "https://example.org/"


def test_no_file_and_no_environment_gives_valid_defaults() -> None:
    settings = load_settings(None, {})
    assert settings.targets == {}
    assert settings.fleet.ack_wait_s > settings.fleet.lease_ttl_s


# --- environment overrides ------------------------------------------------------------


def test_nats_url_and_redis_url_from_the_environment_override_the_file(
    tmp_path: Path,
) -> None:
    text = '[nats]\nurl = "nats://file:4222"\n[redis]\nurl = "redis://file:6379/0"\n' + TARGET
    settings = load_text(
        tmp_path, text, {"NATS_URL": "nats://env:4333", "REDIS_URL": "redis://env:6380/2"}
    )
    assert settings.nats.url == "nats://env:4333"
    assert settings.redis.url == "redis://env:6380/2"


@pytest.mark.parametrize(
    ("url", "kind", "nodes", "service"),
    [
        ("redis://r:6379/2", "single", (), ""),
        ("redis+cluster://u:p%40w@r1:7000,r2:7001,[::1]:7002", "cluster", 3, ""),
        ("redis+cluster://r1", "cluster", 1, ""),
        ("rediss+sentinel://s1:26379,s2/jf-master/3", "sentinel", 2, "jf-master"),
    ],
)
def test_a_redis_url_names_one_server_a_cluster_or_a_sentinel_master(
    url: str, kind: str, nodes: int | tuple[()], service: str
) -> None:
    settings = load_settings(None, {"REDIS_URL": url})
    topology = parse_redis_url(settings.redis.url)
    assert topology.kind == kind and topology.service == service
    if kind != "single":
        assert len(topology.nodes) == nodes
    if "p%40w" in url:
        assert (topology.username, topology.password) == ("u", "p@w")
        assert topology.nodes[2] == ("::1", 7002)
    if kind == "sentinel":
        assert topology.db == 3 and topology.tls and topology.nodes[1] == ("s2", 26379)


def test_a_sentinel_url_carries_the_sentinels_own_credentials_apart_from_the_data_nodes() -> None:
    url = "redis+sentinel://data:d%40ta@s1,s2:26380/jf/1?sentinel_password=s%26nt&sentinel_username=watch"
    topology = parse_redis_url(load_settings(None, {"REDIS_URL": url}).redis.url)
    assert (topology.username, topology.password) == ("data", "d@ta")
    assert (topology.sentinel_username, topology.sentinel_password) == ("watch", "s&nt")
    assert (topology.service, topology.db, topology.nodes[1]) == ("jf", 1, ("s2", 26380))
    # Without the option the Sentinels are asked without credentials, as before.
    assert parse_redis_url("redis+sentinel://s1/jf").sentinel_password is None
    assert "s%26nt" not in without_secrets(url) and "d%40ta" not in without_secrets(url)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://r1:7000/2", "a Redis Cluster has only database 0"),
        ("redis+sentinel://s1:26379", "name the master Sentinel watches"),
        ("redis+cluster://r1:70000", "'r1:70000' is not a startup node host:port"),
        ("redis+cluster://r1:7000,", "'' is not a startup node host:port"),
        ("redis+sentinel://u:secret@s1:x/m", "'s1:x' is not a Sentinel host:port"),
        ("redis+cluster://r1:7000?ssl=1", "takes no ?options"),
        ("redis+sentinel://s1/m?sentinel_password=secret&ssl=1", "not 'ssl'"),
        ("redis+sentinel://s1/m?sentinel_username=u", "needs its sentinel_password"),
        ("redis+sentinel://s1/m?sentinel_password=x&sentinel_password=secret", "each once"),
        ("rediscluster://r1:7000", "unknown scheme 'rediscluster'"),
    ],
)
def test_a_bad_redis_url_is_refused_at_start_saying_what_to_fix(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {"REDIS_URL": url})
    assert says in str(refused.value) and "redis.url" in str(refused.value)
    assert "secret" not in str(refused.value)


def test_a_section_key_variable_becomes_a_typed_float(tmp_path: Path) -> None:
    settings = load_text(
        tmp_path, "[fleet]\nack_wait_s = 45\n" + TARGET, {"JETFLEET_FLEET__ACK_WAIT_S": "90"}
    )
    assert settings.fleet.ack_wait_s == 90.0
    assert isinstance(settings.fleet.ack_wait_s, float)


def test_a_section_key_variable_becomes_a_typed_int(tmp_path: Path) -> None:
    settings = load_text(tmp_path, TARGET, {"JETFLEET_WORKER__CONCURRENCY": "3"})
    assert settings.worker.concurrency == 3


def test_worker_targets_from_the_environment_split_on_commas(tmp_path: Path) -> None:
    text = (
        '[targets.a]\nbase_url = "https://a.example/"\n'
        '[targets.b]\nbase_url = "https://b.example/"\n'
    )
    settings = load_text(tmp_path, text, {"JETFLEET_WORKER__TARGETS": "a,b"})
    assert settings.worker.targets == ("a", "b")


def test_a_badly_typed_environment_value_names_the_key(tmp_path: Path) -> None:
    message = config_error(tmp_path, TARGET, {"JETFLEET_FLEET__ACK_WAIT_S": "ninety"})
    assert "fleet.ack_wait_s" in message
    assert "Expected `float`, got `str`" in message


def test_a_badly_typed_environment_value_names_its_variable_not_the_file(
    tmp_path: Path,
) -> None:
    # The value is not in the file: the message must send the operator to the variable.
    message = config_error(tmp_path, TARGET, {"JETFLEET_FLEET__ACK_WAIT_S": "ninety"})
    assert "JETFLEET_FLEET__ACK_WAIT_S" in message


def test_environment_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    message = config_error(
        tmp_path, TARGET, {"JETFLEET_FLEET__ACK_WAIT_S": "5", "JETFLEET_FLEET__LEASE_TTL_S": "10"}
    )
    assert "fleet.ack_wait_s" in message
    assert "more than fleet.lease_ttl_s (10 s)" in message


def test_unrelated_environment_variables_are_ignored(tmp_path: Path) -> None:
    settings = load_text(
        tmp_path, TARGET, {"HOME": "/root", "JETFLEET_CONFIGX": "1", "PATH": "/bin"}
    )
    assert settings.fleet.ack_wait_s == 60.0


# --- frozen ---------------------------------------------------------------------------


def test_settings_are_frozen_at_every_level(tmp_path: Path) -> None:
    settings = load_text(tmp_path, TARGET)
    with pytest.raises(AttributeError):
        settings.fleet = settings.fleet  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.fleet.ack_wait_s = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.nats.url = "nats://elsewhere:4222"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.targets["demo"].rate = 99.0  # type: ignore[misc]


def test_a_changed_copy_is_a_new_object_and_the_original_is_untouched(tmp_path: Path) -> None:
    settings = load_text(tmp_path, TARGET)
    fleet = msgspec.structs.replace(settings.fleet, ack_wait_s=120.0)
    assert fleet.ack_wait_s == 120.0
    assert settings.fleet.ack_wait_s == 60.0


def test_settings_can_be_hashed_and_compared_by_value(tmp_path: Path) -> None:
    one, two = load_text(tmp_path, TARGET), load_text(tmp_path, TARGET)
    assert one == two
    assert hash(one.fleet) == hash(two.fleet)
    assert hash(one.targets["demo"]) == hash(two.targets["demo"])


def test_settings_target_names_an_undeclared_target_and_the_fix(tmp_path: Path) -> None:
    settings = load_text(tmp_path, TARGET)
    assert settings.target("demo").base_url == "https://example.org/"
    with pytest.raises(ConfigError, match=r"\[targets\.ghost\]"):
        settings.target("ghost")


# --- quarantine rules -----------------------------------------------------------------

RULE = (
    '[[quarantine.rules]]\non = "challenged"\nscope = "identity"\ncount = 3\n'
    'window_s = 600\naction = "retire"\nfor_s = 3600\n'
)


def test_quarantine_rules_default_to_cooling_a_blocked_worker_and_retiring_an_identity() -> None:
    rules = load_settings(None, {}).quarantine.rules
    assert [(r.action, r.scope, r.reasons, r.count, r.window_s) for r in rules] == [
        ("cool", "worker", ("blocked",), 1, 60.0),
        ("retire", "identity", ("challenged", "blocked"), 3, 600.0),
    ]


def test_a_configured_rule_replaces_the_defaults_and_gets_a_name_from_its_fields(
    tmp_path: Path,
) -> None:
    (rule,) = load_text(tmp_path, RULE).quarantine.rules
    assert (rule.reasons, rule.count, rule.for_s) == (("challenged",), 3, 3600.0)
    assert rule.label == "retire-challenged-3-in-600s"


def test_an_empty_rule_list_sets_no_rule(tmp_path: Path) -> None:
    assert load_text(tmp_path, "[quarantine]\nrules = []\n").quarantine.rules == ()


def test_a_rule_may_count_several_reasons(tmp_path: Path) -> None:
    text = RULE.replace('on = "challenged"', 'on = ["challenged", "blocked"]')
    (rule,) = load_text(tmp_path, text).quarantine.rules
    assert rule.reasons == ("challenged", "blocked")


@pytest.mark.parametrize(
    ("old", "new", "key", "fix"),
    [
        ('on = "challenged"', 'on = "http-404"', "quarantine.rules[0].on", "challenged, blocked"),
        ('on = "challenged"', "on = []", "quarantine.rules[0].on", "rate-limited"),
        ('scope = "identity"', 'scope = "worker"', "quarantine.rules[0].scope", '"identity"'),
        ("count = 3", "count = 0", "quarantine.rules[0].count", ">= 1"),
        ("window_s = 600", "window_s = 0", "quarantine.rules[0].window_s", "above 0"),
        ("for_s = 3600", "for_s = 0", "quarantine.rules[0].for_s", "from 1 to"),
    ],
)
def test_a_bad_rule_names_its_key_and_the_fix(
    tmp_path: Path, old: str, new: str, key: str, fix: str
) -> None:
    message = config_error(tmp_path, RULE.replace(old, new))
    assert f"{key} is invalid" in message and fix in message


@pytest.mark.parametrize("name", ["cool.", "a..b", "cool-", ".a"])
def test_a_rule_name_that_would_make_an_invalid_kv_key_is_refused(
    tmp_path: Path, name: str
) -> None:
    message = config_error(
        tmp_path, RULE.replace("[[quarantine.rules]]\n", f'[[quarantine.rules]]\nname = "{name}"\n')
    )
    assert "quarantine.rules[0].name is invalid" in message and "no '..'" in message


def test_a_rule_name_with_single_dots_is_taken(tmp_path: Path) -> None:
    text = RULE.replace("[[quarantine.rules]]\n", '[[quarantine.rules]]\nname = "cool.v2.b"\n')
    (rule,) = load_text(tmp_path, text).quarantine.rules
    assert rule.label == "cool.v2.b"


def test_a_rule_with_an_unknown_action_names_the_key(tmp_path: Path) -> None:
    message = config_error(tmp_path, RULE.replace('action = "retire"', 'action = "ban"'))
    assert "quarantine.rules[0].action" in message


def test_two_rules_with_one_name_are_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path, RULE + RULE)
    assert "quarantine.rules[1].name is invalid" in message
    assert "retire-challenged-3-in-600s" in message


def test_quarantine_egress_and_second_order_load_from_toml(tmp_path: Path) -> None:
    text = (
        "[quarantine]\nsecond_order_window_s = 1800\n"
        '[quarantine.egress]\nidentities = 3\nwindow_s = 120\nfor_s = 0\non = "challenged"\n'
        'proposal_ttl_s = 600\nname = "subnet-3"\n'
    )
    quarantine = load_text(tmp_path, text).quarantine
    egress = quarantine.egress
    assert (egress.identities, egress.window_s, egress.for_s) == (3, 120.0, 0.0)
    assert (egress.reasons, egress.proposal_ttl_s, egress.name) == (
        ("challenged",),
        600.0,
        "subnet-3",
    )
    assert quarantine.second_order_window_s == 1800.0
    defaults = load_settings(None, {}).quarantine
    assert (defaults.egress.identities, defaults.second_order_window_s) == (2, 3600.0)
    with pytest.raises(ConfigError, match=r"quarantine\.egress\.identities is invalid"):
        load_text(tmp_path, "[quarantine.egress]\nidentities = 1\n")


# --- [process] -------------------------------------------------------------------------


def test_the_event_loop_defaults_to_auto_and_the_environment_can_pick_asyncio(
    tmp_path: Path,
) -> None:
    assert load_text(tmp_path, TARGET).process.event_loop == "auto"
    chosen = load_text(tmp_path, TARGET, {"JETFLEET_PROCESS__EVENT_LOOP": "asyncio"})
    assert chosen.process.event_loop == "asyncio"


def test_an_unknown_event_loop_is_refused_naming_the_key_and_the_choices(
    tmp_path: Path,
) -> None:
    message = config_error(tmp_path, TARGET + '[process]\nevent_loop = "trio"\n')
    assert "process.event_loop" in message
    assert "auto" in message and "uvloop" in message and "asyncio" in message
