"""jetfleet: a polite crawl and browser-automation fleet over NATS JetStream."""

__version__ = "0.1.0"
