"""UCX stays on loopback in the tests: a node and a client of one host, after a real transfer,
hold no TCP socket outside 127.0.0.0/8 and ::1, none on a wildcard address either.

UCX (under NIXL) opens a TCP listener for its wireup on every network device it may use;
left to choose, that includes the host's external interface, reachable from outside the
host for as long as a test runs. ``tests/conftest.py`` sets ``UCX_NET_DEVICES=lo`` for the
whole session, and every process a test starts inherits it; without it this test fails,
naming the sockets. The sockets are read from ``/proc`` (``kvcr_testing.sockets``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from kvcr_client import Client
from kvcr_testing.layouts import Registrar, plain_layout, round_trip
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.sockets import TcpSocket, tcp_sockets


def outside_loopback(sockets: list[TcpSocket]) -> list[str]:
    return [str(s) for s in sockets if not s.loopback]


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_node_and_client_keep_ucx_on_loopback(
    tls: str, node_factory: Callable[..., NodeProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    if tls == "tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")  # the transfer itself crosses TCP, for the node and the client
    node = node_factory("--pool", "kv:64KiB:16")
    with Client(node.endpoint, name="itest-ucx-loopback") as client:
        reg = Registrar(client)
        try:
            round_trip(client, reg, b"ucx-loopback", plain_layout(4), seed=39)
            held = {"node": tcp_sockets(node.proc.pid), "test process": tcp_sockets(os.getpid())}
        finally:
            reg.close()

    # UCX's TCP listener is there (else the check below would prove nothing), on loopback.
    assert any(s.listening for s in held["node"]), f"the node listens on no TCP socket: {held['node']}"
    if tls == "tcp":
        # The transfer went over TCP: the node holds a connection, on loopback too.
        assert any(not s.listening for s in held["node"]), f"the node holds no TCP connection: {held['node']}"
    outside = {who: off for who, sockets in held.items() if (off := outside_loopback(sockets))}
    assert not outside, (
        f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')!r}: TCP sockets off loopback {outside}; "
        "the suite keeps UCX on loopback (tests/conftest.py)"
    )
