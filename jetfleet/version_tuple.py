"""The version tuple a worker advertises (I8; docs/versions.md): taken from the installed
package, the effective settings and the runtime, never typed by hand.

A tuple is built once per process (``local_tuple``); only its ``handler`` field changes per
job. ``tuple_id`` names a tuple without ``handler`` (nor the id itself): the approved set
in ``jf-control`` lists ids, and the leaser computes the id again from the fields it is
sent, so a worker cannot claim another tuple's id.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec

import jetfleet
from jetfleet.schemas.report import Versions
from jetfleet.settings import Settings

ID_CHARS = 12
CONFIG_HASH_CHARS = 12
GIT_TIMEOUT_S = 2.0
# Worker settings that name this process (or say which targets it serves), not how it
# behaves: every worker of one deployment must hash alike.
PER_PROCESS_WORKER_KEYS = frozenset(
    {"id", "identity", "region", "egress", "subnet", "targets", "standby_targets", "version_fields"}
)

PER_HOST_BROWSER_KEYS = ("executable", "profiles_dir")


class CodeRevision(msgspec.Struct, frozen=True):
    """What code this process runs, and whether it is pinned."""

    code: str
    unpinned_why: tuple[str, ...] = ()


def local_tuple(settings: Settings) -> Versions:
    """The tuple this process advertises (without ``handler``), with its id."""
    revision = code_revision()
    bare = Versions(
        jetfleet=jetfleet.__version__,
        browser=browser_version(settings),
        code=revision.code,
        config=config_hash(settings),
        python=platform.python_version(),
        nats_py=_installed_version("nats-py"),
        declared=dict(sorted(settings.worker.version_fields.items())),
        unpinned=bool(revision.unpinned_why),
        unpinned_why=", ".join(revision.unpinned_why),
    )
    return msgspec.structs.replace(bare, id=tuple_id(bare))


_known_ids: dict[bytes, str] = {}
_KNOWN_IDS_MAX = 64
_KNOWN_TUPLE_MAX_BYTES = 4096
"""Tuples larger than this are hashed every time, not remembered: a report's tuple is
the sender's to make, and the memo must not hold what a worker chooses to send."""
_tuple_encoder = msgspec.json.Encoder()


def tuple_id(versions: Versions) -> str:
    """A short stable hash of the tuple, leaving out ``handler`` (per job) and ``id``.

    Fields at their default are left out too (the struct omits defaults): a release that
    adds a field with a default must not change the id of every tuple approved before it,
    or a leaser upgraded to it would refuse every worker ``version-not-approved``.

    Remembered by the tuple's bytes without ``handler`` and ``id``: a fleet runs a
    handful of tuples, and the leaser asks twice per grant."""
    encoded = _tuple_encoder.encode(msgspec.structs.replace(versions, handler="", id=""))
    if len(encoded) > _KNOWN_TUPLE_MAX_BYTES:
        return _hash_of(versions)
    known = _known_ids.get(encoded)
    if known is None:
        if len(_known_ids) >= _KNOWN_IDS_MAX:
            _known_ids.clear()
        known = _known_ids[encoded] = _hash_of(versions)
    return known


def _hash_of(versions: Versions) -> str:
    fields = msgspec.to_builtins(versions)
    fields.pop("handler", None)
    fields.pop("id", None)
    encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:ID_CHARS]


def with_handler(versions: Versions, handler: str) -> Versions:
    """The process's tuple as carried by one job's lease request, report and outcome."""
    return msgspec.structs.replace(versions, handler=handler)


