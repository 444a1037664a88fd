"""Peer churn: links, probes and announced clients must not grow without bound (issue #10,
defects 2 and 9).

- Links to sources close once they have no work and have not been used for
  ``--peer-idle-ms``; at most ``--max-peers`` exist at once: a request that needs one more
  closes the least recently used idle link, or fails ``PEER_LIMIT`` when every link is busy.
- A write that stays uncertain is probed again and again; only its latest probe is kept,
  and none once the write ends.
- The target forgets which clients it announced to a peer when their sessions close; the
  source keeps at most ``--max-peer-clients`` announced clients per peer session (least
  recently used out, with their NIXL remote agents), and a write naming an evicted client
  is announced again and retried once; everything goes when the peer session closes.

Table sizes come from stats ``tables``, descriptors from /proc/PID/fd of the node process.
Every test ends with the surviving nodes clean (no claim, breach, pending operation or
outstanding write) and their tables back to a bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcr_client import ErrorCode
from kvcr_node.agents import DEPARTED_AGENTS
from kvcr_testing.health import counter, slot_accounting, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.measure import fd_count
from kvcr_testing.nodes import frozen
from kvcr_testing.remote import FAILED, OK, Dest, deliver_checked, expect, open_site, poll_stats

MAX_PEERS = 16
PEER_IDLE_MS = 300
ENDPOINTS = 200
CHURN_DEADLINE_MS = 100
BUSY_DEADLINE_MS = 800
FD_SLACK = 10
"""Descriptors the node may hold above its baseline once every link is closed."""
SETTLE_S = 5.0
LAYOUT = plain_layout(2)


def tables(site: Any) -> dict[str, int]:
    return dict(site.stats()["tables"])


def held_agents(st: dict[str, Any]) -> int:
    """Remote agents a node holds for a session, link or announced client (not those of
    ended sessions it keeps loaded, a bounded LRU)."""
    t = st["tables"]
    return int(t["remote_agents"] - t["remote_agents_departed"])


def hint(site: Any, rid: str, endpoint: str, keys: list[bytes]) -> None:
    site.client.submit_hint(rid, endpoint, keys).result(RESULT_TIMEOUT_S)


# --------------------------------------------------------------------------- links (defect 2)


def test_links_are_capped_and_close_when_idle(sites: Any) -> None:
    """Hundreds of distinct unreachable sources: never more than max_peers links, PEER_LIMIT
    while all are busy, and every link (with its descriptors) gone after peer_idle_ms."""
    (a,) = sites.start(("a", {"args": ("--max-peers", str(MAX_PEERS), "--peer-idle-ms", str(PEER_IDLE_MS))}))
    here = Path(a.endpoint.removeprefix("ipc://")).parent
    dests = [Dest(a, LAYOUT, range(2), seed=10 + i) for i in range(MAX_PEERS + 1)]
    fds_before = fd_count(a.node.proc.pid)
    slots_before = slot_accounting(a.stats())

    # Every link busy with a queued write: one more source is refused, nothing set aside.
    for i in range(MAX_PEERS + 1):
        hint(a, f"busy{i}", f"ipc://{here}/busy{i}.sock", [b"k"])
    busy = [a.client.deliver({b"k": dests[i].spans}, request_id=f"busy{i}", deadline_ms=BUSY_DEADLINE_MS)
            for i in range(MAX_PEERS)]
    refused = a.client.deliver({b"k": dests[MAX_PEERS].spans}, request_id=f"busy{MAX_PEERS}",
                               deadline_ms=BUSY_DEADLINE_MS).result(RESULT_TIMEOUT_S)[b"k"]
    expect(refused, FAILED, ErrorCode.PEER_LIMIT)
    assert "max_peers" in refused.reason and str(MAX_PEERS) in refused.reason, refused
    fetched = a.client.fetch({b"k": [(n, "kv") for n in LAYOUT.names]}, request_id=f"busy{MAX_PEERS}",
                             deadline_ms=BUSY_DEADLINE_MS).result(RESULT_TIMEOUT_S)[b"k"]
    expect(fetched, FAILED, ErrorCode.PEER_LIMIT)
    assert a.stats()["writing"] == 0
    for handle in busy:
        expect(handle.result(BUSY_DEADLINE_MS / 1000 + RESULT_TIMEOUT_S)[b"k"], FAILED, ErrorCode.PEER_UNREACHABLE)
    for i in range(MAX_PEERS + 1):
        a.client.discard_hint(f"busy{i}").result(RESULT_TIMEOUT_S)

    # Churn: each batch needs MAX_PEERS new links; idle ones make room (least recently used first).
    peak_links = peak_fds = 0
    for start in range(0, ENDPOINTS, MAX_PEERS):
        rids = [f"e{n}" for n in range(start, min(start + MAX_PEERS, ENDPOINTS))]
        hints = [a.client.submit_hint(rid, f"ipc://{here}/{rid}.sock", [b"k"]) for rid in rids]
        for h in hints:
            h.result(RESULT_TIMEOUT_S)
        handles = [a.client.deliver({b"k": dests[j].spans}, request_id=rid, deadline_ms=CHURN_DEADLINE_MS)
                   for j, rid in enumerate(rids)]
        for handle in handles:
            expect(handle.result(RESULT_TIMEOUT_S)[b"k"], FAILED, ErrorCode.PEER_UNREACHABLE)
        for h in [a.client.discard_hint(rid) for rid in rids]:
            h.result(RESULT_TIMEOUT_S)
        t = tables(a)
        peak_links = max(peak_links, t["links"])
        peak_fds = max(peak_fds, fd_count(a.node.proc.pid))
        assert t["links"] <= MAX_PEERS and t["link_sockets"] <= 2 * MAX_PEERS, t

    st = poll_stats(a, lambda st: st["tables"]["links"] == 0, SETTLE_S, "every idle link closed")
    settled = wait_until(lambda: fd_count(a.node.proc.pid) <= fds_before + FD_SLACK, SETTLE_S, 0.05)
    print(f"links peak {peak_links}; node fds {fds_before} -> peak {peak_fds} -> {fd_count(a.node.proc.pid)}")
    assert settled, (fds_before, fd_count(a.node.proc.pid))
    assert st["tables"]["link_sockets"] == 0 and st["peers"] == {}, st["tables"]
    assert counter(st, "links_closed_idle") > 0 and counter(st, "links_evicted") > 0, st["counters"]
    assert counter(st, "internal_errors") == 0, st["counters"]
    for dst in dests:
        dst.assert_untouched()
    assert slot_accounting(st) == slots_before
    assert a.alive


def test_remote_deliver_after_the_link_closed_idle(sites: Any) -> None:
    """A link closed for idleness says bye (the source forgets the peer session and its
    clients' agents) and is opened again, byte-exact, by the next remote deliver."""
    a, b = sites.start(("a", {"args": ("--peer-idle-ms", str(PEER_IDLE_MS))}), "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    b_agents = held_agents(b.stats())
    hint(a, "r", b.endpoint, [b"k"])
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=2, request_id="r")
    assert tables(b)["peer_clients"] == 1
    st = poll_stats(a, lambda st: st["tables"]["links"] == 0, SETTLE_S, "the idle link closed")
    assert counter(st, "links_closed_idle") == 1, st["counters"]
    poll_stats(b, lambda st: st["peer_sessions"] == 0 and st["tables"]["peer_clients"] == 0
               and held_agents(st) == b_agents, SETTLE_S, "B forgot the peer session at bye")
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=3, request_id="r")
    deliver_checked(a, b"k", LAYOUT, src, [1], seed=4, request_id="r", partial=True)
    assert tables(a)["links"] == 1


