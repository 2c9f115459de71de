# jetfleet's container image (docs/deploy.md). Two targets:
#   docker build --target jetfleet -t jetfleet:0.1.0 .          services, CLI
#   docker build --target worker   -t jetfleet-worker:0.1.0 .   + Debian's chromium
# compose.yaml builds both. The base is pinned to an exact Python and Debian release;
# pin it by digest too where your registry policy asks for it
# (python:3.11.11-slim-bookworm@sha256:...), which this repository cannot look up.

FROM python:3.11.11-slim-bookworm AS jetfleet

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# One unprivileged user for every jetfleet process; the auth-init service writes the
# credentials owned by this uid (compose.yaml).
RUN useradd --uid 10001 --create-home --home-dir /var/lib/jetfleet jetfleet

# Dependencies from the runtime lock only: exact versions, every file checked against its
# hash (docs/deploy.md#the-lock-files). Their own layer, so a code change reuses it.
WORKDIR /src
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock

# jetfleet itself as a built wheel, installed without dependencies (the lock has them
# all; pip check proves it). A wheel file, not the folder: pip records its hash, so the
# workers' version tuple is not marked unpinned ("local folder", docs/versions.md).
COPY pyproject.toml README.md ./
COPY jetfleet ./jetfleet
COPY schemas ./schemas
COPY services ./services
RUN pip wheel --no-deps --wheel-dir /tmp/dist . \
    && pip install --no-deps /tmp/dist/jetfleet-*.whl \
    && pip check \
    && rm -rf /src /tmp/dist

WORKDIR /var/lib/jetfleet
USER jetfleet
ENTRYPOINT ["jetfleet"]
CMD ["--help"]

# Workers that run the browser.page handler: Debian's chromium at /usr/bin/chromium,
# driven by Playwright through its executable path (never `playwright install`).
FROM jetfleet AS worker
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends chromium fonts-liberation \
    && rm -rf /var/lib/apt/lists/*
USER jetfleet
CMD ["worker"]
