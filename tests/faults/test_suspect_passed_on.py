"""Reports of keys read from a source's pools, passed on by the target (spec section 6.12,
"Integrity"; section 5.3), under a flood, with real nodes.

A's client holds read leases of B's objects with B's grant (B trusts A's clients:
``peer_grants``). It floods A with reports: the granted keys, intact, hundreds of times;
keys B holds that this client never leased (another client's); keys nobody stored. A passes
on only the keys this session's leases hold with B's grant, at most 16 waiting on B at once
(more answer ``BUSY``), B reads within its own budget, nothing is dropped, and every table
at A is back where it began, both nodes' descriptors, threads and RSS within a bound; A goes
on serving B's objects byte for byte throughout.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvcr_client import ErrorCode, KeyStatus, LeaseStatus, Span
from kvcr_node.suspects import BANKED_S, SESSION_SHARE
from kvcr_protocol import Completion, Suspect
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.patterns import KiB
from kvcr_testing.remote import Sites, deliver_checked, poll_stats

LAYOUT = plain_layout(4)
SPAN = 64 * KiB
RATE = 4 << 20
"""B's ``suspect_bytes_per_s``: A's peer session may read 1 MiB/s of it, four objects a second."""
REPORTS = 300
SLACK_S = 10.0
FD_SLACK = 8
THREAD_SLACK = 2
RSS_GROWTH_KIB = 16384


@pytest.mark.slow
def test_a_report_flood_through_a_target_reaches_its_source_bounded_and_drops_nothing(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"args": ("--peer-grants", "--suspect-bytes-per-s", str(RATE))}))
    objects = {key: b.deposit(key, LAYOUT, seed=40 + i) for i, key in enumerate((b"g0", b"g1", b"other"))}
    a.client.submit_hint("r", b.endpoint, [b"g0", b"g1", b"other"]).result(RESULT_TIMEOUT_S)
    lease = a.client.lease([b"g0", b"g1"], request_id="r").result(RESULT_TIMEOUT_S)
    assert all(lease.status(k) is LeaseStatus.LEASED_REMOTE for k in (b"g0", b"g1"))
    # Warm: A has announced its client to B for node-driven writes (the tables it keeps for that).
    deliver_checked(a, b"other", LAYOUT, objects[b"other"], range(len(LAYOUT.spans)), seed=1, request_id="r")
    base = a.stats()["tables"]
    footprint = {site: (fd_count(site.node.proc.pid), thread_count(site.node.proc.pid), rss_kib(site.node.proc.pid))
                 for site in (a, b)}
    hostile = [
        (b"g0", b"g1"),  # granted to this session by B, intact: passed on
        (b"g0",) * 512,  # one key, many times: passed on once per report
        (b"other",),  # B holds it, this session never leased it: not passed on
        tuple(b"absent%d" % i for i in range(32)),  # nobody stored them
    ]
    started = time.monotonic()
    futures: list[Future[Any]] = []
    for i in range(REPORTS):
        named = hostile[i % len(hostile)]
        _, fut = a.client.core.request(lambda rid, named=named: Suspect(rid, named), lambda m: m, RESULT_TIMEOUT_S)
        futures.append(fut)
    answers: dict[str, int] = {}
    for i, fut in enumerate(futures):
        reply = a.client.core.wait(fut, RESULT_TIMEOUT_S)
        assert isinstance(reply, Completion), reply
        named = hostile[i % len(hostile)]
        for key, r in zip(named, reply.results, strict=True):
            if key in (b"g0", b"g1"):
                assert r.status is KeyStatus.OK or r.code == ErrorCode.BUSY, r
            else:
                assert r.code == ErrorCode.NOT_FOUND, (key, r)
            name = "ok" if r.status is KeyStatus.OK else ErrorCode(r.code).name
            answers[name] = answers.get(name, 0) + 1
        if i % 50 == 0:  # A goes on serving B's objects meanwhile (node-driven: not leased)
            deliver_checked(a, b"other", LAYOUT, objects[b"other"], range(len(LAYOUT.spans)), seed=i, request_id="r")
    elapsed = time.monotonic() - started
    assert answers.get("ok", 0) > 0 and answers.get("BUSY", 0) > 0 and answers.get("NOT_FOUND", 0) > 0, answers
    counters_a, counters_b = a.stats()["counters"], b.stats()["counters"]
    # Only the granted keys went on, at most 16 at a time, once per report.
    assert counters_a["suspects_passed_on"] <= REPORTS // 2, counters_a
    # B read within what A's peer session may: its share of B's rate, a second banked.
    read = counters_b.get("suspects_unfounded", 0) * LAYOUT.nbytes
    assert read <= RATE * SESSION_SHARE * (BANKED_S + elapsed) + LAYOUT.nbytes, (read, elapsed)
    assert counters_b.get("suspects_confirmed", 0) == 0 and counters_b.get("objects_condemned", 0) == 0
    assert counters_a["suspects_refused"] > 0, "reports past PASSED_ON_PER_SESSION answer BUSY"
    # The leased objects still read whole and right, and A's tables are where they began.
    for key in (b"g0", b"g1"):
        dst = np.zeros(LAYOUT.nbytes, np.uint8)
        region = a.reg(dst)
        spans = [Span(name, region, j * SPAN, SPAN) for j, name in enumerate(LAYOUT.names)]
        res = a.client.deliver({key: spans}, request_id="r").result(RESULT_TIMEOUT_S)
        assert res[key].status is KeyStatus.OK and np.array_equal(dst, objects[key]), res
    poll_stats(a, lambda st: st["tables"]["suspects_at_sources"] == 0 and st["tables"] == base, SLACK_S,
               "A's tables back where they began")
    for site, (fds, threads, rss) in footprint.items():  # both nodes: the target and the flooded source
        pid = site.node.proc.pid
        assert fd_count(pid) <= fds + FD_SLACK and thread_count(pid) <= threads + THREAD_SLACK, site.endpoint
        assert rss_kib(pid) <= rss + RSS_GROWTH_KIB, (site.endpoint, rss, rss_kib(pid))
    lease.release().result(RESULT_TIMEOUT_S)
    poll_stats(b, lambda st: st["leases"]["held"] == 0, SLACK_S, "B let go of the leases")
