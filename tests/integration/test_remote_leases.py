"""Leases across real node processes (spec sections 6.11 and 12).

The client talks to node A; node B holds the objects, named to A by the client's hint. A
lease on hinted keys is held at B through A's peer session (LEASED_REMOTE), survives
eviction pressure at B, and serves a layer-by-layer delivery across the nodes byte for
byte. It ends on both sides when the client releases it or its session ends, when B
expires it, when A goes away (B drops A's peer session), and visibly (``lease_end`` with
the keys) when B is killed or restarts. A source below version 4 answers ADVISORY, an
unreachable one UNREACHABLE: never a lease that is not one. After each test no node
holds a lease, claim or pinned slot it should not.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvcr_client import ErrorCode, LeaseStatus, Span
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.nodes import start_node
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.remote import POOLS, Sites, assert_site_clean, poll_stats

LAYOUT = plain_layout(4)
SLACK_S = 5.0


def leases_held(site: Any) -> int:
    return int(site.stats()["leases"]["held"])


def hint(a: Any, b: Any, keys: list[bytes], request_id: str = "r") -> str:
    a.client.submit_hint(request_id, b.endpoint, keys).result(RESULT_TIMEOUT_S)
    return request_id


def test_remote_lease_holds_at_the_source_and_serves_a_planned_deliver(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"pools": ("--pool", "kv:64KiB:8"), "args": ("--policy", "fifo", "--lease-pool-fraction", "1",
                                                                                 "--lease-session-fraction", "1")}))
    srcs = {k: b.deposit(k, LAYOUT, seed=i) for i, k in enumerate([b"k0", b"k1"])}
    rid = hint(a, b, [b"k0", b"k1", b"gone"])
    lease = a.client.lease([b"k0", b"k1", b"gone", b"nowhere"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert [lease.status(k) for k in (b"k0", b"k1", b"gone", b"nowhere")] == [
        LeaseStatus.LEASED_REMOTE, LeaseStatus.LEASED_REMOTE, LeaseStatus.MISS, LeaseStatus.MISS]
    assert lease.tier(b"k0") == "remote" and lease.held_prefix() == 2
    sb = b.stats()
    assert sb["leases"]["held"] == 1 and sb["leases"]["pinned_slots"] == {"kv": 8}
    assert a.stats()["peers"][b.endpoint]["leases"] == 1
    # Pressure at B: its owner deposits into a full pool; the leased objects stay.
    out = b.client.deposit({b"new": LAYOUT.source_spans(b.reg(pattern(LAYOUT.nbytes, 9)))}).result(RESULT_TIMEOUT_S)
    assert out[b"new"].code is ErrorCode.CAPACITY  # every slot is leased: nothing may be evicted
    # A layer by layer delivery across the nodes under the lease, byte for byte.
    for k, src in srcs.items():
        dst = pattern(LAYOUT.nbytes, 50)
        region = a.reg(dst)
        spans = [Span(name, region, i * 64 * KiB, 64 * KiB) for i, name in enumerate(LAYOUT.names)]
        handle = a.client.deliver({k: spans}, request_id=rid, plan=[[n] for n in LAYOUT.names])
        for g in range(len(LAYOUT.names)):
            handle.wait(g, RESULT_TIMEOUT_S)
        assert handle.result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst, src)
    lease.release().result(RESULT_TIMEOUT_S)
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B released the peer lease")
    st = b.stats()
    assert st["leases"]["pinned_slots"] == {"kv": 0} and st["claims"]["total"] == 0
    assert a.stats()["peers"][b.endpoint]["leases"] == 0
    b.resident.update({k: ("kv",) * 4 for k in srcs})
    assert_site_clean(a)
    assert_site_clean(b)


def test_a_lease_mixes_local_and_remote_keys_and_renews_both(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    a.deposit(b"here", LAYOUT, seed=1)
    b.deposit(b"there", LAYOUT, seed=2)
    rid = hint(a, b, [b"there"])
    lease = a.client.lease([b"there", b"here"], request_id=rid, ttl_ms=800).result(RESULT_TIMEOUT_S)
    assert [lease.status(k) for k in (b"there", b"here")] == [LeaseStatus.LEASED_REMOTE, LeaseStatus.LEASED]
    assert lease.tier(b"here") == "dram"
    assert lease.renew(60_000).result(RESULT_TIMEOUT_S) == 60_000
    # Past the first time to live, both sides still hold it (the renewal reached B).
    assert not wait_until(lambda: leases_held(b) == 0 or leases_held(a) == 0, 1.5)
    a.client.stats().result(RESULT_TIMEOUT_S)
    assert lease.ended is None and lease.held == frozenset([b"there", b"here"])
    lease.release().result(RESULT_TIMEOUT_S)
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B released the peer lease")
    assert_site_clean(a)
    assert_site_clean(b)


def test_expiry_ends_the_lease_on_both_nodes(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    b.deposit(b"k", LAYOUT, seed=3)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid, ttl_ms=400).result(RESULT_TIMEOUT_S)
    assert lease.status(b"k") is LeaseStatus.LEASED_REMOTE
    assert wait_until(lambda: a.client.stats().result(RESULT_TIMEOUT_S) is not None and lease.ended is not None, SLACK_S)
    assert lease.ended is ErrorCode.LEASE_EXPIRED
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B's lease ended too")
    assert b.stats()["leases"]["pinned_slots"] == {name: 0 for name in b.stats()["pools"]}
    assert_site_clean(a)
    assert_site_clean(b)


def test_the_clients_session_end_ends_its_leases_at_the_source(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    b.deposit(b"k", LAYOUT, seed=4)
    from kvcr_client import Client

    with Client(a.endpoint, name="leaving") as leaving:
        leaving.submit_hint("r", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
        lease = leaving.lease([b"k"], request_id="r").result(RESULT_TIMEOUT_S)
        assert lease.status(b"k") is LeaseStatus.LEASED_REMOTE and leases_held(b) == 1
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B let go when the client left A")
    assert_site_clean(a)
    assert_site_clean(b)


def test_source_killed_then_restarted_ends_the_remote_keys_visibly(sites: Sites) -> None:
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", "500")}))
    a.deposit(b"local", LAYOUT, seed=5)
    b1 = sites("b1")
    endpoint = b1.endpoint
    b1.deposit(b"k", LAYOUT, seed=6)
    rid = hint(a, b1, [b"k"])
    lease = a.client.lease([b"k", b"local"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert lease.held == frozenset([b"k", b"local"])
    b1.node.kill()
    # A sees the source go: the client is told which keys are no longer held; the rest stays.
    assert wait_until(lambda: a.client.stats().result(RESULT_TIMEOUT_S) is not None and b"k" in lease.lost, SLACK_S)
    assert lease.ended is None and lease.held == frozenset([b"local"])
    assert a.stats()["leases"]["lost_at_source"] == 1
    # A new incarnation at the same endpoint: a new lease reaches it.
    b2 = sites.adopt(start_node(endpoint, *POOLS), "b2")
    b2.deposit(b"k", LAYOUT, seed=7)
    incarnation = b2.stats()["incarnation"]
    poll_stats(a, lambda st: st["peers"][endpoint]["state"] == "ready" and st["peers"][endpoint]["incarnation"] == incarnation,
               SLACK_S, "A reconnected to the new incarnation")
    again = a.client.lease([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert again.status(b"k") is LeaseStatus.LEASED_REMOTE and leases_held(b2) == 1
    for handle in (lease, again):
        handle.release().result(RESULT_TIMEOUT_S)
    poll_stats(b2, lambda st: st["leases"]["held"] == 0, SLACK_S, "B2 released")
    assert_site_clean(a)
    assert_site_clean(b2)


def poked(a: Any) -> bool:
    """A round trip to A, so that its client has read every event sent before."""
    return a.client.stats().result(RESULT_TIMEOUT_S) is not None


def test_a_killed_source_keeps_its_keys_leased_until_peer_dead_ms(sites: Sites) -> None:
    """Audit row 7: remote leases ended 0.01 s after the source was killed, with
    --peer-dead-ms 4000. They are held through the outage now, and lost after it; a deliver
    of such a key meanwhile fails PEER_UNREACHABLE for that key alone (spec section 6.11)."""
    peer_dead_s = 4.0
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", str(int(peer_dead_s * 1000)))}))
    local = a.deposit(b"local", LAYOUT, seed=11)
    b = sites("b")
    b.deposit(b"k", LAYOUT, seed=12)
    rid = hint(a, b, [b"k"])
    # No read grants: the outage is seen by the node-driven path (a granted key's READ of
    # the dead source fails TRANSFER_FAILED instead, tests/integration/test_remote_grants.py).
    mixed = a.client.lease([b"k", b"local"], request_id=rid, ttl_ms=60_000, read=False).result(RESULT_TIMEOUT_S)
    remote = a.client.lease([b"k"], request_id=rid, ttl_ms=60_000, read=False).result(RESULT_TIMEOUT_S)
    assert mixed.held == frozenset([b"k", b"local"]) and remote.held == frozenset([b"k"])
    killed_at = time.monotonic()
    b.node.kill()
    poll_stats(a, lambda st: st["peers"][b.endpoint]["state"] == "down", SLACK_S, "A saw the source go")
    # During the outage: both leases hold; a deliver of both keys fails the remote one only.
    dst = {k: pattern(LAYOUT.nbytes, 60 + i) for i, k in enumerate((b"k", b"local"))}
    spans = {k: [Span(name, a.reg(buf), i * 64 * KiB, 64 * KiB) for i, name in enumerate(LAYOUT.names)]
             for k, buf in dst.items()}
    out = a.client.deliver(spans, request_id=rid, deadline_ms=500).result(RESULT_TIMEOUT_S)
    assert out[b"k"].code is ErrorCode.PEER_UNREACHABLE and out[b"local"].ok
    assert np.array_equal(dst[b"local"], local)
    assert poked(a) and remote.ended is None and mixed.lost == frozenset()
    # After peer_dead_ms: lost, PEER_UNREACHABLE; never before it.
    assert wait_until(lambda: poked(a) and remote.ended is not None, peer_dead_s + SLACK_S)
    assert time.monotonic() - killed_at >= peer_dead_s
    assert remote.ended is ErrorCode.PEER_UNREACHABLE and "peer_dead_ms" in remote.end_reason
    assert mixed.lost == frozenset([b"k"]) and mixed.ended is None and mixed.held == frozenset([b"local"])
    mixed.release().result(RESULT_TIMEOUT_S)
    assert_site_clean(a, expect_peers_idle=False)


def test_a_source_restarted_within_peer_dead_ms_ends_its_keys_peer_restarted(sites: Sites) -> None:
    """Audit row 7: a source restarted on its path was reported PEER_UNREACHABLE, never
    PEER_RESTARTED. With peer_dead_ms long, only the new incarnation can end the lease."""
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}))
    b1 = sites("b1")
    endpoint = b1.endpoint
    b1.deposit(b"k", LAYOUT, seed=13)
    rid = hint(a, b1, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert lease.held == frozenset([b"k"])
    b1.node.kill()
    poll_stats(a, lambda st: st["peers"][endpoint]["state"] == "down", SLACK_S, "A saw the source go")
    assert poked(a) and lease.ended is None
    b2 = sites.adopt(start_node(endpoint, *POOLS), "b2")
    assert wait_until(lambda: poked(a) and lease.ended is not None, SLACK_S)
    assert lease.ended is ErrorCode.PEER_RESTARTED and lease.held == frozenset()
    assert a.stats()["leases"]["held"] == 0
    # The new incarnation serves new leases.
    b2.deposit(b"k", LAYOUT, seed=14)
    again = a.client.lease([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert again.status(b"k") is LeaseStatus.LEASED_REMOTE and leases_held(b2) == 1
    again.release().result(RESULT_TIMEOUT_S)
    poll_stats(b2, lambda st: st["leases"]["held"] == 0, SLACK_S, "B2 released")
    assert_site_clean(a)
    assert_site_clean(b2)


def test_target_killed_ends_its_leases_at_the_source(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"args": ("--heartbeat-ms", "100", "--client-grace-ms", "600")}))
    b.deposit(b"k", LAYOUT, seed=8)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert lease.status(b"k") is LeaseStatus.LEASED_REMOTE and leases_held(b) == 1
    a.node.kill()
    # B drops A's silent peer session, and the lease with it: its slots are evictable again.
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B ended the dead target's lease")
    st = b.stats()
    assert st["leases"]["ended_with_session"] >= 1 and st["claims"]["total"] == 0
    assert_site_clean(b)


def test_a_source_below_version_4_answers_advisory(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"args": ("--protocol-version", "3")}))
    b.deposit(b"k", LAYOUT, seed=9)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert lease.status(b"k") is LeaseStatus.ADVISORY and lease.id == 0 and lease.held == frozenset()
    assert leases_held(b) == 0 and leases_held(a) == 0
    assert_site_clean(a)
    assert_site_clean(b)


def test_an_unreachable_source_answers_unreachable(sites: Sites) -> None:
    (a,) = sites.start("a")
    a.deposit(b"local", LAYOUT, seed=10)
    a.client.submit_hint("r", "tcp://127.0.0.1:1", [b"far"]).result(RESULT_TIMEOUT_S)
    lease = a.client.lease([b"far", b"local"], request_id="r").result(RESULT_TIMEOUT_S)
    assert [lease.status(k) for k in (b"far", b"local")] == [LeaseStatus.UNREACHABLE, LeaseStatus.LEASED]
    lease.release().result(RESULT_TIMEOUT_S)
    assert_site_clean(a, expect_peers_idle=False)
