"""The CLI as people use it (docs/cli.md): output closed early ends quietly with the
documented exit code, every data command has ``--json`` and its output parses, progress
shows on a terminal and never in a pipe, and the exit-code table is the code's.

The commands run as real processes (``python -m jetfleet``) against a real nats-server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, NoopOutput, Versions
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli import exit_codes
from jetfleet.cli.main import build_parser
from jetfleet.dev.settings_file import settings_toml
from jetfleet.publish import publish_durably
from jetfleet.settings import Settings

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = 2000
"""Results in the stream: about 600 KB of JSON lines, far more than a pipe buffers
(64 KiB), so the export is still writing when ``head`` goes away."""

NOT_DATA_COMMANDS = {
    "serve": "runs a service until stopped; its output is logs",
    "worker": "runs a worker until stopped; its output is logs",
    "completion": "prints a shell script",
}
"""Leaf commands that print no data, hence no ``--json``; each with why."""


def _env() -> dict[str, str]:
    """The environment less a user's jetfleet settings (the config file says all)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JETFLEET_")}


def _argv(config: Path, *args: str) -> list[str]:
    stack = config.parent / "no-stack"
    return [sys.executable, "-m", "jetfleet", "--config", str(config), "--stack", str(stack), *args]


@pytest.fixture
def config(settings: Settings, tmp_path: Path) -> Path:
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    return path


@pytest.fixture
async def results(nc: NatsClient) -> int:
    """``RESULTS`` committed results of ``demo``, written as the sink writes them."""
    js = nc.jetstream()
    encoder = msgspec.json.Encoder()
    for n in range(RESULTS):
        record = CommittedResult(
            job_id=f"job-{n}",
            target="demo",
            url=f"http://127.0.0.1/page/{n}?" + "q" * 200,
            key=f"k{n:06d}",
            handler="noop",
            worker="w-0",
            attempt=1,
            duration_s=0.01,
            output=NoopOutput(),
            versions=Versions(jetfleet="0.1.0"),
        )
        await publish_durably(
            js, subjects.result_key("demo", record.key), encoder.encode(record), None
        )
    return RESULTS


async def _run(argv: list[str], stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end in a thread (the test's event loop keeps serving its own
    connection meanwhile); stderr, and stdout unless given a descriptor, captured."""

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            timeout=60,
        )

    return await asyncio.to_thread(run)


def _quiet(stderr: str) -> None:
    for sign in ("Traceback", "BrokenPipeError", "Exception ignored", "Task was destroyed"):
        assert sign not in stderr, stderr


# --- output closed early ---------------------------------------------------------------


async def test_results_export_into_head_ends_quietly_with_code_141(
    config: Path, results: int
) -> None:
    shell = 'set -o pipefail; "$@" | head -1; echo "exit=${PIPESTATUS[0]}" >&2'
    done = await _run(["bash", "-c", shell, "bash", *_argv(config, "results", "export")])
    first = json.loads(done.stdout.splitlines()[0])
    assert first["job_id"] == "job-0"
    assert done.stdout.count("\n") == 1
    _quiet(done.stderr)
    assert done.stderr.strip().splitlines()[-1] == f"exit={exit_codes.OUTPUT_CLOSED}"


@pytest.mark.parametrize(
    "command",
    [
        ["results", "export"],
        ["status"],
        ["target", "list"],
        ["dlq", "list", "--json"],
        ["auth", "roles"],
    ],
)
async def test_a_command_whose_reader_is_gone_before_it_writes_exits_141_quietly(
    config: Path, results: int, command: list[str]
) -> None:
    reader, writer = os.pipe()
    os.close(reader)  # nobody will ever read: every write is refused (EPIPE)
    try:
        done = await _run(_argv(config, *command), stdout=writer)
    finally:
        os.close(writer)
    _quiet(done.stderr)
    assert done.stderr == ""
    assert done.returncode == exit_codes.OUTPUT_CLOSED


def test_help_into_a_closed_pipe_is_quiet(config: Path) -> None:
    """argparse writes --help itself and drops an OSError from that write, then exits 0:
    still nothing on stderr."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            _argv(config, "--help"), stdout=writer, stderr=subprocess.PIPE, text=True, env=_env()
        )
    finally:
        os.close(writer)
    assert done.stderr == ""
    assert done.returncode in (exit_codes.OK, exit_codes.OUTPUT_CLOSED)


# --- --json ----------------------------------------------------------------------------


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, set[str]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {" ".join(path): {o for a in parser._actions for o in a.option_strings}}
    found: dict[str, set[str]] = {}
    for name, sub in subs[0].choices.items():
        found.update(_leaves(sub, (*path, name)))
    return found


def test_every_data_command_accepts_json() -> None:
    leaves = _leaves(build_parser())
    assert set(NOT_DATA_COMMANDS) <= set(leaves)  # the exemptions name real commands
    missing = [
        path
        for path, options in leaves.items()
        if path not in NOT_DATA_COMMANDS and "--json" not in options
    ]
    assert missing == []


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["target", "list"],
        ["target", "show", "demo"],
        ["dlq", "list"],
        ["topology", "show"],
        ["topology", "lanes"],
        ["schemas", "check"],
        ["auth", "roles"],
        ["audit"],
        ["dlq", "purge", "--yes"],
    ],
)
async def test_json_output_is_one_json_document(
    config: Path, nc: NatsClient, command: list[str]
) -> None:
    done = await _run(_argv(config, *command, "--json"))
    assert done.returncode == exit_codes.OK, done.stderr
    json.loads(done.stdout)


