"""Bench only: ``jetfleet`` with the rate permit taken out of the leaser's grant checks.

    python bench/permitless_leaser.py serve leaser [--metrics-port N]

The "without the permit step" side of ``ratelimit_bench.py --part e2e``: the same leaser,
in-flight cap and all, minus ``rate_permit`` in ``TAKING_CHECKS``. It lives here, outside
the package, so no config file, environment variable or CLI flag of jetfleet can turn the
permit off; only running this file does. Never run it against a real target.
"""

from __future__ import annotations

import sys

from jetfleet.services.leaser import checks

# first_objection reads the module global at every grant, so this is the whole switch.
checks.TAKING_CHECKS = tuple(c for c in checks.TAKING_CHECKS if c is not checks.rate_permit)

from jetfleet.cli.main import main  # noqa: E402

if __name__ == "__main__":
    print(
        "permitless_leaser: grant checks without rate_permit (bench only): "
        + ", ".join(c.__name__ for c in checks.TAKING_CHECKS),
        flush=True,
    )
    sys.exit(main())
