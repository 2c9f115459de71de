"""Which product code a benchmark ran against: a fingerprint of the source tree.

    python bench/tree_state.py [--json]

Prints a SHA-256 over every ``*.py`` file of the installed ``jetfleet`` package (its
``services`` and ``schemas`` links included; read, not from git), the file count, and the
newest file with its modification time. The tree is edited while benchmarks run; the
same fingerprint before and after a run means the run saw one version of the code.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def tree_state(root: Path | None = None) -> dict[str, Any]:
    """Fingerprint of ``root`` (default: the jetfleet package folder)."""
    if root is None:
        import jetfleet

        root = Path(jetfleet.__file__).resolve().parent
    digest = hashlib.sha256()
    files = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py"):
                files.append(Path(folder) / name)
    files.sort(key=lambda p: str(p.relative_to(root)))
    newest = max(files, key=lambda p: p.stat().st_mtime)
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    mtime = datetime.datetime.fromtimestamp(newest.stat().st_mtime, datetime.UTC)
    return {
        "sha256": digest.hexdigest()[:16],
        "files": len(files),
        "newest": str(newest.relative_to(root)),
        "newest_mtime_utc": mtime.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    state = tree_state()
    if args.json:
        print(json.dumps(state))
    else:
        print(
            f"tree {state['sha256']} ({state['files']} files; newest {state['newest']} "
            f"{state['newest_mtime_utc']} UTC)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
