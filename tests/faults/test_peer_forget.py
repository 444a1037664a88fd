"""A source forgets a target's departed clients (issue #23, audit row 9; spec section 5.3).

Before protocol version 5 a source kept every client a target had announced, with its NIXL
agent, until ``--max-peer-clients`` (256 per target) evicted it: after 30 clients came
and went, 30 entries and 31 agents stayed. At version 5 the target says ``peer_forget``
when a client's session ends (once none of its writes may still land) and the source
forgets it and removes its agent.

- 32 clients come and go through a target, each with one remote deliver checked byte for
  byte: the source's ``peer_clients`` and its loaded remote agents return to what the
  live sessions need, not to a cap; descriptors, threads and RSS of the source return to
  a bound, and a long-lived client is served before and after.
- A version-4 target against the same version-5 source keeps the old behaviour (the
  cap), beside a version-5 target whose clients are forgotten.
- One client cycling its session (bye and hello with the same agent) costs the source no
  descriptor per cycle: its agent is removed once, then kept departed and reused.
- A client that leaves while its write to a frozen source is uncertain: the forget waits
  for the write to be over, and the source drops the agent only after it.
- A hostile peer session speaking version 5 forgets another target's client, unknown
  agents (a flood), its own agent, repeatedly, and sends malformed forgets: each is a
  no-op (ack) or a typed error naming the field; nothing of the other target changes and
  its client is still served byte for byte.

Table sizes come from stats ``tables``; descriptors, threads and RSS from /proc of the
node process. Every test ends with the nodes clean (the ``sites`` fixture checks them).
"""

from __future__ import annotations

import gc
import os
import secrets
import time
from statistics import median
from typing import Any

import msgpack
import numpy as np
import zmq

from kvcr_io.agent import Agent
from kvcr_protocol import (
    CLIENT_GONE_VERSION,
    PROTOCOL_VERSIONS,
    Ack,
    Bye,
    Error,
    ErrorCode,
    MemoryKind,
    Message,
    PeerForget,
    PeerHello,
    PeerWelcome,
    Region,
    decode,
    encode,
)
from kvcr_testing.health import counter, outcome_count, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.measure import fd_count, rss_kib
from kvcr_testing.nodes import frozen
from kvcr_testing.remote import FAILED, OK, Dest, deliver_checked, expect, open_site, poll_stats

LAYOUT = plain_layout(2)
CLIENTS = 32
SETTLE_S = 10.0
FD_SLACK = 4
"""Descriptors the source may hold above its level before the churn, once settled: a UCX
connection closes when the source's agent is progressed after the client's agent went
(``IDLE_PROGRESS_S``), so the count returns within ``SETTLE_S``."""
THREAD_SLACK = 2
RSS_SLACK_KIB = 32 * 1024
"""Resident memory the source may keep after the churn (allocator arenas, NIXL caches):
well below what 32 loaded agents and their connections would cost if they stayed."""
RAW_TIMEOUT_S = 10.0
FLOOD = 2000
CYCLES = 40
QUERIES = 50


def query_s(site: Any) -> float:
    """One query of the site's own client, in seconds."""
    start = time.perf_counter()
    site.client.query([b"k"]).result(RESULT_TIMEOUT_S)
    return time.perf_counter() - start


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def hint(site: Any, rid: str, endpoint: str, keys: list[bytes]) -> None:
    site.client.submit_hint(rid, endpoint, keys).result(RESULT_TIMEOUT_S)


def come_and_go(a: Any, b: Any, key: bytes, src: np.ndarray, n: int, tag: str, seed: int) -> int:
    """``n`` clients of ``a`` each deliver ``key`` from ``b`` once (byte for byte) and leave;
    returns the most ``peer_clients`` ``b`` held meanwhile."""
    peak = 0
    for i in range(n):
        site = open_site(a.node, f"{tag}{i}")
        try:
            hint(site, "r", b.endpoint, [key])
            deliver_checked(site, key, LAYOUT, src, range(2), seed=seed + i, request_id="r")
            peak = max(peak, b.stats()["tables"]["peer_clients"])
        finally:
            site.close()
    return peak


