"""Which Chromium a worker drives, and its version (the version tuple's ``browser``)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

from jetfleet.errors import ConfigError
from jetfleet.settings import BrowserSettings

SEARCHED = ("chromium", "chromium-browser", "google-chrome")
VERSION_TIMEOUT_S = 10.0
_VERSION_RE = re.compile(r"\b(\d+\.\d+\.\d+\.\d+)\b")


def chromium_path(browser: BrowserSettings) -> str:
    """The Chromium executable ``browser`` names, or the first of ``SEARCHED`` on PATH.

    Raises:
        ConfigError: the configured file is not an executable, or none is on PATH.
    """
    if browser.executable:
        path = Path(browser.executable).expanduser()
        if path.is_file() and shutil.which(str(path)):
            return str(path)
        raise ConfigError(
            f"config: worker.browser.executable {browser.executable!r} is not an executable "
            "file: point it at Chromium (such as /usr/bin/chromium), or set "
            "worker.browser.enabled = false"
        )
    for name in SEARCHED:
        found = shutil.which(name)
        if found:
            return found
    raise ConfigError(
        f"config: worker.browser.enabled is true but no Chromium was found ({', '.join(SEARCHED)} "
        "are not on PATH): install Chromium (Debian: apt-get install chromium), set "
        "worker.browser.executable to its path, or set worker.browser.enabled = false"
    )


@functools.cache
def chromium_version(executable: str) -> str:
    """The version ``executable --version`` prints (``156.0.8078.114``), read once.

    Raises:
        ConfigError: it does not run or prints no version.
    """
    try:
        done = subprocess.run(
            [executable, "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(
            f"config: worker.browser: {executable} --version failed ({exc}): fix "
            "worker.browser.executable"
        ) from None
    # Debian's wrapper script may print shell noise first; the version is on stdout.
    found = _VERSION_RE.search(done.stdout)
    if found is None:
        raise ConfigError(
            f"config: worker.browser: {executable} --version printed no version "
            f"({done.stdout.strip()[:200]!r}): point worker.browser.executable at Chromium"
        )
    return found.group(1)
