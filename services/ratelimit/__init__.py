"""The ``ratelimit`` service: permits and fleet-wide holds over Redis (docs/rate-limits.md)."""

from jetfleet.services.ratelimit.service import RateLimiter

__all__ = ["RateLimiter"]
