"""Two nodes in separate network namespaces, joined by a veth pair, and the link cut mid-transfer.

Needs root and iproute2 (``ip netns``); skipped with the reason otherwise. The namespaces,
addresses (10.200.0.1/24 and 10.200.0.2/24) and processes are this test's own, and are
removed afterwards whatever happens. Everything runs with ``UCX_TLS=tcp`` on its namespace's
veth end (``Pair.ucx``): across namespaces NIXL must not try shared memory or CMA.

Node A holds the objects; a client in B's namespace asks its node B for them, with a hint
naming A: A writes over TCP straight into the client's memory. The client stops
progressing right after sending (so the write is surely in flight), the link goes down,
and B fails the key at the deadline with ``DESTINATION_UNCERTAIN``. When the link comes
back both nodes settle (B's reservation ends once A answers), and new deliveries work.
Twice: a cut shorter than the nodes' grace, and one longer, after which A has dropped B's
peer session as silent and B must notice and open a new one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcr_testing.hostile import Worker
from kvcr_testing.netns import Pair, ip, namespaces
from kvcr_testing.nodes import start_node

ADDR_A, ADDR_B = "10.200.0.1", "10.200.0.2"
PORT = 5555
SLOT = 256 << 10
BIG = 128
"""Spans of the big object (32 MiB)."""
POOL = ("--pool", f"kv:256KiB:{BIG + 32}")
DEADLINE_MS = 8000
PARTITIONS = {
    # The link is down until the client has its answer (about the deadline); the nodes'
    # grace is longer, so their peer session survives.
    "short": {"args": ("--client-grace-ms", "30000"), "pause": 4.0},
    # The link stays down past the source's grace: A drops B's silent peer session while
    # the write is in flight. Once the link is back, B must open a new one. (The client's
    # pause stays under its own node's grace.)
    "long": {"args": ("--client-grace-ms", "4000", "--heartbeat-ms", "1000"), "pause": 2.5},
}


@pytest.fixture
def netns() -> Iterator[Pair]:
    """Two namespaces joined by a veth pair, A on ``ADDR_A`` and B on ``ADDR_B``."""
    with namespaces("", ADDR_A.rsplit(".", 1)[0]) as pair:
        assert (pair.addr_a, pair.addr_b) == (ADDR_A, ADDR_B)
        yield pair


class Site:
    """A node in a namespace, with a long-lived statistics client next to it."""

    def __init__(self, pair: Pair, ns: str, addr: str, *args: str) -> None:
        self.ns = ns
        self.ucx = pair.ucx(ns)
        self.endpoint = f"tcp://{addr}:{PORT}"
        self.node = start_node(self.endpoint, *POOL, "--peer-dead-ms", "2000", *args,
                               prefix=("ip", "netns", "exec", ns), env=self.ucx)
        self.workers: list[Worker] = []
        self.monitor = self.worker("statsloop")
        self.monitor.expect("ready", 60)

    def worker(self, mode: str, *args: str) -> Worker:
        w = Worker(mode, self.endpoint, *args, prefix=("ip", "netns", "exec", self.ns), env=self.ucx)
        self.workers.append(w)
        return w

    def stats(self) -> dict[str, Any]:
        self.monitor.say("stats")
        report = self.monitor.expect("stats", 30)
        assert "error" not in report, report
        stats: dict[str, Any] = report["stats"]
        return stats

    def wait_for(self, what: str, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if predicate(st):
                return st
            assert time.monotonic() < deadline, f"{self.ns}: {what} not within {timeout} s: {st}"
            time.sleep(0.2)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.node.stop()


def at_rest(st: dict[str, Any]) -> bool:
    return (
        st["invariants"] == []
        and st["claims"]["total"] == 0
        and st["operations_pending"] == 0
        and st["transfers"]["in_flight"] == 0
        and st["writing"] == 0
        and all(p["writes_outstanding"] == 0 and p["queued"] == 0 for p in st["peers"].values())
    )


def deliver(site: Site, source: Site, key: str, spans: int, seed: int, *extra: str) -> Worker:
    w = site.worker("deliver", "--source", source.endpoint, "--keys", key, "--slot", str(SLOT), "--spans", str(spans),
                    "--seed", str(seed), *extra)
    w.expect("issued", 60)
    return w


@pytest.mark.timeout(240)
@pytest.mark.parametrize("partition", list(PARTITIONS))
def test_cross_namespace_delivery_and_link_cut(partition: str, netns: Pair) -> None:
    ns_a, veth_a = netns.a, netns.veth_a
    node_args, pause = PARTITIONS[partition]["args"], PARTITIONS[partition]["pause"]
    sites: list[Site] = []
    try:
        a = Site(netns, ns_a, ADDR_A, *node_args)
        sites.append(a)
        b = Site(netns, netns.b, ADDR_B, *node_args)
        sites.append(b)
        for key, spans, seed in (("small", 4, 1), ("big", BIG, 100)):
            w = a.worker("deposit", "--keys", key, "--slot", str(SLOT), "--spans", str(spans), "--seed", str(seed))
            assert w.expect("result", 60)["outcomes"] == {key: ["STORED", 0]}

        # Across the veth, over TCP: byte-exact.
        result = deliver(b, a, "small", 4, 1).expect("result", 60)
        assert result["outcomes"]["small"] == ["OK", "OK", True], result

        # The big one, with the client frozen right after sending: the write stays in flight.
        w = deliver(b, a, "big", BIG, 100, "--deadline-ms", str(DEADLINE_MS), "--pause", str(pause), "--linger", "15")
        issued = time.monotonic()
        a.wait_for("the write in flight", lambda st: st["transfers"]["in_flight"] == 1, pause - 0.5)
        ip("-n", ns_a, "link", "set", veth_a, "down")
        cut = time.monotonic()
        try:
            result = w.expect("result", DEADLINE_MS / 1000 + 30)
            assert result["outcomes"]["big"][:2] == ["FAILED", "DESTINATION_UNCERTAIN"], result
            assert result["seconds"] < DEADLINE_MS / 1000 + 5, result
            st = b.stats()
            assert st["invariants"] == [] and st["peers"][a.endpoint]["uncertain"] == 1, st["peers"]
            assert st["counters"].get("uncertain_writes") == 1, st["counters"]
            if partition == "long":
                a.wait_for("A dropping B's silent peer session", lambda st: st["counters"].get("peers_expired") == 1, 15)
        finally:
            ip("-n", ns_a, "link", "set", veth_a, "up")
        restored = time.monotonic()

        # Both settle once the link is back: A's transfer ends, B hears the write is over.
        st_b = b.wait_for("B at rest", lambda st: at_rest(st) and st["peers"][a.endpoint]["uncertain"] == 0, 60)
        st_a = a.wait_for("A at rest", at_rest, 60)
        settled = time.monotonic()
        assert st_b["counters"].get("uncertain_resolved") == 1, st_b["counters"]
        assert st_a["counters"].get("peer_hellos") == (2 if partition == "long" else 1), st_a["counters"]
        assert st_a["counters"].get("peers_expired", 0) == (1 if partition == "long" else 0), st_a["counters"]

        # New deliveries work, the big one too.
        result = deliver(b, a, "small", 4, 1).expect("result", 60)
        assert result["outcomes"]["small"] == ["OK", "OK", True], result
        result = deliver(b, a, "big", BIG, 100).expect("result", 90)
        assert result["outcomes"]["big"] == ["OK", "OK", True], result
        b.wait_for("B at rest", at_rest, 30)
        a.wait_for("A at rest", at_rest, 30)
        print(
            f"\nnetns ({partition}): cut {cut - issued:.2f} s after sending; link down {restored - cut:.1f} s; "
            f"settled {settled - restored:.1f} s after it came back; A outcomes {st_a['outcomes']}"
        )
    finally:
        for site in sites:
            site.close()
