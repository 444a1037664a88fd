"""Audit row 6: lease requests to a frozen but connected source.

Node A's clients lease keys their hint places at node B; B is frozen (SIGSTOP), so its
connection stays up and nothing is answered. Before, each request stayed until the link
dropped, holding about its keys' size (200 leases of 4,096 keys of 256 bytes took A from 78
to 558 MiB), answered UNREACHABLE with lease id 0 and so counted against no limit. Now each
lease answers within SOURCE_ANSWER_S (UNREACHABLE, or LEASE_LIMIT past the session's limits,
which count a pending lease), A's RSS stays within a bound, its lease tables return to 0 and
its link holds at most ASK_BYTES_PER_LINK of requests for B; an innocent client's queries are
served meanwhile (their latency is printed beside the baseline). Once B runs again (SIGCONT)
it answers the backlog, A releases whatever B granted late, and a new lease at B is held.
"""

from __future__ import annotations

import statistics
import time

from kvcr_client import Client, LeaseStatus
from kvcr_node.lease_requests import ASK_BYTES_PER_LINK
from kvcr_node.leases import SOURCE_ANSWER_S
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.measure import fd_count, rss_kib
from kvcr_testing.nodes import frozen
from kvcr_testing.remote import Sites, assert_site_clean, poll_stats

CLIENTS = 4
LEASES_PER_CLIENT = 50
KEYS = 4096
KEY_BYTES = 256
ANSWER_SLACK_S = 8.0
"""A lease answers within SOURCE_ANSWER_S plus this, counted from the call: the 200 requests of
1 MiB each are still being sent and taken in when the first are due, on a 2-core machine that
runs another test process beside this one (5.5 s seen there). Unanswered requests, the fault
this guards against, would wait for the link to drop, and it stays up: they fail ``result``."""
RSS_BOUND_MIB = 160
"""A's RSS growth allowed while the flood's answers are out: ZeroMQ's queue to B (at most
ASK_BYTES_PER_LINK, 16 MiB) and allocator arenas the decoded requests left. The leak this
guards against held about 2.4 MiB per lease: 480 MiB for these 200."""
FD_SLACK = 8
QUERIES = 50


def query_latencies(client: Client, key: bytes) -> list[float]:
    out = []
    for _ in range(QUERIES):
        t0 = time.perf_counter()
        client.query([key]).result(RESULT_TIMEOUT_S)
        out.append(time.perf_counter() - t0)
    return out


def flood_keys(n: int) -> list[bytes]:
    return [(b"flood%d-%d-" % (n, i)).ljust(KEY_BYTES, b"x") for i in range(KEYS)]


def test_a_lease_flood_at_a_frozen_source_costs_bounded_memory_and_time(sites: Sites) -> None:
    layout = plain_layout(1)
    a, b = sites.start("a", ("b", {"args": ("--heartbeat-ms", "10000", "--client-grace-ms", "60000")}))
    a.deposit(b"local", layout, seed=1)
    b.deposit(b"k", layout, seed=2)
    clients = [Client(a.endpoint, name=f"flood{n}") for n in range(CLIENTS)]
    try:
        keys = [flood_keys(n) for n in range(CLIENTS)]
        for client, ks in zip(clients, keys, strict=True):
            client.submit_hint("r", b.endpoint, ks).result(RESULT_TIMEOUT_S)
        clients[0].submit_hint("w", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
        # The link is up and works: a lease of k is held at B, then released.
        warm = clients[0].lease([b"k"], request_id="w").result(RESULT_TIMEOUT_S)
        assert warm.status(b"k") is LeaseStatus.LEASED_REMOTE
        warm.release().result(RESULT_TIMEOUT_S)
        poll_stats(b, lambda st: st["leases"]["held"] == 0, 10.0, "B released the warm-up lease")
        pid = a.node.proc.pid
        baseline = query_latencies(a.client, b"local")
        rss_before, fds_before = rss_kib(pid), fd_count(pid)

        with frozen(b.node):
            sent = []
            for _ in range(LEASES_PER_CLIENT):
                for client, ks in zip(clients, keys, strict=True):
                    sent.append((time.monotonic(), client.lease(ks, request_id="r")))
            during = query_latencies(a.client, b"local")  # an innocent client, while the flood is out
            late = []
            statuses: set[LeaseStatus] = set()
            for asked_at, fut in sent:
                lease = fut.result(SOURCE_ANSWER_S + ANSWER_SLACK_S + RESULT_TIMEOUT_S)
                late.append(time.monotonic() - asked_at)
                assert lease.id == 0 and lease.held == frozenset(), lease
                statuses.update(lease.status(k) for k in lease.keys)
            assert max(late) <= SOURCE_ANSWER_S + ANSWER_SLACK_S, max(late)
            assert statuses <= {LeaseStatus.UNREACHABLE, LeaseStatus.LEASE_LIMIT}, statuses
            rss_flood = rss_kib(pid)
            st = a.stats()
            peer = st["peers"][b.endpoint]
            assert st["leases"]["held"] == 0 and st["tables"]["leases"] == 0 and st["tables"]["lease_asks"] == 0
            assert peer["ask_bytes"] <= ASK_BYTES_PER_LINK and peer["state"] == "ready", peer
            assert st["invariants"] == []
            unsent = st["counters"].get("lease_asks_refused", 0)
            over_limit = st["leases"].get("keys_refused_limit", 0)
            print(f"\nfrozen source: {len(sent)} leases of {KEYS} keys; answered within {max(late):.2f} s; "
                  f"A's RSS {rss_before // 1024} -> {rss_flood // 1024} MiB; link queue {peer['ask_bytes'] >> 20} MiB, "
                  f"{peer['lease_asks_abandoned']} requests given up, {unsent} not sent; {over_limit} keys LEASE_LIMIT")
            print(f"innocent query p50 {statistics.median(baseline) * 1e6:.0f} us before, "
                  f"{statistics.median(during) * 1e6:.0f} us during the flood "
                  f"(p90 {sorted(baseline)[QUERIES * 9 // 10] * 1e6:.0f} / {sorted(during)[QUERIES * 9 // 10] * 1e6:.0f} us)")
            assert (rss_flood - rss_before) // 1024 <= RSS_BOUND_MIB, (rss_before, rss_flood)
            assert fd_count(pid) <= fds_before + FD_SLACK

        # B runs again: it answers the backlog, and A releases what it granted too late.
        poll_stats(a, lambda st: st["peers"][b.endpoint]["lease_asks_abandoned"] == 0
                   and st["peers"][b.endpoint]["ask_bytes"] == 0 and st["tables"]["lease_asks"] == 0,
                   30.0, "A heard B answer the backlog")
        poll_stats(b, lambda st: st["leases"]["held"] == 0, 30.0, "B let go of every late lease")
        again = clients[0].lease([b"k"], request_id="w").result(RESULT_TIMEOUT_S)
        assert again.status(b"k") is LeaseStatus.LEASED_REMOTE
        again.release().result(RESULT_TIMEOUT_S)
        poll_stats(b, lambda st: st["leases"]["held"] == 0, 10.0, "B released the lease")
        poll_stats(a, lambda st: st["tables"]["lease_asks"] == 0, 10.0, "A heard the release answered")
    finally:
        for client in clients:
            client.close()
    b.resident[b"k"] = ("kv",)
    assert_site_clean(a)
    assert_site_clean(b)
