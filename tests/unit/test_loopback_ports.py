"""Ports handed to children are outside the kernel's ephemeral range, never the same twice in a row of
calls, and never one something holds."""

import socket

from kvrelay.shared.wire import loopback_ports
from kvrelay.shared.wire.loopback_ports import BLOCK, LOWEST, ephemeral_start, free_port


def test_ports_lie_below_the_ephemeral_range_and_each_brings_its_block():
    ports = [free_port() for _ in range(50)]
    assert all(LOWEST <= p < ephemeral_start() for p in ports)
    # kvrelay serve numbers its workers' ports up from the one given: no later call hands those out
    taken = sorted(q for p in ports for q in range(p, p + BLOCK))
    assert len(set(taken)) == len(taken)


def test_a_block_with_a_port_someone_holds_is_skipped(monkeypatch):
    port = free_port()
    for held in (port, port + BLOCK - 1):
        monkeypatch.setattr(loopback_ports, "_next", (port - LOWEST) // BLOCK)  # the walk comes to it next
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", held))
            assert free_port() != port
    monkeypatch.setattr(loopback_ports, "_next", (port - LOWEST) // BLOCK)
    assert free_port() == port  # free again: handed out


def test_a_pair_has_its_second_port_in_the_range_too():
    port = free_port(also_free_at=10000)
    assert LOWEST <= port and port + 10000 < ephemeral_start()


def test_an_ephemeral_range_reaching_low_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(loopback_ports, "ephemeral_start", lambda: LOWEST + 10)
    port = free_port()
    assert port >= LOWEST + 10  # from bind(0): in the (pretended) ephemeral range


def test_a_block_another_process_claimed_is_skipped_though_nothing_is_bound_yet(monkeypatch, tmp_path):
    monkeypatch.setattr(loopback_ports, "_CLAIMS", tmp_path)
    port = free_port()
    monkeypatch.setattr(loopback_ports, "_next", (port - LOWEST) // BLOCK)
    assert free_port() == port  # this process's own claim: still its to hand out
    (claim,) = tmp_path.iterdir()
    claim.write_text("1")  # now another process's (pid 1), which has not bound the port yet
    monkeypatch.setattr(loopback_ports, "_next", (port - LOWEST) // BLOCK)
    assert free_port() != port
    claim.rename(claim.with_suffix(f".{int(claim.suffix[1:]) - 2}"))  # two windows ago: no longer counts
    monkeypatch.setattr(loopback_ports, "_next", (port - LOWEST) // BLOCK)
    assert free_port() == port
