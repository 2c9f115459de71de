"""The ``quarantine`` service: outcome events counted in configured windows set
quarantine records through the leaser (docs/quarantine.md)."""

from jetfleet.services.quarantine.service import QuarantineService

__all__ = ["QuarantineService"]
