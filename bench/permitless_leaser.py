"""Bench only: ``jetfleet`` with the rate permit taken out of the leaser's grant checks.

    python bench/permitless_leaser.py [--no-place] serve leaser [--metrics-port N]

The "without the permit step" side of ``ratelimit_bench.py --part e2e``: the same leaser,
in-flight cap and all, minus ``rate_permit`` in ``TAKING_CHECKS``. ``--no-place`` also
takes out ``in_flight_cap`` (no Redis place per grant: what a dedicated target's grant
did before the rate limiter, when only partitioned targets took one). It lives here, outside
the package, so no config file, environment variable or CLI flag of jetfleet can turn the
permit off; only running this file does. Never run it against a real target.
"""

from __future__ import annotations

import sys

from jetfleet.services.leaser import checks

NO_PLACE = sys.argv[1:2] == ["--no-place"]
if NO_PLACE:
    del sys.argv[1]
_removed = (checks.rate_permit, checks.in_flight_cap) if NO_PLACE else (checks.rate_permit,)
# taking_objection reads the module global at every grant, so this is the whole switch.
checks.TAKING_CHECKS = tuple(c for c in checks.TAKING_CHECKS if c not in _removed)

from jetfleet.cli.main import main  # noqa: E402

if __name__ == "__main__":
    print(
        "permitless_leaser (bench only): taking checks left: "
        + (", ".join(c.__name__ for c in checks.TAKING_CHECKS) or "none"),
        flush=True,
    )
    sys.exit(main())