async def test_results_export_is_json_lines(config: Path, results: int) -> None:
    done = await _run(_argv(config, "results", "export", "--json"))
    assert done.returncode == exit_codes.OK, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == results
    assert all(json.loads(line)["target"] == "demo" for line in lines)


# --- progress --------------------------------------------------------------------------


def _run_with_terminal_stderr(
    argv: list[str], stdout: int = subprocess.PIPE
) -> tuple[int, str, bytes]:
    """Run ``argv`` with stderr on a pseudo-terminal (stdout to ``stdout``, by default a
    pipe): its exit code, what it drew on the terminal, and what came through the pipe."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=stdout, stderr=slave, env=_env())
    os.close(slave)
    drawn, piped = bytearray(), bytearray()
    sinks = {master: drawn}
    if proc.stdout is not None:
        sinks[proc.stdout.fileno()] = piped
    while sinks:
        ready, _, _ = select.select(list(sinks), [], [], 60)
        if not ready:
            proc.kill()
            raise AssertionError("no output from the command for 60 s")
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                chunk = b""
            if chunk:
                sinks[fd] += chunk
            else:
                del sinks[fd]
    os.close(master)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.wait(timeout=60), drawn.decode(errors="replace"), bytes(piped)


BAR = re.compile(r"exporting \[[#.]+\] (\d+)/(\d+)")


async def test_export_to_a_file_draws_progress_on_the_terminal(
    config: Path, results: int, tmp_path: Path
) -> None:
    with (tmp_path / "out.jsonl").open("wb") as out:
        code, drawn, _ = await asyncio.to_thread(
            _run_with_terminal_stderr, _argv(config, "results", "export"), out.fileno()
        )
    assert code == exit_codes.OK, drawn
    assert (f"{results}", f"{results}") in BAR.findall(drawn)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == results


@pytest.mark.parametrize("extra", [[], ["--json"]])
async def test_export_into_a_pipe_or_with_json_draws_no_progress(
    config: Path, results: int, extra: list[str]
) -> None:
    code, drawn, piped = await asyncio.to_thread(
        _run_with_terminal_stderr, _argv(config, "results", "export", *extra)
    )
    assert code == exit_codes.OK, drawn
    assert len(piped.splitlines()) == results
    assert "exporting" not in drawn


async def test_submitting_many_draws_progress_on_a_terminal_but_not_with_json(
    config: Path, nc: NatsClient, tmp_path: Path
) -> None:
    urls = tmp_path / "urls.txt"
    urls.write_text("".join(f"/page/{n}\n" for n in range(300)))
    with (tmp_path / "out.txt").open("wb") as out:
        code, drawn, _ = await asyncio.to_thread(
            _run_with_terminal_stderr,
            _argv(config, "submit", "demo", "--file", str(urls)),
            out.fileno(),
        )
    assert code == exit_codes.OK, drawn
    assert "submitting [" in drawn and "300/300" in drawn
    with (tmp_path / "out.json").open("wb") as out:
        code, drawn, _ = await asyncio.to_thread(
            _run_with_terminal_stderr,
            _argv(config, "submit", "demo", "--file", str(urls), "--json"),
            out.fileno(),
        )
    assert code == exit_codes.OK, drawn
    assert "submitting" not in drawn
    assert len(json.loads((tmp_path / "out.json").read_text())["submitted"]) == 300


async def test_purging_draws_progress_on_a_terminal_but_not_with_json(
    config: Path, nc: NatsClient, tmp_path: Path
) -> None:
    js = nc.jetstream()

    async def letters(count: int) -> None:
        # What the purge reads is the count on jf.dlq.<target>.<job id>, not the letter.
        for n in range(count):
            await publish_durably(js, f"jf.dlq.demo.job-{n}", b"{}", None)

    await letters(5)
    with (tmp_path / "out.txt").open("wb") as out:
        code, drawn, _ = await asyncio.to_thread(
            _run_with_terminal_stderr, _argv(config, "dlq", "purge", "--yes"), out.fileno()
        )
    assert code == exit_codes.OK, drawn
    assert "purging [" in drawn and "5/5" in drawn
    assert "purged 5 dead letter(s)" in (tmp_path / "out.txt").read_text()
    await letters(3)
    with (tmp_path / "out.json").open("wb") as out:
        code, drawn, _ = await asyncio.to_thread(
            _run_with_terminal_stderr,
            _argv(config, "dlq", "purge", "--yes", "--json"),
            out.fileno(),
        )
    assert code == exit_codes.OK, drawn
    assert "purging" not in drawn
    assert json.loads((tmp_path / "out.json").read_text()) == {"removed": 3, "target": None}


# --- exit codes ------------------------------------------------------------------------


def test_the_exit_code_table_in_docs_is_the_codes() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    section = doc.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\d+)` \| `(\w+)` \|", section, re.M))
    codes = {
        name: value
        for name, value in vars(exit_codes).items()
        if name.isupper() and isinstance(value, int)
    }
    assert rows == {str(v): k for k, v in codes.items()}


def test_a_usage_error_exits_2_and_an_unknown_target_exits_2(config: Path) -> None:
    usage = subprocess.run(
        _argv(config, "no-such-command"), capture_output=True, text=True, env=_env()
    )
    assert usage.returncode == exit_codes.ERROR
    unknown = subprocess.run(
        _argv(config, "results", "export", "--target", "nope"),
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert unknown.returncode == exit_codes.ERROR
    assert unknown.stderr.startswith("jetfleet: error: ")
    _quiet(unknown.stderr)
