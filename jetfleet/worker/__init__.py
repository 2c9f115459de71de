"""The worker runtime: pull a target's work, run a handler, report to the sink."""

from jetfleet.worker.handlers import HandlerContext, get_handler, handler, registered
from jetfleet.worker.runtime import Worker

__all__ = ["HandlerContext", "Worker", "get_handler", "handler", "registered"]
