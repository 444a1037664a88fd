"""Many spellings of one source, churned (spec section 5.3, "Twin links"), with real nodes.

A unix socket can be reached through any number of symbolic links, so a source has as many
spellings as anyone cares to make: hints are client input, and an operator's config can
name one source twice. Node A is hinted one of B's keys under a dozen spellings of B's
socket, round after round, with A's ``max_peers`` at 4. Every spelling opens a link that B
proves a twin of A's first, and A folds it: every delivery arrives byte for byte, A keeps
one link with at most ``max_peers`` aliases (an alias dropped to make room is folded again
the next time it is used), nothing is left draining, B holds one peer session, and A's
tables and both nodes' descriptors, threads and RSS are back within a bound after every round.
"""

from __future__ import annotations

import os
from typing import Any

from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import short_ipc_dir
from kvcr_testing.remote import Site, Sites, assert_site_clean, deliver_checked, poll_stats

LAYOUT = plain_layout(4)
MAX_PEERS = 4
SPELLINGS = 12
"""Symbolic links to B's socket, besides its own path: three times A's alias bound."""
ROUNDS = 5
SETTLE_S = 20.0
"""How long A may take to retire a folded link once its deliveries ended."""
FD_SLACK = 8
THREAD_SLACK = 2
RSS_GROWTH_KIB = 16384


def footprint(site: Site) -> tuple[int, int, int]:
    pid = site.node.proc.pid
    return fd_count(pid), thread_count(pid), rss_kib(pid)


def settled(a: Site, b: Site) -> dict[str, Any]:
    """A holds one link to B, its aliases within the bound and nothing draining; B one peer session."""
    st = poll_stats(a, lambda s: s["tables"]["links"] == 1 and s["tables"]["links_draining"] == 0,
                    SETTLE_S, "A folded every twin link into one")
    assert st["tables"]["link_aliases"] <= MAX_PEERS, st["tables"]
    poll_stats(b, lambda s: s["peer_sessions"] == 1, SETTLE_S, "B holds one peer session for A")
    return st


def within(before: tuple[int, int, int], after: tuple[int, int, int], what: str) -> None:
    assert after[0] <= before[0] + FD_SLACK, (what, "descriptors", before, after)
    assert after[1] <= before[1] + THREAD_SLACK, (what, "threads", before, after)
    assert after[2] <= before[2] + RSS_GROWTH_KIB, (what, "RSS KiB", before, after)


def test_a_dozen_spellings_of_one_source_churned_keep_one_link_and_every_bound(sites: Sites) -> None:
    a, b = sites.start(("a", {"args": ("--max-peers", str(MAX_PEERS), "--peer-idle-ms", "600000")}), "b")
    src = b.deposit(b"shared", LAYOUT, seed=5)
    socket_path = b.endpoint.removeprefix("ipc://")
    with short_ipc_dir("twins") as links:
        spellings = [b.endpoint]
        for i in range(SPELLINGS):
            os.symlink(socket_path, links / f"s{i}")
            spellings.append(f"ipc://{links}/s{i}")
        baseline: dict[str, tuple[int, int, int]] = {}
        tables: dict[str, int] = {}
        folded = 0
        for round_ in range(ROUNDS):
            for i, spelling in enumerate(spellings):
                rid = f"by-{i}"  # a hint per spelling, replaced each round
                a.client.submit_hint(rid, spelling, [b"shared"]).result(RESULT_TIMEOUT_S)
                deliver_checked(a, b"shared", LAYOUT, src, range(len(LAYOUT.spans)), seed=round_ * 100 + i,
                                request_id=rid)
            st = settled(a, b)
            counters = st["counters"]
            assert counters["links_folded"] > folded, "each round opens and folds links again"
            folded = counters["links_folded"]
            assert counters["links_folded"] <= (round_ + 1) * SPELLINGS, counters
            if round_ == 0:
                baseline = {"a": footprint(a), "b": footprint(b)}
                tables = st["tables"]
            else:
                grown = {k: (tables.get(k, 0), v) for k, v in st["tables"].items() if v > tables.get(k, 0)}
                assert not grown, (f"A's tables after round {round_}", grown)
                within(baseline["a"], footprint(a), f"A after round {round_}")
                within(baseline["b"], footprint(b), f"B after round {round_}")
        assert_site_clean(a)
        assert_site_clean(b)
