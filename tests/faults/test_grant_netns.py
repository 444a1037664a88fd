"""Read grants across network namespaces: a client READs a node's pools over UCX's TCP transport.

Needs root and iproute2 (``kvcr_testing.netns`` skips otherwise). The node runs in
namespace A, the client holding the granted lease in namespace B, both with
``UCX_TLS=tcp`` on their namespace's veth end (``Pair.ucx``; across namespaces of one
host, shared memory or CMA would still work and hide TCP): the payload must cross the veth
pair, which its byte counter shows. Over TCP the node's agent must be progressed for the
READ to complete (architecture §6): a granted deliver, whole and with a layer plan, lands
byte for byte inside the node's fast window after the grant and after it, with the node
otherwise idle. Then the node is frozen (SIGSTOP) under a granted READ: the deliver fails
at its deadline with a typed error, the READ left running is let go of once the node
continues, nothing stays in the client's or the node's tables, and later delivers work
again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcr_node.grant_progress import GRANT_BURST_S
from kvcr_testing.hostile import Worker
from kvcr_testing.netns import Pair, namespaces
from kvcr_testing.nodes import NodeProcess, start_node

PORT = 5556
SLOT = 256 << 10
SPANS = 64
"""Spans of the object (16 MiB)."""
DEADLINE_MS = 1500
"""The frozen read's deadline: well inside the client's three heartbeat intervals (6 s)."""


class Sites:
    """The node in A with a statistics client next to it, and the grant holder in B."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.endpoint = f"tcp://{pair.addr_a}:{PORT}"
        self.workers: list[Worker] = []
        self.node: NodeProcess = start_node(self.endpoint, "--pool", f"kv:256KiB:{SPANS + 16}", "--lease-pool-fraction", "1",
                                            prefix=("ip", "netns", "exec", pair.a), env=pair.ucx(pair.a))
        self.monitor = self.worker(pair.a, "statsloop")
        self.monitor.expect("ready", 60)
        self.holder = self.worker(pair.b, "grants", "--slot", str(SLOT))
        self.holder.expect("ready", 60)

    def worker(self, ns: str, mode: str, *args: str) -> Worker:
        w = Worker(mode, self.endpoint, *args, prefix=("ip", "netns", "exec", ns), env=self.pair.ucx(ns))
        self.workers.append(w)
        return w

    def stats(self) -> dict[str, Any]:
        self.monitor.say("stats")
        report = self.monitor.expect("stats", 30)
        assert "error" not in report, report
        stats: dict[str, Any] = report["stats"]
        return stats

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.node.stop()


@pytest.fixture
def sites() -> Iterator[Sites]:
    with namespaces("g", "10.201.0") as pair:
        s = Sites(pair)
        try:
            yield s
        finally:
            s.close()


def wait_for(what: str, probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_granted_reads_over_tcp_and_a_frozen_node_under_a_read(sites: Sites) -> None:
    holder, pair = sites.holder, sites.pair
    assert holder.ask("deposit obj 64 7") == {"event": "deposit", "status": "STORED", "code": 0}
    lease = holder.ask("lease 60000 obj")
    granted_at = time.monotonic()
    assert lease["statuses"] == {"obj": "LEASED"} and lease["granted_keys"] == 1, lease
    st = sites.stats()
    assert st["leases"]["with_grants"] == 1, st["leases"]
    posted, sent = st["transfers"]["posted"], pair.tx_bytes("a")

    # Whole, in the node's fast window after the grant.
    first = holder.ask(f"deliver obj {SPANS} 7 0 20000")
    assert first["status"] == "OK" and first["exact"] and first["granted"], first
    # Past the window: the node progresses its agent at its slow pace (or faster while it
    # serves a READ); a planned deliver still completes, byte for byte, with the node idle.
    time.sleep(max(0.0, granted_at + GRANT_BURST_S + 0.2 - time.monotonic()))  # leave the fast window
    late = holder.ask(f"deliver obj {SPANS} 7 1 20000")
    assert late["status"] == "OK" and late["exact"] and late["granted"], late

    st = sites.stats()
    assert st["transfers"]["posted"] == posted, "the node posted a transfer for a granted deliver"
    # Both reads crossed the veth from the node's namespace: UCX moved them over TCP.
    assert pair.tx_bytes("a") - sent >= 2 * SPANS * SLOT

    # The node frozen under a granted READ: it fails at its deadline, typed.
    tables = holder.ask("tables")["tables"]
    assert tables["reads"] == 0 and tables["pending"] == 0, tables
    sites.node.proc.send_signal(signal.SIGSTOP)
    try:
        done = holder.ask(f"deliver obj {SPANS} 7 0 {DEADLINE_MS}", DEADLINE_MS / 1000 + 30)
        assert done["status"] == "FAILED" and done["code"] == "DESTINATION_UNCERTAIN", done
        assert done["seconds"] < DEADLINE_MS / 1000 + 5, done  # at its deadline, not at the read timeout
        # The READ may still write the destination: the client keeps it until it ends.
        assert holder.ask("tables")["tables"]["reads"] == 1
    finally:
        sites.node.proc.send_signal(signal.SIGCONT)
    # Once the node runs again the READ ends and the client lets go of it.
    wait_for("the client letting go of the late READ", lambda: holder.ask("tables")["tables"]["reads"] == 0, 30)
    tables = holder.ask("tables")["tables"]
    assert tables["pending"] == 0 and tables["timed_out"] == 0, tables

    # Later delivers work, under the same grant.
    done = holder.ask(f"deliver obj {SPANS} 7 1 20000")
    assert done["status"] == "OK" and done["exact"] and done["granted"], done
    assert holder.ask("release") == {"event": "release", "released": 1}
    st = wait_for("the node at rest", lambda: (s := sites.stats())["leases"]["held"] == 0 and s, 30)
    assert st["leases"]["with_grants"] == 0 and st["claims"]["total"] == 0 and st["invariants"] == [], st
    assert st["transfers"]["in_flight"] == 0 and st["transfers"]["posted"] == posted, st["transfers"]
    print(f"\ngrants over TCP: 16 MiB in the fast window {first['seconds'] * 1000:.0f} ms, "
          f"planned past it {late['seconds'] * 1000:.0f} ms (indicative)")
