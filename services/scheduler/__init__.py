"""The scheduler: admission of submissions and routing to per-target work subjects."""

from jetfleet.services.scheduler.service import Scheduler

__all__ = ["Scheduler"]