def config_hash(settings: Settings) -> str:
    """A short sha256 of the effective behavioural settings: targets, fleet, worker
    behaviour and quarantine (its breaker included). Connection URLs, credentials, the
    gateway and per-process names (``PER_PROCESS_WORKER_KEYS``, the identities' state
    folders) are left out, so every worker of one deployment hashes alike."""
    worker = {
        k: v
        for k, v in msgspec.to_builtins(settings.worker).items()
        if k not in PER_PROCESS_WORKER_KEYS
    }
    # Where this host keeps its browser and profiles is not behaviour (the browser's
    # version is a field of its own).
    for key in PER_HOST_BROWSER_KEYS:
        worker.get("browser", {}).pop(key, None)
    behaviour: dict[str, Any] = {
        "targets": msgspec.to_builtins(settings.targets),
        "fleet": msgspec.to_builtins(settings.fleet),
        "worker": worker,
        "quarantine": msgspec.to_builtins(settings.quarantine),
    }
    encoded = json.dumps(
        _numbers_alike(behaviour), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(encoded.encode()).hexdigest()[:CONFIG_HASH_CHARS]


def _numbers_alike(value: Any) -> Any:
    """``value`` with every number as a float: a setting given as ``1000`` in code and
    read as ``1000.0`` from a file is the same setting, so it must hash the same."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers_alike(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_numbers_alike(v) for v in value]
    return value


def browser_version(settings: Settings) -> str:
    """The Chromium version of a worker with ``browser.page`` enabled (``chromium
    --version``, read once per process: launching a browser only to ask would be too
    dear); empty for one without.

    Raises:
        ConfigError: enabled, but no Chromium is found or it prints no version.
    """
    browser = settings.worker.browser
    if not browser.enabled:
        return ""
    # Imported here: the tuple module serves processes that never drive a browser.
    from jetfleet.worker.browser_executable import chromium_path, chromium_version

    return chromium_version(chromium_path(browser))


@functools.cache
def code_revision() -> CodeRevision:
    """The installed package's version and commit, and why it is unpinned (if it is).

    From the distribution's ``direct_url.json`` (PEP 610: a local folder, editable or
    not, or an unhashed archive, ``install_flags``; a VCS install's commit) and, for a
    package imported from a git work tree, that tree's commit and whether it has
    uncommitted changes. Cached: once per process.
    """
    version = jetfleet.__version__
    why: list[str] = []
    commit = ""
    direct = _direct_url()
    why += install_flags(direct)
    commit = str(direct.get("vcs_info", {}).get("commit_id", ""))
    source = Path(jetfleet.__file__).resolve().parent.parent
    if (source / ".git").exists():
        if "editable install" not in why:
            why.append("imported from a source tree")
        tree_commit, dirty = _git_state(source)
        commit = tree_commit or commit
        if dirty:
            why.append("uncommitted changes")
    why += _version_flags(version)
    code = version + (f"+g{commit[:12]}" if commit else "")
    if "uncommitted changes" in why:
        code += ".dirty"
    return CodeRevision(code=code, unpinned_why=tuple(why))


def install_flags(direct: dict[str, Any]) -> list[str]:
    """Why an install whose PEP 610 record is ``direct`` is unpinned ([]: pinned, or no
    record: installed from an index). A local folder installed without ``-e`` is as
    unpinned as an editable one: its code is whatever the folder held, under a release
    version, so two different trees would advertise one tuple. An archive is pinned only
    by its hash."""
    if "dir_info" in direct:
        editable = bool(direct["dir_info"].get("editable"))
        return ["editable install" if editable else "installed from a local folder"]
    archive = direct.get("archive_info")
    if isinstance(archive, dict) and not (archive.get("hash") or archive.get("hashes")):
        return ["installed from an archive with no hash"]
    return []


# PEP 440: a release is N(.N)*, with an optional pre-release (a1, b2, rc1) or .postN.
_RELEASE_RE = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?$")


def _version_flags(version: str) -> list[str]:
    """Why ``version`` is not a release one may pin: a local (``+...``) or dev version."""
    flags = []
    if "+" in version:
        flags.append(f"local version {version}")
    if ".dev" in version:
        flags.append(f"dev version {version}")
    if not flags and not _RELEASE_RE.match(version):
        flags.append(f"version {version!r} is not a release version")
    return flags


def _direct_url() -> dict[str, Any]:
    """The installed distribution's PEP 610 record ({}: none, or not installed). Several
    distributions may answer to the name (an ``.egg-info`` in the working folder): the
    one that has the record is the installed one."""
    for dist in importlib.metadata.distributions(name="jetfleet"):
        text = dist.read_text("direct_url.json")
        if text:
            try:
                found = json.loads(text)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return {}


def _git_state(source: Path) -> tuple[str, bool]:
    """(commit, dirty) of the git work tree at ``source``; ("", False) if git cannot say."""
    try:
        head = _git(source, "rev-parse", "HEAD")
        status = _git(source, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "", False
    return head.strip(), bool(status.strip())


def _git(source: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(source), *args],
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=True,
    )
    return done.stdout


def _installed_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""
