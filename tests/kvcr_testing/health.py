"""A node's health, seen through a client: stats snapshots, at-rest checks, bounded polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvcr_client import Client

STATS_TIMEOUT_S = 5.0


def stats(client: Client) -> dict[str, Any]:
    """The node's stats with its accounting check (``invariants``)."""
    result: dict[str, Any] = client.stats(audit=True).result(STATS_TIMEOUT_S)
    return result


def slot_accounting(st: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per pool ``(free, allocated)`` from a stats snapshot."""
    return {name: (p["free"], p["allocated"]) for name, p in st["pools"].items()}


def assert_clean(client: Client, *, slots_before: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The node is at rest and consistent: no breach, no claim, nothing pending or in flight.

    With ``slots_before`` (from ``slot_accounting``), also that no slot was taken or freed.
    Returns the stats snapshot it checked.
    """
    st = stats(client)
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0, st["claims"]
    assert st["claims"]["handles"] == 0, st["claims"]
    assert st["claims"]["operations"] == 0, st["claims"]
    assert st["claims"].get("leases", 0) == 0, st["claims"]
    assert st.get("leases", {}).get("held", 0) == 0, st["leases"]
    assert st["operations_pending"] == 0, st
    assert st["transfers"]["in_flight"] == 0 and st["transfers"]["prepared"] == 0, st["transfers"]
    assert st["writing"] == 0, st
    for name, pool in st["pools"].items():
        assert pool["free"] + pool["allocated"] == pool["total"], (name, pool)
    if slots_before is not None:
        assert slot_accounting(st) == slots_before, (slot_accounting(st), slots_before)
    return st


def node_stats_ok(client: Client) -> dict[str, Any]:
    """Stats with no invariant breach (the node may be busy)."""
    st = stats(client)
    assert st["invariants"] == [], st["invariants"]
    return st


def counter(st: dict[str, Any], name: str) -> int:
    """A counter of a stats snapshot (0 when the node never counted it)."""
    return int(st["counters"].get(name, 0))


def outcome_count(st: dict[str, Any], prefix: str) -> int:
    """Outcomes whose label starts with ``prefix`` (``write.`` counts every peer write)."""
    return sum(n for label, n in st["outcomes"].items() if label.startswith(prefix))


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


DISK_SETTLE_S = 30.0
"""A bound on how long a node's disk tier takes to write or read back what a test gave it."""


def disk_tier(client: Client) -> dict[str, Any]:
    """The ``disk_tier`` part of a node's stats (a node with disk pools)."""
    result: dict[str, Any] = stats(client)["disk_tier"]
    return result


def disk_settled(client: Client) -> dict[str, Any]:
    """The disk tier once no copy is being written or read back (bounded wait)."""
    def settled() -> bool:
        figures = disk_tier(client)
        return bool(figures["demoting"] == 0 and figures["promoting"] == 0)
    assert wait_until(settled, DISK_SETTLE_S), disk_tier(client)
    return disk_tier(client)
