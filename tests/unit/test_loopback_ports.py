"""Ports handed to children are outside the kernel's ephemeral range, never the same twice in a row of
calls, and never one something holds."""

import socket

from kvrelay.shared.wire import loopback_ports
from kvrelay.shared.wire.loopback_ports import LOWEST, ephemeral_start, free_port


def test_ports_lie_below_the_ephemeral_range_and_differ():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(LOWEST <= p < ephemeral_start() for p in ports)


def test_a_port_someone_holds_is_skipped(monkeypatch):
    port = free_port()
    monkeypatch.setattr(loopback_ports, "_next", port - LOWEST)  # the walk comes to it next
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        assert free_port() not in (port, None)
    monkeypatch.setattr(loopback_ports, "_next", port - LOWEST)
    assert free_port() == port  # free again: handed out


def test_a_pair_has_its_second_port_in_the_range_too():
    port = free_port(also_free_at=10000)
    assert LOWEST <= port and port + 10000 < ephemeral_start()


def test_an_ephemeral_range_reaching_low_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(loopback_ports, "ephemeral_start", lambda: LOWEST + 10)
    port = free_port()
    assert port >= LOWEST + 10  # from bind(0): in the (pretended) ephemeral range
