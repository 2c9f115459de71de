"""``jetfleet completion bash|zsh``: the scripts are valid shell, and bash, driven the way
it drives a completion function, completes jetfleet's own commands and options."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jetfleet.cli.completion_command import command_words
from jetfleet.cli.main import build_parser


def _script(shell: str, tmp_path: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "jetfleet", "completion", shell],
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp_path / f"jetfleet.{shell}"
    path.write_text(done.stdout)
    return path


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the command line ``words`` (the last one being typed)."""
    driver = (
        'source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); '
        '_jetfleet; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(
        ["bash", "-c", driver, "bash", str(script), "jetfleet", *words],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr == ""
    return [w for w in done.stdout.splitlines() if w]


def test_the_bash_script_is_valid_bash_and_registers_the_function(tmp_path: Path) -> None:
    script = _script("bash", tmp_path)
    subprocess.run(["bash", "-n", str(script)], check=True)
    done = subprocess.run(
        ["bash", "-c", 'source "$1"; complete -p jetfleet', "bash", str(script)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "complete -F _jetfleet jetfleet"


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("d",), ["dev", "demo", "dlq", "doctor"]),
        (("dlq", ""), ["list", "show", "replay", "purge", "--help"]),
        (("--config", "x.toml", "resu"), ["results", "resume"]),
        (("results", "export", "--"), ["--help", "--target", "--bodies", "--json"]),
        (("serve", "l"), ["leaser"]),
        (("completion", ""), ["bash", "zsh", "--help"]),
        (("-v", "pause", "--ta"), ["--target"]),
    ],
)
def test_bash_completes_commands_choices_and_options(
    tmp_path: Path, words: tuple[str, ...], expected: list[str]
) -> None:
    assert _complete(_script("bash", tmp_path), *words) == expected


def test_bash_completes_a_file_after_an_option_that_takes_one(tmp_path: Path) -> None:
    script = _script("bash", tmp_path)
    (tmp_path / "prod.toml").write_text("")
    assert _complete(script, "--config", str(tmp_path / "prod.")) == [str(tmp_path / "prod.toml")]


def test_every_command_of_the_parser_is_in_the_script(tmp_path: Path) -> None:
    """Generated from the parser: a command added later is completed without an edit."""
    script = _script("bash", tmp_path)
    table = command_words(build_parser())
    assert {"dlq", "dlq purge", "results export", "completion"} <= set(table)
    for path, words in table.items():
        offered = _complete(script, *path.split(), "")
        assert set(words.subcommands) <= set(offered), path
        assert "--help" in offered, path


def test_the_zsh_script_is_valid_zsh_and_offers_the_same_words(tmp_path: Path) -> None:
    """zsh is installed by .ci/run (Debian's zsh package) for this check."""
    zsh = shutil.which("zsh")
    assert zsh is not None, "zsh is missing: .ci/run installs Debian's zsh package"
    script = _script("zsh", tmp_path)
    subprocess.run([zsh, "-n", str(script)], check=True)
    driver = (
        'autoload -U compinit && compinit -u -d "$2"; source "$1"; '
        'COMP_WORDS=(jetfleet dlq ""); COMP_CWORD=2; _jetfleet; print -l -- "${COMPREPLY[@]}"'
    )
    done = subprocess.run(
        [zsh, "-f", "-c", driver, "zsh", str(script), str(tmp_path / "zcompdump")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr == ""
    assert done.stdout.split() == ["list", "show", "replay", "purge", "--help"]