# --------------------------------------------------------------------------- probes (defect 9)


def test_probe_records_stay_bounded(sites: Any) -> None:
    """An uncertain write against a frozen source is probed about four times a second; the
    target keeps only the latest probe, and none once the write is over."""
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}), "b")
    src = b.deposit(b"k", LAYOUT, seed=5)
    hint(a, "r", b.endpoint, [b"k"])
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=6, request_id="r")
    with frozen(b.node):
        dst = Dest(a, LAYOUT, range(2), seed=7)
        out = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=300).result(RESULT_TIMEOUT_S)[b"k"]
        expect(out, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        seen: list[int] = []

        def probed_enough() -> bool:
            st = a.stats()
            seen.append(st["tables"]["probes"])
            return counter(st, "probes_sent") >= 8

        assert wait_until(probed_enough, SETTLE_S, 0.1)
        assert max(seen) <= 1, seen
    st = poll_stats(a, lambda st: counter(st, "uncertain_resolved") == 1, SETTLE_S, "the late answer resolved the write")
    assert st["tables"]["probes"] == 0, st["tables"]
    if (dst.buf == dst.before).all():
        dst.assert_untouched()
    else:
        dst.assert_delivered(src)


# --------------------------------------------------------------------------- announced clients (defect 9)


def test_announced_client_tables_are_bounded(sites: Any) -> None:
    """Many clients deliver across two nodes: the target forgets each at its bye, the source
    keeps at most max_peer_clients (LRU), an evicted client is announced again and its
    write retried once, and closing the peer session releases every agent."""
    a, b = sites.start(("a", {"args": ("--peer-idle-ms", "500")}), ("b", {"args": ("--max-peer-clients", "2")}))
    src = b.deposit(b"k", LAYOUT, seed=8)
    b_agents = held_agents(b.stats())

    def deliver_from(site: Any, seed: int) -> None:
        hint(site, "r", b.endpoint, [b"k"])
        deliver_checked(site, b"k", LAYOUT, src, range(2), seed=seed, request_id="r")

    extra = [open_site(a.node, f"c{i}") for i in range(3)]
    try:
        # Registered once: a client whose regions change is announced again anyway.
        dests = [Dest(site, LAYOUT, range(2), seed=20 + i) for i, site in enumerate(extra)]
        for site, dst in zip(extra, dests, strict=True):  # the third evicts the first at B
            hint(site, "r", b.endpoint, [b"k"])
            out = site.client.deliver({b"k": dst.spans}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
            expect(out, OK)
            dst.assert_delivered(src)
        st = b.stats()
        assert st["tables"]["peer_clients"] == 2 and counter(st, "peer_clients_evicted") == 1, (st["tables"], st["counters"])
        # The first client again, same regions: B refuses the unknown agent, A announces it again and retries.
        dests[0].buf[:] = dests[0].before
        out = extra[0].client.deliver({b"k": dests[0].spans}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
        expect(out, OK)
        dests[0].assert_delivered(src)
        assert counter(a.stats(), "writes_retried") == 1
        assert tables(a)["clients_sent"] == 3
    finally:
        for site in extra:
            site.close()
    poll_stats(a, lambda st: st["tables"]["clients_sent"] == 0, SETTLE_S, "A forgot the closed clients")

    for i in range(12):
        site = open_site(a.node, f"d{i}")
        try:
            deliver_from(site, 40 + i)
        finally:
            site.close()
        st = b.stats()
        assert st["tables"]["peer_clients"] <= 2 and held_agents(st) <= b_agents + 1 + 2, st["tables"]
    st = poll_stats(a, lambda st: st["tables"]["clients_sent"] == 0 and st["tables"]["links"] == 0, SETTLE_S,
                    "A forgot its clients and closed the idle link")
    assert st["tables"]["probes"] == 0 and st["tables"]["announcing"] == 0, st["tables"]
    st = poll_stats(b, lambda st: st["peer_sessions"] == 0 and st["tables"]["peer_clients"] == 0
                    and held_agents(st) == b_agents, SETTLE_S, "B released everything of the peer session")
    assert st["tables"]["remote_agents_departed"] <= DEPARTED_AGENTS, st["tables"]
