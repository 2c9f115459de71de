"""jetfleet's services, one package each, started as ``jetfleet serve NAME``."""

# One import name per module: imported as plain `services` (the source folder on sys.path)
# every module here would exist twice, and isinstance checks between the copies fail.
if __name__ != "jetfleet.services":
    raise ImportError(
        f"import jetfleet.services, not {__name__}: the folder installs as jetfleet.services"
    )


SERVICE_NAMES = ("scheduler", "ratelimit", "leaser", "sink", "gateway", "quarantine")
