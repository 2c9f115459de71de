"""jetfleet's services, one package each, started as ``jetfleet serve NAME``."""

SERVICE_NAMES = ("scheduler", "leaser", "sink", "gateway")
