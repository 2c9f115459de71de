"""The gateway: the HTTP API, the dashboard page and Prometheus ``/metrics``."""

from jetfleet.services.gateway.service import Gateway

__all__ = ["Gateway"]
