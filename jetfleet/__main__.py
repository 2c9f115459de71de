"""``python -m jetfleet`` is the ``jetfleet`` command."""

from jetfleet.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
