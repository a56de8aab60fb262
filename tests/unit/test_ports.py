"""Ports for clusters launched on one machine: free when drawn, and outside the range the kernel
hands outgoing connections, which would otherwise take one before its listener binds it."""

from __future__ import annotations

import socket

import pytest

from moe_cluster.common.ports import ephemeral_range, free_ports


def test_free_ports_are_distinct_listenable_and_not_ephemeral():
    lo, hi = ephemeral_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert not any(lo <= p <= hi for p in ports), (ports, lo, hi)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out():
    # the range outside the "ephemeral" one is a single port, held by a listener here
    for port, ephemeral in ((20000, (20001, 65535)), (65535, (20000, 65534))):
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port))
        except OSError:
            taken.close()
            continue
        with taken:
            taken.listen()
            ports = free_ports(3, ephemeral=ephemeral)
        assert port not in ports and len(set(ports)) == 3, ports
        return
    pytest.skip("ports 20000 and 65535 are both in use here")


def test_with_no_room_outside_the_ephemeral_range_the_kernel_picks():
    ports = free_ports(4, ephemeral=(1, 65535))
    assert len(set(ports)) == 4 and all(p > 0 for p in ports)
