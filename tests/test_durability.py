"""The durability checks of docs/cluster.md: ``jetfleet doctor`` and the one start-up
line of ``jetfleet serve`` say when NATS is below R3 or a server does not sync every
write, say what to set, and stay quiet (one note) on ``jetfleet dev``'s own server.
Real servers: one nats-server, and 3-node clusters on loopback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
from nats.js.api import KeyValueConfig

from jetfleet import durability, subjects
from jetfleet.auth.bundle import Bundle
from jetfleet.cli import doctor_command, run_commands
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.ops.doctor import DoctorWarning
from jetfleet.settings import Settings, TargetSettings
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from tests.conftest import admin_url, make_settings, sim_target


def _codes(warnings: list[DoctorWarning]) -> list[str]:
    return [w.code for w in warnings]


def _with_nats(settings: Settings, **nats: object) -> Settings:
    return msgspec.structs.replace(settings, nats=msgspec.structs.replace(settings.nats, **nats))


def _on_cluster(
    cluster: EmbeddedCluster, redis_url: str, targets: dict[str, TargetSettings] | None = None
) -> Settings:
    settings = make_settings(admin_url(cluster.url), redis_url, targets or {})
    return _with_nats(settings, replicas=3, monitor_url=",".join(cluster.monitor_urls))


async def test_doctor_warns_below_r3_names_the_setting_and_notes_sync_unchecked(
    nats_url: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings(nats_url, redis_url, {})
    report = await doctor_command.collect(settings)
    assert _codes(report.all_warnings()) == ["replicas-below-3"]
    assert "set nats.replicas = 3" in report.all_warnings()[0].message
    assert any("sync_interval not checked" in n for n in report.notes), report.notes
    assert doctor_command.show(report) == 1
    out = capsys.readouterr().out
    assert "[replicas-below-3] fleet: nats.replicas = 1" in out
    assert "note: sync_interval not checked" in out


async def test_on_the_dev_server_the_findings_are_one_note_and_exit_zero(
    nats_url: str, redis_url: str
) -> None:
    settings = _with_nats(make_settings(nats_url, redis_url, {}), dev=True)
    report = await doctor_command.collect(settings)
    assert report.all_warnings() == [] and report.exit_code == 0
    assert report.notes[0].startswith("dev NATS (replicas-below-3)"), report.notes


async def test_a_service_says_it_once_at_start_as_a_warning_or_for_dev_as_info(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings("nats://127.0.0.1:9", redis_url, {})
    with caplog.at_level(logging.INFO, logger="jetfleet.cli.run_commands"):
        await run_commands._say_durability("sink", settings)
        await run_commands._say_durability("sink", _with_nats(settings, dev=True))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(said) == 2, said
    assert said[0][0] == logging.WARNING
    assert said[0][1].startswith("sink: NATS below production durability: nats.replicas = 1")
    assert said[0][1].endswith("; sync not checked (set nats.monitor_url)")
    assert said[1][0] == logging.INFO and said[1][1].startswith("sink: dev NATS")


async def test_an_r3_cluster_that_syncs_always_passes_every_check(
    nats_cluster: EmbeddedCluster, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = _on_cluster(nats_cluster, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "tests")
    try:
        js = nc.jetstream()
        await declare(js, settings)
        # Every stream, bucket and the object store R3; the consumers inherit it.
        streams = await js.streams_info()
        assert {s.config.name for s in streams} >= set(durability.KEPT_SAFE)
        assert {s.config.name: s.config.num_replicas for s in streams if s.config.name} == {
            s.config.name: 3 for s in streams if s.config.name
        }
        assert any(s.config.name == f"OBJ_{subjects.OBJECTS_RESULTS}" for s in streams)
        consumers = await js.consumers_info(subjects.STREAM_WORK)
        assert consumers and all(
            c.cluster is not None and len(c.cluster.replicas or []) == 2 for c in consumers
        ), [c.cluster for c in consumers]
    finally:
        await nc.close()
    report = await doctor_command.collect(settings)
    assert report.all_warnings() == [] and report.notes == [], report
    findings, checked = await durability.start_findings(settings)
    assert findings == [] and checked
    assert durability.start_line(findings, checked, dev=False) == ""


async def test_a_bucket_left_at_one_replica_is_found_live(
    nats_cluster: EmbeddedCluster, redis_url: str
) -> None:
    # Declaration never raises an existing bucket's replicas (docs/topology.md): one made
    # R1 before nats.replicas was 3 stays R1, whatever the setting says.
    settings = _on_cluster(nats_cluster, redis_url)
    nc = await connect_nats(settings.nats, "tests")
    js = nc.jetstream()
    try:
        await js.delete_key_value(subjects.BUCKET_FENCES)
        await js.create_key_value(KeyValueConfig(bucket=subjects.BUCKET_FENCES, replicas=1))
        report = await doctor_command.collect(settings)
        assert _codes(report.all_warnings()) == ["stream-replicas-below-3"]
        assert f"KV_{subjects.BUCKET_FENCES} has 1 replica" in report.all_warnings()[0].message
    finally:
        await js.delete_key_value(subjects.BUCKET_FENCES)
        await declare(js, settings)
        await nc.close()


async def test_servers_that_do_not_sync_every_write_are_named(
    tmp_path: Path, auth_bundle: Bundle | None, redis_url: str
) -> None:
    include = auth_bundle.nats_include if auth_bundle is not None else None
    cluster = EmbeddedCluster(tmp_path / "c", auth_include=include, sync_always=False)
    await asyncio.to_thread(cluster.start)
    try:
        syncs = await durability.read_sync(cluster.monitor_urls)
        assert [s.sync_always for s in syncs] == [False, False, False]
        assert {s.server_name for s in syncs} == {n.server_name for n in cluster.nodes}
        report = await doctor_command.collect(_on_cluster(cluster, redis_url))
        warnings = report.all_warnings()
        assert _codes(warnings) == ["sync-not-always"] * 3
        assert "every 120 s" in warnings[0].message
        assert "sync_interval: always" in warnings[0].message
    finally:
        await asyncio.to_thread(cluster.stop)
    # A monitoring endpoint that does not answer is said, not taken as fine.
    (unread,) = durability.sync_findings(await durability.read_sync([cluster.monitor_urls[0]]))
    assert unread.code == "sync-unreadable"
