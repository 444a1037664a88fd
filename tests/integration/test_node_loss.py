"""A node that dies or stops under a client (spec section 12: failures are first-class).

SIGKILL: the client's pending operations fail (``NodeLostError``, or ``OperationTimeout``)
within their deadline; a node started again on the same endpoint serves the client after
``reconnect()``. SIGTERM: the node shuts down cleanly, exit code 0, socket file removed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client, NodeLostError, OperationTimeout, Span
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.layouts import Layout, Registrar, round_trip
from kvcr_testing.nodes import start_node
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 4 * KiB
POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])


def test_sigkill_fails_pending_operations_then_reconnect(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    endpoint = node.endpoint
    deadline_ms = 2000
    with Client(endpoint, name="itest-loss") as client:
        reg = Registrar(client)
        round_trip(client, reg, b"before", LAYOUT, 1)
        first = client.node
        assert first is not None

        dst = pattern(LAYOUT.nbytes, 3)
        before = dst.copy()
        dregion = reg(dst)
        spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        # Freeze the node so the next operations are surely pending when it dies.
        node.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            pending = [
                client.deliver({b"before": spans}, deadline_ms=deadline_ms),
                client.query([b"before"]),
                client.stats(),
            ]
            time.sleep(0.05)  # not synchronization: only gives a wrong early answer a chance to show
            assert not any(h.done() for h in pending)
        finally:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(10)
        for handle in pending:
            with pytest.raises((NodeLostError, OperationTimeout)):
                handle.result(deadline_ms / 1000 + 3)
        assert time.monotonic() - started < deadline_ms / 1000 + 3
        # The frozen node never ran the deliver: the destination keeps its own pattern.
        assert_bytes_equal(dst, before, "destination of the lost deliver")
        assert wait_until(lambda: client.core.lost, 5.0)
        # New work fails at once while the node is gone.
        t0 = time.monotonic()
        with pytest.raises(NodeLostError):
            client.query([b"before"]).result(5)
        assert time.monotonic() - t0 < 2.0

        # A new node on the same endpoint (the stale socket file is replaced).
        assert Path(endpoint.removeprefix("ipc://")).exists()
        again = start_node(endpoint, *POOL)
        try:
            welcome = client.reconnect()
            assert welcome.incarnation != first.incarnation
            assert not client.core.lost
            # The new node holds nothing of the old one's.
            assert client.query([b"before"]).result(5)[b"before"].presence.value == "MISS"
            round_trip(client, reg, b"after", LAYOUT, 5)  # regions registered before are re-announced
            assert_clean(client)
            reg.close()
        finally:
            client.close()
            assert again.stop() == 0


def test_sigterm_is_a_clean_shutdown(ipc_dir: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/term.sock"
    node = start_node(endpoint, *POOL)
    try:
        sock = Path(endpoint.removeprefix("ipc://"))
        assert sock.exists()
        with Client(endpoint) as client:
            reg = Registrar(client)
            round_trip(client, reg, b"k", LAYOUT, 7)
            assert_clean(client)
            reg.close()
    finally:
        code = node.stop(signal.SIGTERM)
    assert code == 0, node.output
    assert not sock.exists()
    assert "Traceback" not in "".join(node.output)
