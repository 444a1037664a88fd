"""Churn soak: thousands of leases, on one node and across two, must leave nothing behind.

Leases are granted and released, renewed, left to expire, and dropped with their
sessions, thousands of times; remote leases are asked of a source and released again. The
node's lease tables (``leases``, ``lease_holders``, ``lease_expiry``), the links' lease
requests, the source's peer leases, the client's table of live leases, claims and pinned
slots return to their bound, and the nodes' descriptors and RSS stay within a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcr_client import Client, LeaseStatus, Span
from kvcr_node.leases import EXPIRY_SLACK
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, plain_layout
from kvcr_testing.measure import fd_count, rss_kib
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.remote import Sites, assert_site_clean, poll_stats

SLOT = 4 * KiB
KEYS = 32
CYCLES = 3000
SESSIONS = 60
REMOTE_CYCLES = 400
FD_SLACK = 10
RSS_GROWTH_KIB = 4096
"""RSS growth allowed over the soak (allocator and UCX pools grow in steps once; a leak of
a lease record per cycle, a few hundred bytes, would pass 1 MiB long before the end)."""


def put(client: Client, reg: Registrar, keys: list[bytes]) -> None:
    region = reg(pattern(SLOT, 5))
    assert client.deposit({k: [Span("L0", region, 0, SLOT, "kv")] for k in keys}).result(RESULT_TIMEOUT_S).all_ok


def lease_tables(st: dict[str, Any]) -> tuple[int, int, int]:
    t = st["tables"]
    return t["leases"], t["lease_holders"], t["lease_expiry"]


def test_lease_churn_on_one_node(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:4KiB:256", "--lease-pool-fraction", "1", "--lease-ttl-ms", "30000")
    pid = node.proc.pid
    keys = [b"key%d" % i for i in range(KEYS)]
    with Client(node.endpoint, name="churn") as client:
        reg = Registrar(client)
        put(client, reg, keys)
        for _ in range(50):  # warm
            client.lease(keys[:4]).result(RESULT_TIMEOUT_S).release().result(RESULT_TIMEOUT_S)
        fds_before, rss_before = fd_count(pid), rss_kib(pid)
        for i in range(CYCLES):
            lease = client.lease([keys[i % KEYS], keys[(i * 7) % KEYS], b"absent"]).result(RESULT_TIMEOUT_S)
            assert lease.status(keys[i % KEYS]) is LeaseStatus.LEASED
            if i % 3 == 0:
                assert lease.renew(60_000).result(RESULT_TIMEOUT_S) == 60_000
            lease.release().result(RESULT_TIMEOUT_S)
            if i % 500 == 0:
                held, holders, expiry = lease_tables(stats(client))
                assert held == 0 and holders == 0 and expiry <= EXPIRY_SLACK + 2, (held, holders, expiry)
        # Thousands of leases cost the node no descriptor and no lasting memory.
        assert fd_count(pid) <= fds_before + FD_SLACK, (fds_before, fd_count(pid))
        assert rss_kib(pid) - rss_before <= RSS_GROWTH_KIB, (rss_before, rss_kib(pid))
        # Leases left to expire, and leases dropped with their sessions (each session's own
        # descriptors are the session churn soak's: tests/faults/test_session_churn.py).
        short = [client.lease([k], ttl_ms=200).result(RESULT_TIMEOUT_S) for k in keys]
        for n in range(SESSIONS):
            with Client(node.endpoint, name=f"leaver{n}") as leaver:
                assert leaver.lease(keys[n % KEYS : n % KEYS + 4]).result(RESULT_TIMEOUT_S).held
        assert wait_until(lambda: stats(client)["tables"]["leases"] == 0, 10.0)
        client.stats().result(RESULT_TIMEOUT_S)
        assert all(lease.ended is not None for lease in short) and client.tables()["leases"] == 0
        st = stats(client)
        assert lease_tables(st)[:2] == (0, 0) and lease_tables(st)[2] <= EXPIRY_SLACK + 2, st["tables"]
        assert st["leases"]["pinned_slots"] == {"kv": 0} and st["leases"]["expired"] == KEYS
        assert st["leases"]["ended_with_session"] == SESSIONS
        reg.close()
        assert_clean(client)


def test_remote_lease_churn(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = plain_layout(2)
    keys = [b"r%d" % i for i in range(8)]
    for i, k in enumerate(keys):
        b.deposit(k, layout, seed=i)
    a.client.submit_hint("r", b.endpoint, keys).result(RESULT_TIMEOUT_S)
    for i in range(REMOTE_CYCLES):
        lease = a.client.lease([keys[i % 8], keys[(i + 3) % 8]], request_id="r").result(RESULT_TIMEOUT_S)
        assert lease.held_prefix() == 2, lease
        if i % 4 == 0:
            lease.renew().result(RESULT_TIMEOUT_S)
        lease.release().result(RESULT_TIMEOUT_S)
    poll_stats(b, lambda st: st["leases"]["held"] == 0, 10.0, "B released every peer lease")
    # Releases at the source are answered asynchronously: A's table of lease requests drains
    # once B's last acknowledgements arrive.
    poll_stats(a, lambda st: st["tables"]["lease_asks"] == 0, 10.0, "A heard every release answered")
    sa, sb = a.stats(), b.stats()
    assert sa["tables"]["lease_asks"] == 0 and sa["tables"]["source_leases"] == 0, sa["tables"]
    assert lease_tables(sa)[:2] == (0, 0) and lease_tables(sb)[:2] == (0, 0)
    assert lease_tables(sb)[2] <= EXPIRY_SLACK + 2 and sb["leases"]["granted"] == REMOTE_CYCLES
    b.resident.update({k: ("kv",) * 2 for k in keys})
    assert_site_clean(a)
    assert_site_clean(b)
