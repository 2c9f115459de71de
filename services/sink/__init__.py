"""The sink: the commit point for results and the writer of dead letters."""

from jetfleet.services.sink.service import Sink

__all__ = ["Sink"]