def test_departed_clients_leave_the_source(sites: Any) -> None:
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    pid = b.node.proc.pid
    agents_alone = b.stats()["tables"]["remote_agents"]  # b's own client
    # The long-lived client: its announcement and the link stay for the whole test.
    hint(a, "r", b.endpoint, [b"k"])
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=2, request_id="r")
    live = b.stats()["tables"]
    assert live["peer_clients"] == 1 and live["remote_agents"] == agents_alone + 2, live  # a's agent and its client's
    fds, tasks, rss = fd_count(pid), threads(pid), rss_kib(pid)

    peak = come_and_go(a, b, b"k", src, CLIENTS, "c", seed=100)

    st = poll_stats(b, lambda st: st["tables"]["peer_clients"] == 1 and st["tables"]["remote_agents"] == live["remote_agents"],
                    SETTLE_S, "the source forgot every departed client and removed its agent")
    t = st["tables"]
    assert peak <= 2, peak  # the previous client was forgotten before the next came
    assert (t["remote_agents_departed"], t["remote_agents_pending"], t["remote_agents_gone"]) == (0, 0, 0), t
    counters = st["counters"]
    assert counter(st, "peer_clients_forgotten") == CLIENTS and counter(st, "peer_clients_evicted") == 0, counters
    assert counter(st, "peer_forgets_unknown") == 0, counters
    ta = poll_stats(a, lambda st: st["tables"]["forgets"] == 0, SETTLE_S, "the target owes no forget")
    assert counter(ta, "peer_forgets_sent") == CLIENTS and ta["tables"]["clients_sent"] == 1, (ta["counters"], ta["tables"])
    gc.collect()  # the departed clients' agents, in reference cycles, go (and their connections close at the source)
    assert wait_until(lambda: fd_count(pid) <= fds + FD_SLACK, SETTLE_S, 0.05), (fds, fd_count(pid))
    assert threads(pid) <= tasks + THREAD_SLACK, (tasks, threads(pid))
    assert rss_kib(pid) <= rss + RSS_SLACK_KIB, (rss, rss_kib(pid))
    print(f"source peer_clients peak {peak} -> {t['peer_clients']}; remote agents {live['remote_agents']} -> "
          f"{t['remote_agents']}; fds {fds} -> {fd_count(pid)}; threads {tasks} -> {threads(pid)}; "
          f"RSS {rss} -> {rss_kib(pid)} KiB")
    # The long-lived client is still served, byte for byte.
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=3, request_id="r")
    deliver_checked(a, b"k", LAYOUT, src, [1], seed=4, request_id="r", partial=True)


def test_a_version_4_target_keeps_the_cap_beside_a_version_5_one(sites: Any) -> None:
    """Spec section 7: a session that agreed on 4 carries no peer_forget; the source bounds
    it by max_peer_clients, and forgets the clients of a version-5 target at once."""
    old, new, b = sites.start(("old", {"args": ("--protocol-version", "4")}), "new",
                              ("b", {"args": ("--max-peer-clients", "4")}))
    src = b.deposit(b"k", LAYOUT, seed=5)
    come_and_go(old, b, b"k", src, 8, "o", seed=200)
    st = b.stats()
    assert st["tables"]["peer_clients"] == 4 and counter(st, "peer_clients_evicted") == 4, (st["tables"], st["counters"])
    assert counter(old.stats(), "peer_forgets_sent") == 0
    assert old.stats()["peers"][b.endpoint]["version"] == 4
    come_and_go(new, b, b"k", src, 8, "n", seed=300)
    st = poll_stats(b, lambda st: counter(st, "peer_clients_forgotten") == 8, SETTLE_S, "the version-5 target's clients forgotten")
    assert st["tables"]["peer_clients"] == 4 and counter(st, "peer_clients_evicted") == 4, (st["tables"], st["counters"])
    assert new.stats()["peers"][b.endpoint]["version"] == CLIENT_GONE_VERSION


