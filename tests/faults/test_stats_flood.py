"""A client flooding ``stats`` at a real node, most asking for the accounting check (``audit``).

The check walks every object on the node's loop, so a flood of it is the costliest ``stats``
a client can send (a frame with a hostile ``audit``, an integer or nil, is among the spec's
invalid vectors that ``test_hostile_vectors`` sends to a live node). The flooder sends
hundreds in flight over several reconnects; every one is answered, with the check exactly
when asked, the innocent client is served in between with its own bytes, and the node's
threads, descriptors, RSS and tables are back where they began.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, KeyStatus, Span
from kvcr_protocol import StatsReply, StatsRequest
from kvcr_testing.health import assert_clean, stats
from kvcr_testing.layouts import RESULT_TIMEOUT_S
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
OBJECTS = 2000
"""Objects the node holds: each audited ``stats`` walks them all."""
RECONNECTS = 3
REQUESTS = 300
"""``stats`` per flooder session, all sent before any answer is read; every third a plain one."""
FD_SLACK = 10
THREAD_SLACK = 2
RSS_GROWTH_KIB = 8192


@pytest.mark.slow
def test_an_audit_flood_is_answered_and_leaves_nothing_behind() -> None:
    with short_ipc_dir("statsflood") as d, running_node(d, "n", "--pool", f"kv:{SLOT // KiB}KiB:{OBJECTS}") as node, \
            Client(node.endpoint, name="innocent") as innocent:
        src = pattern(OBJECTS * SLOT, 3)
        region = innocent.register(src)
        keys = [b"keep%d" % i for i in range(OBJECTS)]
        assert innocent.deposit({k: [Span("L0", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(keys)}
                                ).result(RESULT_TIMEOUT_S).all_ok
        base = stats(innocent)
        pid = node.proc.pid
        fds, threads, rss = fd_count(pid), thread_count(pid), rss_kib(pid)
        dst = np.zeros(8 * SLOT, np.uint8)
        out = innocent.register(dst)
        wanted = {k: [Span("L0", out, i * SLOT, SLOT)] for i, k in enumerate(keys[:8])}
        for session in range(RECONNECTS):
            if session == 1:
                rss = rss_kib(pid)  # after the first flood: what the node allocates once is no leak
            with Client(node.endpoint, name="flooder") as flooder:
                futures: list[Future[Any]] = []
                for i in range(REQUESTS):
                    audit = i % 3 != 0
                    _, fut = flooder.core.request(lambda rid, audit=audit: StatsRequest(rid, audit), lambda m: m,
                                                  RESULT_TIMEOUT_S)
                    futures.append(fut)
                for i, fut in enumerate(futures):
                    reply = flooder.core.wait(fut, RESULT_TIMEOUT_S)
                    assert isinstance(reply, StatsReply), reply
                    assert ("invariants" in reply.stats) is (i % 3 != 0), i
                    assert reply.stats.get("invariants", []) == [] and reply.stats["objects"] == OBJECTS
                dst[:] = 0
                res = innocent.deliver(wanted).result(RESULT_TIMEOUT_S)
                assert all(res[k].status is KeyStatus.OK for k in wanted), res
                assert np.array_equal(dst, src[:8 * SLOT])
        st = stats(innocent)
        agents = ("remote_agents", "remote_agents_departed")
        assert {k: v for k, v in st["tables"].items() if k not in agents} == {
            k: v for k, v in base["tables"].items() if k not in agents}, (st["tables"], base["tables"])
        assert st["protocol_errors"] == base["protocol_errors"]
        assert fd_count(pid) <= fds + FD_SLACK and thread_count(pid) <= threads + THREAD_SLACK
        assert rss_kib(pid) <= rss + RSS_GROWTH_KIB, (rss, rss_kib(pid))
        innocent.unregister(out)
        assert_clean(innocent)
