"""Churn soak: many short client sessions must leave nothing behind (issue #10, defect 3).

Each session loads the client's NIXL agent metadata into the node (a UCX endpoint and a
socket to the client's agent); when the session ends the node removes that remote agent,
and the endpoint's socket must be closed too, although an idle node makes no transfer
progress. The soak runs a thousand bare sessions (hello, stats, bye over a raw DEALER,
with NIXL agents of this process that are replaced every few dozen sessions, as departing
clients' agents go) and a few real clients that register, deposit and deliver, and
compares the node's descriptor count (/proc/PID/fd), RSS (/proc/PID/status VmRSS) and
table sizes (stats ``tables``) before and after.

A connection stays open while the agent at its other end lives (UCX keeps it), so the
node's count is compared once this process's agents are gone: what the node must not
keep is a descriptor for an agent that has left.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from kvcr_client import Client, KeyStatus, Span
from kvcr_io.agent import Agent
from kvcr_node.agents import DEPARTED_AGENTS
from kvcr_protocol import Ack, Bye, Hello, StatsReply, StatsRequest, Welcome, decode, encode, supported_up_to
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.measure import fd_count, rss_kib
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 64 * KiB
BARE_SESSIONS = 2000
REAL_SESSIONS = 12
WARM_SESSIONS = 20
SESSIONS_PER_AGENT = 50
"""Bare sessions that share one NIXL agent before it is replaced (a new agent costs ~30 ms)."""
FD_SLACK = 10
"""Descriptors the node may hold above its warm baseline (connections still closing)."""
RSS_GROWTH_KIB = 6144
"""RSS growth allowed over the whole soak. Measured: 1.7 to 3.2 MiB whether it runs 1000
or 4000 bare sessions: 1.6 MiB are the pool pages the real sessions' deposits touch (13
keys of two 64 KiB slots), the rest allocator and UCX memory pools that grow in steps
once, at varying points of the run."""
QUARTERS = 4
RSS_FLAT_KIB = 256
"""At least one of the last three quarters of the bare sessions must grow RSS by no more
than this. A one-off step of the pools lands in one quarter; a leak grows every quarter:
before the fix (a UCX endpoint per session) each quarter of 500 grew about 1.2 MiB, and
any leak of 0.5 KiB per session or more would fail here."""
SETTLE_S = 10.0
RECV_TIMEOUT_MS = 5000


class BareSessions:
    """Sessions over a raw DEALER: hello with an agent's metadata, stats, bye."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context = zmq.Context()
        self.agent: Agent | None = None
        self.metadata = b""
        self.count = 0

    def one(self) -> None:
        if self.agent is None or self.count % SESSIONS_PER_AGENT == 0:
            self.agent = None  # the old agent goes, closing its connections
            self.agent = Agent(f"churn.{os.getpid()}.{secrets.token_hex(4)}")
            self.metadata = self.agent.metadata()
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        try:
            sock.connect(self.endpoint)
            sock.send(encode(Hello(1, supported_up_to(2), f"bare{self.count}", self.agent.name, self.metadata), 1))
            welcome = decode(sock.recv(), 2)
            assert isinstance(welcome, Welcome), welcome
            sock.send(encode(StatsRequest(2), welcome.version))
            assert isinstance(decode(sock.recv(), welcome.version), StatsReply)
            sock.send(encode(Bye(3), welcome.version))
            assert isinstance(decode(sock.recv(), welcome.version), Ack)
        finally:
            sock.close(0)
        self.count += 1

    def close(self) -> None:
        self.agent = None
        self.context.term()


def real_session(endpoint: str, n: int) -> None:
    """A client that registers, deposits its own key, delivers it back byte-exact and leaves."""
    with Client(endpoint, name=f"real{n}") as client:
        reg = Registrar(client)
        src = pattern(2 * SLOT, 100 + n)
        dst = np.zeros(2 * SLOT, np.uint8)
        key = f"real{n}".encode()
        src_region, dst_region = reg(src), reg(dst)
        stored = client.deposit({key: [Span(f"L{i}", src_region, i * SLOT, SLOT, "kv") for i in range(2)]})
        assert stored.result(RESULT_TIMEOUT_S)[key].status is KeyStatus.STORED
        out = client.deliver({key: [Span(f"L{i}", dst_region, i * SLOT, SLOT) for i in range(2)]})
        assert out.result(RESULT_TIMEOUT_S)[key].status is KeyStatus.OK
        assert_bytes_equal(dst, src, f"session {n}")
        reg.close()


def test_session_churn_returns_descriptors_memory_and_tables(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:64KiB:64")
    pid = node.proc.pid
    bare = BareSessions(node.endpoint)
    try:
        with Client(node.endpoint, name="observer") as observer:
            for _ in range(WARM_SESSIONS):
                bare.one()
            real_session(node.endpoint, 0)
            bare.agent = None
            fds_before, rss_before = fd_count(pid), rss_kib(pid)
            tables_before = stats(observer)["tables"]

            rss_quarters = [rss_before]
            for _ in range(QUARTERS):
                for _ in range(BARE_SESSIONS // QUARTERS):
                    bare.one()
                rss_quarters.append(rss_kib(pid))
            growth = [b - a for a, b in itertools.pairwise(rss_quarters)]
            bare.agent = None
            # Nothing moves any byte: only the node's own progress can close these connections.
            settled = wait_until(lambda: fd_count(pid) <= fds_before + FD_SLACK, SETTLE_S, 0.05)
            fds_bare = fd_count(pid)
            assert settled, f"node descriptors grew from {fds_before} to {fds_bare} over {BARE_SESSIONS} bare sessions"
            for n in range(1, REAL_SESSIONS + 1):
                real_session(node.endpoint, n)

            settled = wait_until(lambda: fd_count(pid) <= fds_before + FD_SLACK, SETTLE_S, 0.05)
            fds_after, rss_after = fd_count(pid), rss_kib(pid)
            print(f"node fds {fds_before} -> {fds_bare} (bare) -> {fds_after}, RSS {rss_before} -> {rss_after} KiB, "
                  f"growth per quarter of the bare sessions {growth} KiB, after {BARE_SESSIONS} bare and "
                  f"{REAL_SESSIONS} real sessions")
            assert settled, f"node descriptors grew from {fds_before} to {fds_after} over the sessions"
            assert min(growth[1:]) <= RSS_FLAT_KIB, growth
            assert rss_after - rss_before <= RSS_GROWTH_KIB, (rss_before, rss_after)
            st = assert_clean(observer)
            assert st["clients"] == 1, st["clients"]
            tables = st["tables"]
            assert tables["sessions"] == tables_before["sessions"] == 1, (tables_before, tables)
            held = tables["remote_agents"] - tables["remote_agents_departed"]
            assert held == 1, tables  # the observer's
            assert tables["remote_agents_departed"] <= DEPARTED_AGENTS, tables
            assert tables["remote_agents_pending"] == 0, tables
            assert tables["handles"] == 0 and tables["waiters"] == 0, tables
            assert node.proc.poll() is None
    finally:
        bare.close()
