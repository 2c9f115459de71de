"""The leaser: grants, renews, releases and revokes leases with fencing tokens."""

from jetfleet.services.leaser.service import Leaser

__all__ = ["Leaser"]