def test_the_forget_waits_for_an_uncertain_write(sites: Any) -> None:
    """A client leaves while its write to a frozen source is uncertain: the target owes the
    forget but sends it only once the source answers; the source then forgets the client,
    and its agent goes after the write, never under it."""
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}), "b")
    src = b.deposit(b"k", LAYOUT, seed=10)
    hint(a, "r", b.endpoint, [b"k"])
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=11, request_id="r")  # the long-lived client
    live = b.stats()["tables"]
    site = open_site(a.node, "leaving")
    hint(site, "r", b.endpoint, [b"k"])
    deliver_checked(site, b"k", LAYOUT, src, range(2), seed=12, request_id="r")
    assert b.stats()["tables"]["peer_clients"] == 2
    writes_before = outcome_count(b.stats(), "write.")
    with frozen(b.node):
        dst = Dest(site, LAYOUT, range(2), seed=13)
        out = site.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=300).result(RESULT_TIMEOUT_S)[b"k"]
        expect(out, FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        site.client.close()  # bye while the write may still land: the node drops the held unregions
        st = poll_stats(a, lambda st: st["clients"] == 1, SETTLE_S, "the leaving client's session ended")
        assert st["tables"]["forgets"] == 1 and counter(st, "peer_forgets_sent") == 0, st["tables"]
    st = poll_stats(a, lambda st: st["tables"]["forgets"] == 0 and counter(st, "uncertain_resolved") == 1, SETTLE_S,
                    "the late answer resolved the write and the forget went")
    assert counter(st, "peer_forgets_sent") == 1, st["counters"]
    st = poll_stats(b, lambda st: st["tables"]["peer_clients"] == 1 and st["tables"]["remote_agents"] == live["remote_agents"],
                    SETTLE_S, "the source forgot the client after its write")
    assert outcome_count(st, "write.") == writes_before + 1, st["outcomes"]
    assert counter(st, "peer_clients_forgotten") == 1 and counter(st, "internal_errors") == 0, st["counters"]
    assert st["invariants"] == [], st["invariants"]
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=14, request_id="r")


