"""``free_port``: the ports the test servers are launched on stay free until the servers bind them."""

from __future__ import annotations

import socket

import pytest

from scheduler.testing.process import EPHEMERAL_PORTS_FILE, free_port


@pytest.mark.skipif(not EPHEMERAL_PORTS_FILE.is_file(), reason="no ip_local_port_range on this system")
def test_ports_lie_below_the_ephemeral_range_and_are_never_given_twice() -> None:
    """No outgoing connection nor bind to port 0 lands below the ephemeral range; two hundred ports are distinct,
    and the last can be bound."""
    first_ephemeral = int(EPHEMERAL_PORTS_FILE.read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < first_ephemeral for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
