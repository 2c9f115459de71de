"""Ports for the dev stack's listeners come from below the kernel's ephemeral range: a
port there is never taken as the source port of an outgoing connection between the
check and the listener's bind (a dev stack child once died "address already in use")."""

from __future__ import annotations

import socket
from pathlib import Path

from jetfleet.dev.embedded import LISTEN_PORTS_FROM, TAKEN_BY_CONVENTION, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(LISTEN_PORTS_FROM <= p < low for p in ports), sorted(ports)
    assert not ports & TAKEN_BY_CONVENTION
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # free, as promised
