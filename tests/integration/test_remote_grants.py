"""Read grants across real node processes (spec section 6.12, "Across nodes").

The client talks to node A; node B holds the objects, named to A by the client's hint. A
read lease of them is held at B through A's peer session, and B's grant (its slots and,
once, its agent) reaches the client through A: ``deliver`` then READs from B's pools with
the client's own agent, whole, as a subset and with a layer plan, byte for byte, and
neither node posts a transfer. Only a source whose operator turned ``peer_grants`` on
grants targets' clients; by default, below version 5, or with ``client_transfers`` off, a
source grants nothing, and the keys travel node-driven as before. A read is never returned as
valid when B's lease may not have held: B killed before the READ, or between the groups
of a planned read, fails it, a slot B reused
after the lease expired is detected, and a late reader is confirmed by a renew that A
answers only with B's word. After each test neither node holds a lease, grant or claim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvcr_client import Client, ErrorCode, KeyStatus, LeaseStatus, Span
from kvcr_client.grants import MARGIN_FRACTION, MARGIN_S
from kvcr_testing.forge import forge
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.nodes import start_node
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.remote import POOLS, Site, Sites, assert_site_clean, poll_stats

LAYOUT = plain_layout(4)
SPAN = 64 * KiB
SLACK_S = 5.0
FAILED_READ = {ErrorCode.TRANSFER_FAILED, ErrorCode.LEASE_LOST, ErrorCode.LEASE_EXPIRED, ErrorCode.PEER_RESTARTED,
               ErrorCode.PEER_UNREACHABLE}
"""What a read whose source went away may fail with (spec section 6.12): never OK."""


SOURCE = ("b", {"args": ("--peer-grants",)})
"""The source of these tests: it trusts the targets' clients with its pools' registrations."""


def hint(a: Site, b: Site, keys: list[bytes], request_id: str = "r") -> str:
    a.client.submit_hint(request_id, b.endpoint, keys).result(RESULT_TIMEOUT_S)
    return request_id


def posted(site: Site) -> int:
    return int(site.stats()["transfers"]["posted"])


def spans_into(site: Site, buf: np.ndarray, names: list[str] | None = None) -> list[Span]:
    region = site.reg(buf)
    return [Span(name, region, i * SPAN, SPAN) for i, name in enumerate(names or LAYOUT.names)]


def set_hook(client: Client, fn: Callable[[str], Any] | None) -> None:
    client._grants.gate = fn


def no_grants_left(*sites: Site) -> None:
    """Every node is back where it started: no lease, no grant outstanding."""
    for site in sites:
        poll_stats(site, lambda st: st["leases"]["held"] == 0 and st["leases"]["with_grants"] == 0, SLACK_S,
                   f"{site.endpoint} let go of every lease and grant")


def test_a_remote_read_lease_reads_from_the_source_directly(sites: Sites) -> None:
    a, b = sites.start("a", SOURCE)
    here = a.deposit(b"here", LAYOUT, seed=1)
    srcs = {k: b.deposit(k, LAYOUT, seed=2 + i) for i, k in enumerate([b"k0", b"k1"])}
    rid = hint(a, b, [b"k0", b"k1"])
    lease = a.client.lease([b"k0", b"k1", b"here", b"k0"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert [lease.status(k) for k in (b"k0", b"k1", b"here")] == [LeaseStatus.LEASED_REMOTE] * 2 + [LeaseStatus.LEASED]
    assert b.stats()["leases"]["with_grants"] == 1 and a.stats()["leases"]["with_grants"] == 1
    assert a.stats()["tables"]["source_grant_agents"] == 1, "A's cache of its sources' agents is in its tables"
    view = a.client.grants()
    assert all(view.keys[k].digests for k in srcs), "B's digests came through A with its rows"
    assert len(view.sources) == 1 and view.node_agent is not None
    assert view.keys[b"k0"].agent != view.node_agent and view.keys[b"here"].agent == view.node_agent
    before = (posted(a), posted(b))
    reads = a.client.counters()["grant_reads"]

    # Whole objects, one at the source and one local, in one deliver.
    dst = {k: np.zeros(LAYOUT.nbytes, np.uint8) for k in (b"k0", b"here")}
    res = a.client.deliver({k: spans_into(a, buf) for k, buf in dst.items()}, request_id=rid).result(RESULT_TIMEOUT_S)
    assert res.all_ok, res
    assert np.array_equal(dst[b"k0"], srcs[b"k0"]) and np.array_equal(dst[b"here"], here)

    # An ordered subset, into other places.
    sub = np.zeros(LAYOUT.nbytes, np.uint8)
    region = a.reg(sub)
    res = a.client.deliver({b"k1": [Span("L1", region, 0, SPAN), Span("L3", region, 2 * SPAN, SPAN)]}).result(RESULT_TIMEOUT_S)
    assert res[b"k1"].ok, res
    assert np.array_equal(sub[:SPAN], srcs[b"k1"][SPAN:2 * SPAN]) and np.array_equal(sub[2 * SPAN:3 * SPAN], srcs[b"k1"][3 * SPAN:])
    assert not sub[SPAN:2 * SPAN].any() and not sub[3 * SPAN:].any()

    # A layer plan: one group per layer, each reported delivered.
    planned = np.zeros(LAYOUT.nbytes, np.uint8)
    handle = a.client.deliver({b"k1": spans_into(a, planned)}, plan=[[n] for n in LAYOUT.names])
    for g in range(len(LAYOUT.names)):
        handle.wait(g, RESULT_TIMEOUT_S)
    assert handle.result(RESULT_TIMEOUT_S)[b"k1"].ok
    assert np.array_equal(planned, srcs[b"k1"])

    assert a.client.counters()["grant_reads"] == reads + 3
    assert (posted(a), posted(b)) == before, "a node posted a transfer for a granted deliver"
    # A second lease of the same source: its agent is cached, not sent again.
    again = a.client.lease([b"k0"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert again.status(b"k0") is LeaseStatus.LEASED_REMOTE and len(a.client.grants().sources) == 1
    for handle_ in (lease, again):
        handle_.release().result(RESULT_TIMEOUT_S)
    no_grants_left(a, b)
    b.resident.update({k: ("kv",) * 4 for k in srcs})
    assert_site_clean(a)
    assert_site_clean(b)


def node_driven(a: Site, b: Site) -> None:
    src = b.deposit(b"k", LAYOUT, seed=5)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert lease.status(b"k") is LeaseStatus.LEASED_REMOTE
    assert b"k" not in a.client.grants().keys
    before, reads = posted(b), a.client.counters()["grant_reads"]
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    res = a.client.deliver({b"k": spans_into(a, dst)}, request_id=rid).result(RESULT_TIMEOUT_S)
    assert res[b"k"].ok and np.array_equal(dst, src)
    assert a.client.counters()["grant_reads"] == reads and posted(b) > before, "the source did not write it"
    lease.release().result(RESULT_TIMEOUT_S)
    no_grants_left(a, b)
    b.resident[b"k"] = ("kv",) * 4


def test_a_source_with_client_transfers_off_leaves_the_node_driven_path(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"args": ("--peer-grants", "--no-client-transfers")}))
    node_driven(a, b)


def test_by_default_a_source_grants_no_targets_clients(sites: Sites) -> None:
    # A source never gives its pools' registrations (READ and WRITE of every slot) to
    # clients it never authenticated unless its operator says so (spec section 14).
    a, b = sites.start("a", "b")
    node_driven(a, b)
    assert b.stats()["leases"]["with_grants"] == 0


def test_a_source_below_version_5_leaves_the_node_driven_path(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"args": ("--peer-grants", "--protocol-version", "4")}))
    node_driven(a, b)


def test_a_source_killed_before_the_read_never_returns_bytes(sites: Sites) -> None:
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", "500")}))
    b = sites("b", "--peer-grants")
    src = b.deposit(b"k", LAYOUT, seed=6)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert b"k" in a.client.grants().keys
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    spans = spans_into(a, dst)

    def kill(stage: str) -> None:
        if stage == "posting 0":
            b.node.kill()  # gone between the grant and the READ: its pools with it

    set_hook(a.client, kill)
    try:
        res = a.client.deliver({b"k": spans}, deadline_ms=5000).result(RESULT_TIMEOUT_S)
    finally:
        set_hook(a.client, None)
    assert res[b"k"].status is KeyStatus.FAILED and res[b"k"].code in FAILED_READ, res
    assert not np.array_equal(dst, src)
    # A learns the source is gone; the lease loses the key and ends.
    assert wait_until(lambda: a.client.stats().result(RESULT_TIMEOUT_S) is not None and lease.ended is not None, SLACK_S)
    poll_stats(a, lambda st: st["leases"]["held"] == 0 and st["leases"]["with_grants"] == 0, SLACK_S, "A ended the lease")
    assert_site_clean(a, expect_peers_idle=False)


def test_a_slot_the_source_reused_after_expiry_is_detected(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"pools": ("--pool", "kv:64KiB:4"), "args": ("--peer-grants", "--policy", "fifo", "--lease-pool-fraction", "1",
                                                                                "--lease-session-fraction", "1")}))
    old = b.deposit(b"old", LAYOUT, seed=7)
    rid = hint(a, b, [b"old"])
    lease = a.client.lease([b"old"], request_id=rid, ttl_ms=300).result(RESULT_TIMEOUT_S)
    assert b"old" in a.client.grants().keys
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    spans = spans_into(a, dst)
    fresh: list[np.ndarray] = []

    def reuse(stage: str) -> None:
        if stage != "posting 0":
            return
        # The reader stalls between the grant and its READ; meanwhile the lease expires at
        # both nodes, B evicts the object and refills its slots with another object's bytes.
        poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B's lease ended with A's")
        fresh.append(b.deposit(b"new", LAYOUT, seed=8))

    set_hook(a.client, reuse)
    try:
        res = a.client.deliver({b"old": spans}).result(RESULT_TIMEOUT_S)
    finally:
        set_hook(a.client, None)
    assert res[b"old"].status is KeyStatus.FAILED and res[b"old"].code is ErrorCode.LEASE_EXPIRED, res
    assert not np.array_equal(dst, old), "the slots were not reused: the test shows nothing"
    assert sorted(dst.reshape(4, -1).tobytes()[i * SPAN:(i + 1) * SPAN] for i in range(4)) == \
        sorted(fresh[0].reshape(4, -1).tobytes()[i * SPAN:(i + 1) * SPAN] for i in range(4))
    assert lease.ended is ErrorCode.LEASE_EXPIRED
    no_grants_left(a, b)
    b.resident[b"new"] = ("kv",) * 4
    assert_site_clean(a)
    assert_site_clean(b)


def test_a_restarted_sources_old_agents_are_let_go(sites: Sites, ipc_dir: Path) -> None:
    """A source restarted on its endpoint: its keys are granted again from the new
    incarnation, byte for byte, and the client keeps one agent for it, not one per
    incarnation (which at MAX_SOURCES would stop grants across nodes)."""
    (a,) = sites.start("a")
    endpoint = f"ipc://{ipc_dir}/src.sock"
    for restart in range(4):
        source = start_node(endpoint, *POOLS, "--peer-grants")
        try:
            k = f"k{restart}".encode()
            src = pattern(LAYOUT.nbytes, 40 + restart)
            with Client(endpoint, name="itest-src-writer") as writer:
                region = writer.register(src)
                spans = [Span(name, region, i * SPAN, SPAN, "kv") for i, name in enumerate(LAYOUT.names)]
                assert writer.deposit({k: spans}).result(RESULT_TIMEOUT_S).all_ok
                rid = f"r{restart}"
                a.client.submit_hint(rid, endpoint, [k]).result(RESULT_TIMEOUT_S)
                lease = a.client.lease([k], request_id=rid).result(RESULT_TIMEOUT_S)
                assert lease.status(k) is LeaseStatus.LEASED_REMOTE and k in a.client.grants().keys
                dst = np.zeros(LAYOUT.nbytes, np.uint8)
                res = a.client.deliver({k: spans_into(a, dst)}, request_id=rid).result(RESULT_TIMEOUT_S)
                assert res[k].ok and np.array_equal(dst, src)
                lease.release().result(RESULT_TIMEOUT_S)
                writer.unregister(region)
            view = a.client.grants()
            assert len(view.sources) == 1, view.sources
            assert view.stale_agents <= 1, "older incarnations' agents were let go"
        finally:
            source.stop()
    poll_stats(a, lambda st: st["leases"]["held"] == 0, SLACK_S, "A let go of every lease")


def test_a_source_slot_overwritten_under_a_grant_fails_digest_mismatch_across_nodes(sites: Sites) -> None:
    """A client of B overwrites B's object through its read grant; A's client, reading it from
    B under the grant A passed on, checks it against B's digests and never gets OK. Its report
    goes to A, which passes it on to B: B reads the object itself and drops it (before, A
    answered NOT_FOUND and B kept serving the forged bytes to anyone who did not check)."""
    a, b = sites.start("a", SOURCE)
    src = b.deposit(b"k", LAYOUT, seed=12)
    forged = pattern(SPAN, 77)
    forge(b.endpoint, b"k", 2, forged)
    rid = hint(a, b, [b"k"])
    lease = a.client.lease([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)
    assert lease.status(b"k") is LeaseStatus.LEASED_REMOTE and a.client.grants().keys[b"k"].digests
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    res = a.client.deliver({b"k": spans_into(a, dst)}, request_id=rid).result(RESULT_TIMEOUT_S)
    assert res[b"k"].status is KeyStatus.FAILED and res[b"k"].code is ErrorCode.DIGEST_MISMATCH, res
    assert np.array_equal(dst[2 * SPAN:3 * SPAN], forged) and np.array_equal(dst[:SPAN], src[:SPAN])
    poll_stats(b, lambda st: st["counters"].get("suspects_confirmed", 0) == 1, SLACK_S, "B dropped the changed object")
    assert a.stats()["counters"]["suspects_passed_on"] == 1
    assert wait_until(lambda: a.stats() is not None and a.client.counters()["suspects_dropped"] == 1, SLACK_S), "the reader heard that B dropped it"
    assert b.client.query([b"k"]).result(RESULT_TIMEOUT_S)[b"k"].presence.name == "MISS"
    lease.release().result(RESULT_TIMEOUT_S)
    no_grants_left(a, b)
    poll_stats(b, lambda st: st["condemned"] == 0, SLACK_S, "B freed the dropped object's slots")


def test_a_late_remote_reader_is_confirmed_with_the_sources_word(sites: Sites) -> None:
    a, b = sites.start("a", SOURCE)
    src = b.deposit(b"k", LAYOUT, seed=9)
    rid = hint(a, b, [b"k"])
    # Long enough that the renew sent past the trusted part reaches the source well before the
    # lease ends there (the margin, half a second here): at 1 s it had 155 ms, which a loaded
    # machine once missed (LEASE_EXPIRED).
    ttl_ms = 4000
    lease = a.client.lease([b"k"], request_id=rid, ttl_ms=ttl_ms).result(RESULT_TIMEOUT_S)
    trusted = ttl_ms / 1000 - (MARGIN_S + ttl_ms / 1000 * MARGIN_FRACTION)
    asked = lease.expires_at - ttl_ms / 1000
    renewed = b.stats()["leases"].get("renewed", 0)
    confirmed = a.client.counters()["grant_confirms"]
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    spans = spans_into(a, dst)
    set_hook(a.client, lambda stage: time.sleep(max(0.0, asked + trusted + 0.02 - time.monotonic())) if stage == "posted 0" else None)
    try:
        res = a.client.deliver({b"k": spans}).result(RESULT_TIMEOUT_S)
    finally:
        set_hook(a.client, None)
    assert res[b"k"].ok, res
    assert np.array_equal(dst, src)
    assert a.client.counters()["grant_confirms"] == confirmed + 1
    assert b.stats()["leases"].get("renewed", 0) == renewed + 1, "A said !held without asking the source"
    lease.release().result(RESULT_TIMEOUT_S)
    no_grants_left(a, b)
    b.resident[b"k"] = ("kv",) * 4
    assert_site_clean(a)
    assert_site_clean(b)


def test_a_source_killed_between_groups_fails_the_rest_of_the_read(sites: Sites) -> None:
    (a,) = sites.start(("a", {"args": ("--peer-dead-ms", "500")}))
    b = sites("b", "--peer-grants")
    src = b.deposit(b"k", LAYOUT, seed=10)
    rid = hint(a, b, [b"k"])
    a.client.lease([b"k"], request_id=rid, ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    dst = np.zeros(LAYOUT.nbytes, np.uint8)
    spans = spans_into(a, dst)

    def kill(stage: str) -> None:
        if stage == "posting 2":
            b.node.kill()  # groups 0 and 1 were read; the source goes before group 2 is posted

    set_hook(a.client, kill)
    try:
        handle = a.client.deliver({b"k": spans}, plan=[[n] for n in LAYOUT.names], deadline_ms=5000)
        res = handle.result(RESULT_TIMEOUT_S)
    finally:
        set_hook(a.client, None)
    assert not b.alive
    assert res[b"k"].status is KeyStatus.FAILED and res[b"k"].code in FAILED_READ, res
    assert np.array_equal(dst[:2 * SPAN], src[:2 * SPAN]), "the groups read before the kill landed"
    poll_stats(a, lambda st: st["leases"]["held"] == 0 and st["leases"]["with_grants"] == 0, SLACK_S, "A ended the lease")
    assert_site_clean(a, expect_peers_idle=False)
