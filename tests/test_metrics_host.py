"""`--metrics-host`: a process's /metrics listens where it is told (loopback unless told
otherwise), so a container can expose it to Prometheus and a host need not."""

from __future__ import annotations

import aiohttp
import pytest

from jetfleet.cli.main import build_parser
from jetfleet.metrics import CounterFamily, MetricsServer


async def _answers(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status == 200 and "jetfleet_probe_total" in await response.text()
    except aiohttp.ClientConnectionError:
        return False


async def test_metrics_listen_on_the_address_given_and_nowhere_else() -> None:
    probe = CounterFamily("jetfleet_probe_total", "a probe")
    probe.inc(target="a")
    # 127.0.0.2 is loopback on Linux too, but another address than 127.0.0.1.
    server = MetricsServer([probe], host="127.0.0.2", port=0, service="probe")
    port = await server.start()
    try:
        assert await _answers(f"http://127.0.0.2:{port}/metrics")
        assert not await _answers(f"http://127.0.0.1:{port}/metrics")
    finally:
        await server.stop()


@pytest.mark.parametrize("command", [["serve", "sink"], ["worker"]])
def test_serve_and_worker_take_a_metrics_host_defaulting_to_loopback(command: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(command).metrics_host == "127.0.0.1"
    args = parser.parse_args([*command, "--metrics-port", "9464", "--metrics-host", "0.0.0.0"])
    assert (args.metrics_port, args.metrics_host) == (9464, "0.0.0.0")