def test_a_client_cycling_its_session_costs_the_source_no_descriptor(sites: Any) -> None:
    """One client says bye and hello again (the same NIXL agent) 40 times, with one remote
    deliver each: its agent is removed at the source once, then kept departed and reused,
    so the source holds no UCX connection per cycle (architecture §6)."""
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", LAYOUT, seed=20)
    pid = b.node.proc.pid
    hint(a, "r", b.endpoint, [b"k"])
    dst = Dest(a, LAYOUT, range(2), seed=21)  # registered once: every new hello announces it again
    out = a.client.deliver({b"k": dst.spans}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
    expect(out, OK)
    dst.assert_delivered(src)
    fds = fd_count(pid)
    for _ in range(CYCLES):
        _, bye = a.client.core.request(lambda i: Bye(i), lambda m: None, RESULT_TIMEOUT_S)
        a.client.core.wait(bye, RESULT_TIMEOUT_S)
        a.client.reconnect()
        hint(a, "r", b.endpoint, [b"k"])
        dst.buf[:] = dst.before
        out = a.client.deliver({b"k": dst.spans}, request_id="r").result(RESULT_TIMEOUT_S)[b"k"]
        expect(out, OK)
        dst.assert_delivered(src)
    st = poll_stats(b, lambda st: counter(st, "peer_clients_forgotten") == CYCLES, SETTLE_S, "every cycle forgotten")
    assert st["tables"]["peer_clients"] == 1 and st["tables"]["remote_agents_departed"] == 0, st["tables"]
    gc.collect()
    assert wait_until(lambda: fd_count(pid) <= fds + FD_SLACK, SETTLE_S, 0.05), (fds, fd_count(pid))
    print(f"{CYCLES} session cycles of one client: source fds {fds} -> {fd_count(pid)}")


class RawPeer:
    """A hand-driven peer session at version 5: a DEALER and a NIXL agent (for its hello)."""

    def __init__(self, endpoint: str) -> None:
        self.buf = np.zeros(4096, np.uint8)
        self.agent = Agent(f"forget-raw.{os.getpid()}.{secrets.token_hex(4)}")
        self.reg = self.agent.register(MemoryKind.DRAM, int(self.buf.ctypes.data), self.buf.nbytes, 0)
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        try:
            self.request(encode(Bye(1 << 40), CLIENT_GONE_VERSION), 1 << 40)
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.agent.deregister(self.reg)

    def hello(self) -> None:
        region = Region(0, MemoryKind.DRAM, 0, int(self.buf.ctypes.data), self.buf.nbytes)
        msg = PeerHello(1, PROTOCOL_VERSIONS, "forget-raw", secrets.randbits(62) | 1, self.agent.name,
                        self.agent.metadata(), (region,))
        welcome = self.request(encode(msg, 1), 1)
        assert isinstance(welcome, PeerWelcome) and welcome.version == CLIENT_GONE_VERSION, welcome

    def request(self, payload: bytes, request_id: int) -> Message:
        self.sock.send(payload)
        deadline = time.monotonic() + RAW_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.sock.poll(50, zmq.POLLIN):
                reply = decode(self.sock.recv(), CLIENT_GONE_VERSION)
                if getattr(reply, "id", None) == request_id:
                    return reply
        raise AssertionError(f"no reply to {request_id} within {RAW_TIMEOUT_S}s")

    def forget(self, request_id: int, agent: str) -> Message:
        return self.request(encode(PeerForget(request_id, agent), CLIENT_GONE_VERSION), request_id)

    def raw(self, obj: dict[str, Any]) -> Message:
        return self.request(msgpack.packb(obj, use_bin_type=True), int(obj.get("id", 0)))


def test_hostile_forgets_touch_nothing_of_another_target(sites: Any) -> None:
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", LAYOUT, seed=6)
    pid = b.node.proc.pid
    hint(a, "r", b.endpoint, [b"k"])
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=7, request_id="r")
    victim = a.client.core.agent.name  # announced to b by a's node
    before = b.stats()
    assert before["tables"]["peer_clients"] == 1, before["tables"]
    fds, tasks = fd_count(pid), threads(pid)
    raw = RawPeer(b.endpoint)
    try:
        raw.hello()
        assert raw.forget(2, victim) == Ack(2)  # another target's client
        assert raw.forget(3, raw.agent.name) == Ack(3)  # its own agent
        assert raw.forget(4, victim) == Ack(4)  # again
        latencies: list[float] = []
        quiet = [query_s(b) for _ in range(QUERIES)]  # the source's own client, before the flood
        beside: list[float] = []
        for n in range(FLOOD):
            start = time.perf_counter()
            assert raw.forget(100 + n, f"nobody-{n}") == Ack(100 + n)
            latencies.append(time.perf_counter() - start)
            if n % (FLOOD // QUERIES) == 0:
                beside.append(query_s(b))  # interleaved with the flood: reported, not asserted
            if n % 500 == 0:  # the other target's client meanwhile
                deliver_checked(a, b"k", LAYOUT, src, range(2), seed=8 + n, request_id="r")
        for obj, code, path in (
            ({"v": 5, "t": "peer_forget", "id": 9, "agent": "x" * 129}, ErrorCode.TOO_LARGE, "agent"),
            ({"v": 5, "t": "peer_forget", "id": 10}, ErrorCode.MISSING_FIELD, "agent"),
            ({"v": 5, "t": "peer_forget", "id": 11, "agent": [victim]}, ErrorCode.WRONG_TYPE, "agent"),
            ({"v": 4, "t": "peer_forget", "id": 12, "agent": victim}, ErrorCode.UNKNOWN_TYPE, "t"),
        ):
            error = raw.raw(obj)
            assert isinstance(error, Error) and (error.code, error.path) == (code, path), (obj, error)
        print(f"{FLOOD} forgets of unknown agents: p50 {median(latencies) * 1e6:.0f} us; the source's own client's "
              f"query p50 {median(quiet) * 1e6:.0f} us alone, {median(beside) * 1e6:.0f} us interleaved with it")
        st = b.stats()
        assert st["tables"]["peer_clients"] == 1 and st["peer_sessions"] == 2, st["tables"]
        assert counter(st, "peer_forgets_unknown") == FLOOD + 3 and counter(st, "peer_clients_forgotten") == 0, st["counters"]
    finally:
        raw.close()
    # The other target's client is still known and served, byte for byte.
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=9, request_id="r")
    st = poll_stats(b, lambda st: st["peer_sessions"] == 1, SETTLE_S, "the raw peer's session ended")
    assert counter(a.stats(), "writes_retried") == 0  # never refused for a forgotten client
    held = {k: st["tables"][k] for k in ("peer_clients", "sessions")}
    assert held == {k: before["tables"][k] for k in ("peer_clients", "sessions")}, (before["tables"], st["tables"])
    # The raw peer's own agent departs with its session (kept loaded, bounded); nothing else stays.
    assert st["tables"]["remote_agents"] - st["tables"]["remote_agents_departed"] == (
        before["tables"]["remote_agents"] - before["tables"]["remote_agents_departed"]), (before["tables"], st["tables"])
    gc.collect()
    assert wait_until(lambda: fd_count(pid) <= fds + FD_SLACK, SETTLE_S, 0.05), (fds, fd_count(pid))
    assert threads(pid) <= tasks + THREAD_SLACK, (tasks, threads(pid))
    assert st["invariants"] == [], st["invariants"]
