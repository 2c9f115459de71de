"""`jetfleet dev` as a user runs it: starts everything, serves the CLI from another shell,
stops on Ctrl-C leaving no process behind, and two stacks in two folders do not collide."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import psutil
import pytest
from jetfleet.services import SERVICE_NAMES

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.dev.stack_env import read_env
from jetfleet.results import iter_results
from jetfleet.settings import NatsSettings
from tests.conftest import wait_for

START_TIMEOUT_S = 60.0
# Two of DevStack's 35 s drains and the servers' stop: one child hung, not several.
STOP_TIMEOUT_S = 80.0


class RunningDev:
    """A `jetfleet dev` process and everything it started."""

    def __init__(self, folder: Path, *options: str) -> None:
        self.folder = folder
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("JETFLEET_") and k not in ("NATS_URL", "REDIS_URL")
        }
        self.log = folder.with_suffix(".out")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jetfleet",
                    "dev",
                    "--workers",
                    "2",
                    "--data",
                    str(folder),
                    *options,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.env: dict[str, str] = {}

    def wait_ready(self) -> dict[str, str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            env = read_env(self.folder / "env")
            if "JETFLEET_GATEWAY_URL" in env:
                self.env = env
                return env
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError(f"jetfleet dev did not write its env file:\n{self.output()}")

    def descendants(self) -> list[psutil.Process]:
        children: list[psutil.Process] = psutil.Process(self.proc.pid).children(recursive=True)
        return children

    def stop(self) -> int:
        """Ctrl-C, as a user would. Each child has 35 s to drain (DevStack's
        STOP_TIMEOUT_S) before it is killed, waited for in turn; a stop longer than two
        such drains is a hang, reported with what was still running and its logs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            alive = []
            for child in self.descendants():
                with contextlib.suppress(psutil.Error):  # a zombie has no command line
                    alive.append(" ".join(child.cmdline()[-3:]))
            self.proc.kill()
            tails = "\n".join(
                f"== {log.name}\n{log.read_text(errors='replace')[-1500:]}"
                for log in sorted((self.folder / "logs").glob("*.log"))
            )
            raise AssertionError(
                f"jetfleet dev did not stop within {STOP_TIMEOUT_S:g} s of Ctrl-C; still "
                f"running: {alive}\n{self.output()[-2000:]}\n{tails}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`jetfleet ARGS` from another shell in the same folder (found via ./.jetfleet
        is the default; here the folder is named with JETFLEET_STACK)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("JETFLEET_") and k not in ("NATS_URL", "REDIS_URL")
        }
        env["JETFLEET_STACK"] = str(self.folder)
        return subprocess.run(
            [sys.executable, "-m", "jetfleet", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )


@pytest.fixture
def dev_stacks(tmp_path: Path) -> Iterator[list[RunningDev]]:
    started: list[RunningDev] = []
    yield started
    for dev in started:
        if dev.proc.poll() is None:
            dev.stop()  # Ctrl-C, as a user would; it kills after STOP_TIMEOUT_S
        dev.proc.wait()


def _wait_all_committed(dev: RunningDev, n: int) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(dev.cli("status", "--json").stdout)
        if status["totals"]["committed"] + status["totals"]["dead"] >= n:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_two_dev_stacks_serve_the_cli_and_stop_leaving_no_process(
    tmp_path: Path, dev_stacks: list[RunningDev]
) -> None:
    first = RunningDev(tmp_path / "one")
    second = RunningDev(tmp_path / "two")
    dev_stacks += [first, second]
    env1, env2 = first.wait_ready(), second.wait_ready()
    assert env1["NATS_URL"] != env2["NATS_URL"]
    assert env1["JETFLEET_GATEWAY_URL"] != env2["JETFLEET_GATEWAY_URL"]

    submitted = first.cli("submit", "demo", "/page/1", "/page/2", "/missing/3")
    assert submitted.returncode == 0, submitted.stderr
    status = _wait_all_committed(first, 3)
    totals = status["totals"]
    assert isinstance(totals, dict)
    assert (totals["submitted"], totals["committed"], totals["dead"]) == (3, 2, 1)
    exported = [json.loads(line) for line in first.cli("results", "export").stdout.splitlines()]
    assert sorted(r["url"].rsplit("/", 2)[-2:][1] for r in exported) == ["1", "2"]
    # The other stack saw none of it.
    other = json.loads(second.cli("status", "--json").stdout)
    assert other["totals"]["submitted"] == 0

    children = first.descendants() + second.descendants()
    # nats, redis, every service (the quarantine service too), 2 workers each.
    assert "quarantine" in SERVICE_NAMES
    for stack in (first, second):
        names = [" ".join(p.cmdline()) for p in stack.descendants()]
        for service in SERVICE_NAMES:
            assert any(f"serve {service}" in name for name in names), (service, names)
    assert len(children) >= 2 * (2 + len(SERVICE_NAMES) + 2)
    assert first.stop() == 0 and second.stop() == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == [], [p.info if hasattr(p, "info") else p.pid for p in alive]
    assert not (first.folder / "env").exists()


def test_a_second_dev_in_the_same_folder_is_refused(
    tmp_path: Path, dev_stacks: list[RunningDev]
) -> None:
    first = RunningDev(tmp_path / "same")
    dev_stacks.append(first)
    first.wait_ready()
    second = RunningDev(tmp_path / "same")
    dev_stacks.append(second)
    assert second.proc.wait(30) == 2
    assert "already runs in" in second.output()
    assert first.proc.poll() is None


async def test_item9_a_job_published_the_moment_the_env_file_appears_commits(
    tmp_path: Path, dev_stacks: list[RunningDev]
) -> None:
    # The env file is the stack's "ready" signal for other shells and scripts: a job
    # published raw to jf.submit.<target> at that moment must be stored and run, not
    # dropped because the streams do not exist yet.
    dev = RunningDev(tmp_path / "early")
    dev_stacks.append(dev)
    env = await asyncio.to_thread(dev.wait_ready)
    # As an operator in another shell would: the stack runs with auth on.
    operator = NatsSettings(url=env["NATS_URL"], credentials=env["JETFLEET_NATS__CREDENTIALS"])
    nc = await connect_nats(operator, "early", role="operator")
    try:
        job = {"id": "early-1", "url": env["JETFLEET_TARGET_URL"] + "/page/1"}
        await nc.publish(subjects.submit("demo"), json.dumps(job).encode())
        await nc.flush()
        js = nc.jetstream()

        async def committed() -> bool:
            try:
                info = await js.stream_info(subjects.STREAM_RESULTS)
            except nats.js.errors.NotFoundError:
                return False
            return info.state.messages == 1

        await wait_for(committed, 30, "the job published at once to commit")
        [record] = [r async for r in iter_results(js, "demo")]
        assert record.job_id == "early-1"
    finally:
        await nc.close()


def test_dev_cluster_3_runs_the_fleet_on_r3_streams_and_the_doctor_finds_nothing_to_fix(
    tmp_path: Path, dev_stacks: list[RunningDev]
) -> None:
    dev = RunningDev(tmp_path / "cluster", "--cluster", "3")
    dev_stacks.append(dev)
    env = dev.wait_ready()
    assert len(env["NATS_URL"].split(",")) == 3, env
    assert "nats_monitor: http://127.0.0.1:" in dev.output()
    assert dev.cli("submit", "demo", "/page/1", "/page/2").returncode == 0
    _wait_all_committed(dev, 2)
    assert asyncio.run(_replicas(env, subjects.STREAM_WORK)) == 3
    doctor = dev.cli("doctor")
    # R3 and sync_interval always on every node (read from their /varz): no warning,
    # and no note either (the sync was checked).
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "warning" not in doctor.stdout.replace("no warnings", ""), doctor.stdout
    assert "note:" not in doctor.stdout, doctor.stdout
    # Nor did any service say anything about durability at start.
    said = [
        line
        for log in (dev.folder / "logs").glob("*.log")
        for line in log.read_text(errors="replace").splitlines()
        if "durability" in line or "dev NATS" in line
    ]
    assert said == [], said
    assert dev.stop() == 0


async def _replicas(env: dict[str, str], stream: str) -> int:
    operator = NatsSettings(url=env["NATS_URL"], credentials=env["JETFLEET_NATS__CREDENTIALS"])
    nc = await connect_nats(operator, "replicas", role="operator")
    try:
        return (await nc.jetstream().stream_info(stream)).config.num_replicas or 1
    finally:
        await nc.close()


def test_the_stacks_own_workers_run_32_jobs_per_lane_unless_the_users_config_says(
    tmp_path: Path,
) -> None:
    from jetfleet.dev.devstack import DEV_WORKER_CONCURRENCY, DevStack

    assert DevStack(tmp_path / "a")._plain_worker_env() == {
        "JETFLEET_WORKER__CONCURRENCY": str(DEV_WORKER_CONCURRENCY)
    }
    mine = tmp_path / "mine.toml"
    mine.write_text("[worker]\nconcurrency = 4\n")
    assert DevStack(tmp_path / "b", user_config=mine)._plain_worker_env() == {}


def test_dev_replicas_2_runs_two_of_every_service_and_loses_nothing_when_one_of_each_dies(
    tmp_path: Path, dev_stacks: list[RunningDev]
) -> None:
    dev = RunningDev(tmp_path / "replicas", "--replicas", "2")
    dev_stacks.append(dev)
    dev.wait_ready()
    served: dict[str, list[psutil.Process]] = {}
    for child in dev.descendants():
        with contextlib.suppress(psutil.Error):
            line = child.cmdline()
            if "serve" in line:
                served.setdefault(line[line.index("serve") + 1], []).append(child)
    assert {name: len(procs) for name, procs in served.items()} == {
        name: 2 for name in SERVICE_NAMES
    }, served
    gateways = next(
        line.split(": ", 1)[1]
        for line in dev.output().splitlines()
        if line.strip().startswith("gateways:")
    ).split(",")
    assert len(set(gateways)) == 2
    for url in gateways:
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as answer:
            assert answer.status == 200
    # One replica of every service crashes (jetfleet dev does not restart them): the
    # other carries the fleet.
    for procs in served.values():
        procs[0].kill()
    assert dev.cli("submit", "demo", "/page/1", "/page/2", "/page/3").returncode == 0
    totals = _wait_all_committed(dev, 3)["totals"]
    assert isinstance(totals, dict)
    assert (totals["submitted"], totals["committed"], totals["dead"]) == (3, 3, 0), totals
    assert dev.stop() == 0
