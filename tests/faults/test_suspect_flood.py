"""A client flooding integrity reports (``suspect``, spec section 6.12) at a real node.

The flooder names another client's intact objects, keys nobody stored, and the same key
hundreds of times, thousands of reports in flight, over several reconnects. Nothing is
dropped (the node reads each object itself and finds it intact), the bytes it reads for
reports stay within ``suspect_bytes_per_s`` (the rest are answered ``BUSY`` with nothing
read), the innocent client is served throughout, and the node's threads, descriptors, RSS
and tables are back where they began.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, KeyStatus, Span
from kvcr_node.agents import DEPARTED_AGENTS
from kvcr_node.suspects import BANKED_S
from kvcr_protocol import Completion, ErrorCode, Suspect
from kvcr_testing.health import assert_clean, stats
from kvcr_testing.layouts import RESULT_TIMEOUT_S
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 64 * KiB
SPANS = 4
"""Spans of each of the innocent client's objects: 256 KiB read per check."""
RATE = 4 << 20
"""The node's ``suspect_bytes_per_s``: 16 checks a second, 4 of them one session's."""
RECONNECTS = 4
REPORTS = 500
"""Reports per flooder session, all sent before any answer is read."""
FD_SLACK = 10
THREAD_SLACK = 2
RSS_GROWTH_KIB = 8192


@pytest.mark.slow
def test_a_report_flood_drops_nothing_and_reads_within_its_budget() -> None:
    args = ("--pool", f"kv:{SLOT // KiB}KiB:64", "--suspect-bytes-per-s", str(RATE))
    with short_ipc_dir("suspects") as d, running_node(d, "n", *args) as node, \
            Client(node.endpoint, name="innocent") as innocent:
        keys = [b"keep%d" % i for i in range(8)]
        src = pattern(len(keys) * SPANS * SLOT, 7)
        region = innocent.register(src)
        spans = {k: [Span(f"L{j}", region, (i * SPANS + j) * SLOT, SLOT, "kv") for j in range(SPANS)]
                 for i, k in enumerate(keys)}
        assert innocent.deposit(spans).result(RESULT_TIMEOUT_S).all_ok
        base = stats(innocent)
        pid = node.proc.pid
        fds, threads, rss = fd_count(pid), thread_count(pid), rss_kib(pid)
        dst = np.zeros_like(src)
        out = innocent.register(dst)
        wanted = {k: [Span(f"L{j}", out, (i * SPANS + j) * SLOT, SLOT) for j in range(SPANS)] for i, k in enumerate(keys)}
        started = time.monotonic()
        answers: dict[str, int] = {}
        for session in range(RECONNECTS):
            if session == 1:
                # RSS from after the first flood: what the node allocates once (its first
                # remote agent's UCX state, the queue of a session's reports at its highest,
                # the allocator's arenas, more of them when the machine is loaded) is not a
                # leak; what every later session adds, beyond the agents it keeps, would be.
                rss = rss_kib(pid)
            with Client(node.endpoint, name="flooder") as flooder:
                hostile = [
                    tuple(keys),  # another client's objects, all intact
                    (keys[0],) * 512,  # one key, many times: read at most once per report
                    tuple(b"absent%d" % i for i in range(64)),  # nothing stored: nothing read
                ]
                futures: list[Future[Any]] = []
                for i in range(REPORTS):
                    named = hostile[i % len(hostile)]
                    _, fut = flooder.core.request(lambda rid, named=named: Suspect(rid, named), lambda m: m,
                                                  RESULT_TIMEOUT_S)
                    futures.append(fut)
                for fut in futures:
                    reply = flooder.core.wait(fut, RESULT_TIMEOUT_S)
                    assert isinstance(reply, Completion), reply
                    for r in reply.results:
                        assert r.status is KeyStatus.OK or r.code in (ErrorCode.BUSY, ErrorCode.NOT_FOUND), r
                        name = "ok" if r.status is KeyStatus.OK else ErrorCode(r.code).name
                        answers[name] = answers.get(name, 0) + 1
                # The innocent client is served between the flooder's sessions, every byte its own.
                dst[:] = 0
                res = innocent.deliver(wanted).result(RESULT_TIMEOUT_S)
                assert all(res[k].status is KeyStatus.OK for k in keys) and np.array_equal(dst, src), res
        elapsed = time.monotonic() - started
        st = stats(innocent)
        counters = st["counters"]
        assert counters.get("suspects_confirmed", 0) == 0 and counters.get("objects_condemned", 0) == 0
        assert answers.get("BUSY", 0) > 0 and answers.get("NOT_FOUND", 0) > 0 and answers.get("ok", 0) > 0, answers
        # What the node read for reports: within its budget, a second banked plus its rate.
        read = counters["suspects_unfounded"] * SPANS * SLOT
        assert read <= RATE * (BANKED_S + elapsed) + SPANS * SLOT, (read, elapsed)
        assert all(innocent.query(keys).result(RESULT_TIMEOUT_S)[k].presence.name == "HIT" for k in keys)
        assert st["invariants"] == []
        # Every table is back where it began, but the flooders' agents, which the node keeps
        # loaded in case they come back, up to its cap.
        agents = ("remote_agents", "remote_agents_departed")
        tables = st["tables"]
        assert {k: v for k, v in tables.items() if k not in agents} == {
            k: v for k, v in base["tables"].items() if k not in agents}, (tables, base["tables"])
        assert tables["remote_agents_departed"] <= DEPARTED_AGENTS
        assert fd_count(pid) <= fds + FD_SLACK and thread_count(pid) <= threads + THREAD_SLACK
        assert rss_kib(pid) <= rss + RSS_GROWTH_KIB, (rss, rss_kib(pid))
        innocent.unregister(out)
        assert_clean(innocent)
