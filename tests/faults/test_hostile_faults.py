"""Faults with real processes (spec section 12: failures are first-class; nothing leaks).

Clients killed in the middle of a deposit or a delivery, a source node killed in the
middle of its write, a source nobody listens at, a node restarted under its clients, a
client that stops reading its replies, back-pressure (``BUSY``) and the client limit
(``TOO_MANY_CLIENTS``). After each: the node's invariants hold, no slot, claim or handle
leaks, and nothing is left pending or in flight.

Several tests run UCX over TCP only (``UCX_TLS=tcp``, for the nodes and the clients): over
shared memory a node reads and writes a client's memory without the client's help, so a
frozen client would not hold a transfer in flight; over TCP the client's agent must
progress, so a client that stops progressing keeps its transfer in flight for sure.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_client import Client, ErrorCode, KeyStatus, NodeError, NodeLostError, Span
from kvcr_io.agent import Agent
from kvcr_protocol import Deposit, DepositItem, Hello, Query, SrcSpan, StatsRequest, Welcome, decode, encode
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.hostile import Worker
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, round_trip
from kvcr_testing.measure import rss_kib
from kvcr_testing.nodes import start_node
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 4 * KiB
POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])
BIG_SLOT = 256 * KiB
BIG_SPANS = 128
"""A 32 MiB object: over TCP, a transfer of it into a client that stopped progressing stalls."""
LIVENESS = ("--heartbeat-ms", "500", "--client-grace-ms", "1500")


def dst_spans(region: Any, n: int = 4, slot: int = SLOT) -> list[Span]:
    return [Span(f"L{i}", region, i * slot, slot) for i in range(n)]


# --------------------------------------------------------------------------- clients that die


@pytest.mark.parametrize("op", ["deposit", "deliver"])
def test_client_killed_mid_operation(op: str, node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    node = node_factory("--pool", f"kv:{BIG_SLOT // KiB}KiB:{BIG_SPANS + 16}", *LIVENESS)
    with Client(node.endpoint, name="observer") as observer:
        before = stats(observer)
        worker = Worker("stall", node.endpoint, "--op", op, "--slot", str(BIG_SLOT), "--spans", str(BIG_SPANS),
                        "--held", "3", "--linger", "300")
        try:
            report = worker.expect("issued", 60)
            assert report["sent"] and not report["done"], report
            assert len(report["held"]) == 3
            # Stalled: the client does not progress (the node may read the request a moment later).
            assert wait_until(lambda: stats(observer)["transfers"]["in_flight"] == 1, 10), stats(observer)
            st = stats(observer)
            assert st["claims"]["handles"] == 3, st["claims"]
            assert st["operations_pending"] == 1

            # Frozen whole (ZeroMQ's thread too): silent, so the node drops its session after
            # the grace period. Its handles go at once; the transfer's claim stays while the
            # transfer may still touch the client's memory.
            worker.signal(signal.SIGSTOP)
            assert wait_until(lambda: stats(observer)["counters"].get("clients_expired", 0) == 1, 15), stats(observer)
            st = stats(observer)
            assert st["invariants"] == [], st["invariants"]
            assert st["claims"]["handles"] == 0, st["claims"]
            assert st["clients"] == 1
            print(f"\nexpired mid-{op}: transfers {st['transfers']}, claims {st['claims']}, writing {st['writing']}")
            if st["transfers"]["in_flight"]:
                if op == "deliver":
                    assert st["claims"]["operations"] == 1, st["claims"]
                else:
                    assert st["writing"] == 1, st

            worker.signal(signal.SIGKILL)
            worker.wait(15)
            assert wait_until(lambda: stats(observer)["transfers"]["in_flight"] == 0, 20), stats(observer)["transfers"]
        finally:
            worker.close()
        after = assert_clean(observer)
        pool, pool_before = after["pools"]["kv"], before["pools"]["kv"]
        # What the dead client stored and completed stays as ordinary evictable objects:
        # the 3 held ones (released), and for a deliver the big object it delivered from.
        # A deposit cut off mid-transfer leaves nothing.
        kept = 3 + (BIG_SPANS if op == "deliver" else 0)
        assert pool["allocated"] == pool_before["allocated"] + kept, pool
        assert pool["evictable"] == pool["allocated"], pool
        assert after["objects"] == before["objects"] + (4 if op == "deliver" else 3)
        # The node still serves: a round trip with a new client.
        with Client(node.endpoint, name="after") as client:
            reg = Registrar(client)
            big = Layout([(f"L{i}", "kv", BIG_SLOT) for i in range(2)])
            src = pattern(big.nbytes, 5)
            region = reg(src)
            assert client.deposit({b"new": big.source_spans(region)}).result(30)[b"new"].status is KeyStatus.STORED
            dst = np.zeros_like(src)
            dregion = reg(dst)
            assert client.deliver({b"new": dst_spans(dregion, 2, BIG_SLOT)}).result(30)[b"new"].status is KeyStatus.OK
            assert_bytes_equal(dst, src, "after the dead client")
            reg.close()
        assert_clean(observer)


# --------------------------------------------------------------------------- peers that die or are not there


def test_source_killed_mid_write(node_factory: Callable[..., Any], ipc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    pool = ("--pool", f"kv:{BIG_SLOT // KiB}KiB:{BIG_SPANS + 8}")
    target = node_factory(*pool, "--peer-dead-ms", "1000")
    source_endpoint = f"ipc://{ipc_dir}/source.sock"
    source = start_node(source_endpoint, *pool)
    deadline_ms = 4000
    try:
        with Client(source.endpoint, name="source-client") as sc:
            src = pattern(BIG_SLOT * BIG_SPANS, 1)
            sreg = sc.register(src)
            spans = [Span(f"L{i}", sreg, i * BIG_SLOT, BIG_SLOT, "kv") for i in range(BIG_SPANS)]
            assert sc.deposit({b"k": spans}).result(30)[b"k"].status is KeyStatus.STORED
            # The target's client asks for k; the source writes straight into its memory,
            # but the client makes no progress for 3 s, so the write stalls in flight.
            worker = Worker("deliver", target.endpoint, "--source", source_endpoint, "--keys", "k",
                            "--slot", str(BIG_SLOT), "--spans", str(BIG_SPANS), "--seed", "1",
                            "--deadline-ms", str(deadline_ms), "--pause", "3")
            try:
                worker.expect("issued", 60)
                assert wait_until(lambda: stats(sc)["transfers"]["in_flight"] == 1, 10), stats(sc)
                source.kill()  # SIGKILL, mid-write
                result = worker.expect("result", deadline_ms / 1000 + 30)
            finally:
                worker.close()
        status, code, _ = result["outcomes"]["k"]
        # The target cannot know whether the dead source's transfer still lands: uncertain.
        assert (status, code) == ("FAILED", "DESTINATION_UNCERTAIN"), result
        assert result["seconds"] < deadline_ms / 1000 + 5, result
        with Client(target.endpoint, name="target-observer") as observer:
            # The source has been gone for longer than peer_dead_ms: the reservation ends.
            assert wait_until(lambda: stats(observer)["counters"].get("uncertain_resolved", 0) == 1, 15), stats(observer)
            st = assert_clean(observer)
            assert st["counters"]["uncertain_writes"] == 1, st["counters"]
            assert st["pools"]["kv"]["allocated"] == 0, st["pools"]  # the target stored nothing
            peer = st["peers"][source_endpoint]
            assert (peer["writes_outstanding"], peer["queued"], peer["uncertain"]) == (0, 0, 0), peer

        # A new source on the same endpoint: a new incarnation; deliveries work again.
        source = start_node(source_endpoint, *pool)
        with Client(source.endpoint, name="source-client-2") as sc:
            src = pattern(BIG_SLOT * 2, 1)
            sreg = sc.register(src)
            spans = [Span(f"L{i}", sreg, i * BIG_SLOT, BIG_SLOT, "kv") for i in range(2)]
            assert sc.deposit({b"k2": spans}).result(30)[b"k2"].status is KeyStatus.STORED
            worker = Worker("deliver", target.endpoint, "--source", source_endpoint, "--keys", "k2",
                            "--slot", str(BIG_SLOT), "--spans", "2", "--seed", "1")
            try:
                worker.expect("issued", 60)
                result = worker.expect("result", 60)
            finally:
                worker.close()
            assert result["outcomes"]["k2"] == ["OK", "OK", True], result
            assert_clean(sc)
        with Client(target.endpoint, name="target-observer") as observer:
            st = assert_clean(observer)
            assert st["peers"][source_endpoint]["state"] == "ready", st["peers"]
    finally:
        source.stop()


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("where", ["ipc", "tcp"])
def test_source_nobody_listens_at(where: str, node_factory: Callable[..., Any], ipc_dir: Path) -> None:
    node = node_factory(*POOL)
    nowhere = f"ipc://{ipc_dir}/nobody.sock" if where == "ipc" else f"tcp://127.0.0.1:{_free_tcp_port()}"
    deadline_ms = 1500
    with Client(node.endpoint, name="unreachable") as client:
        reg = Registrar(client)
        before = slot_accounting(stats(client))
        client.submit_hint("r", nowhere, [b"a", b"b"]).result(5)
        dst = pattern(LAYOUT.nbytes, 3)
        untouched = dst.copy()
        region = reg(dst)
        t0 = time.monotonic()
        res = client.deliver({b"a": dst_spans(region)}, request_id="r", deadline_ms=deadline_ms).result(RESULT_TIMEOUT_S)
        took = time.monotonic() - t0
        assert (res[b"a"].status, res[b"a"].code) == (KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE), res
        assert deadline_ms / 1000 - 0.2 <= took < deadline_ms / 1000 + 5, took
        assert_bytes_equal(dst, untouched, "destination of a delivery that never started")
        # A fetch sets slots aside for the object; they come back when it fails.
        res = client.fetch({b"b": [(f"L{i}", "kv") for i in range(4)]}, request_id="r", deadline_ms=deadline_ms).result(
            RESULT_TIMEOUT_S
        )
        assert (res[b"b"].status, res[b"b"].code) == (KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE), res
        st = assert_clean(client, slots_before=before)
        peer = st["peers"][nowhere]
        assert peer["state"] == "connecting" and peer["writes_outstanding"] == 0 and peer["queued"] == 0, peer
        assert st["outcomes"].get("deliver.FAILED.PEER_UNREACHABLE") == 1, st["outcomes"]
        assert st["outcomes"].get("fetch.FAILED.PEER_UNREACHABLE") == 1, st["outcomes"]
        round_trip(client, reg, b"local", LAYOUT, 9)  # the node is unaffected
        assert_clean(client)
        reg.close()


# --------------------------------------------------------------------------- back-pressure and limits


def test_busy_when_too_many_operations_are_pending(node_factory: Callable[..., Any], ipc_dir: Path) -> None:
    node = node_factory(*POOL, "--max-pending", "2")
    deadline_ms = 2000
    with Client(node.endpoint, name="busy") as client:
        reg = Registrar(client)
        # Deliveries from a source nobody listens at stay pending until their deadline.
        client.submit_hint("r", f"ipc://{ipc_dir}/nobody.sock", [f"k{i}".encode() for i in range(6)]).result(5)
        dst = np.zeros(LAYOUT.nbytes * 6, dtype=np.uint8)
        region = reg(dst)
        handles = [
            client.deliver({f"k{i}".encode(): [Span(f"L{j}", region, (4 * i + j) * SLOT, SLOT) for j in range(4)]},
                           request_id="r", deadline_ms=deadline_ms)
            for i in range(6)
        ]
        busy, unreachable = 0, 0
        for i, h in enumerate(handles):
            try:
                res = h.result(deadline_ms / 1000 + 10)
            except NodeError as exc:
                assert exc.code == ErrorCode.BUSY, exc
                busy += 1
                continue
            assert res[f"k{i}".encode()].code == ErrorCode.PEER_UNREACHABLE, res
            unreachable += 1
        assert (unreachable, busy) == (2, 4)
        st = assert_clean(client)
        assert st["protocol_errors"].get("BUSY") == 4, st["protocol_errors"]
        # Back-pressure is over once the operations are: new work is served.
        round_trip(client, reg, b"after", LAYOUT, 3)
        assert_clean(client)
        reg.close()


def test_too_many_clients(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL, "--max-clients", "2")
    first = Client(node.endpoint, name="first")
    try:
        with Client(node.endpoint, name="second") as second:
            t0 = time.monotonic()
            with pytest.raises(NodeError) as err:
                Client(node.endpoint, name="third", timeout=5)
            assert err.value.code == ErrorCode.TOO_MANY_CLIENTS, err.value
            assert time.monotonic() - t0 < 5
            st = stats(second)
            assert st["clients"] == 2 and st["protocol_errors"].get("TOO_MANY_CLIENTS") == 1, st
            first.close()  # bye: its place is free at once
            assert wait_until(lambda: stats(second)["clients"] == 1, 5)
            with Client(node.endpoint, name="third") as third:
                reg = Registrar(third)
                round_trip(third, reg, b"third", LAYOUT, 4)
                reg.close()
            assert_clean(second)
    finally:
        first.close()


# --------------------------------------------------------------------------- node restart


def test_node_restarted_under_its_clients(ipc_dir: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/restart.sock"
    node = start_node(endpoint, *POOL)
    again = None
    try:
        with Client(endpoint, name="restart") as client:
            reg = Registrar(client)
            round_trip(client, reg, b"before", LAYOUT, 1)
            first = client.node
            assert first is not None
            src = pattern(SLOT, 2)
            held = client.deposit({b"held": [Span("L0", reg(src), 0, SLOT, "kv")]}, no_evict=True).result(10)[b"held"]
            assert held.handle is not None
            dst = np.zeros(LAYOUT.nbytes, dtype=np.uint8)
            dregion = reg(dst)

            # Requests sent while the node is frozen, then SIGTERM: each ends, one way or another.
            node.proc.send_signal(signal.SIGSTOP)
            try:
                pending = [client.query([b"before"]), client.stats(), client.deliver({b"before": dst_spans(dregion)})]
            finally:
                node.proc.send_signal(signal.SIGTERM)
                node.proc.send_signal(signal.SIGCONT)
            assert node.proc.wait(30) == 0
            for h in pending:
                try:
                    h.result(10)
                except NodeLostError:
                    pass
                except NodeError as exc:
                    assert exc.code == ErrorCode.SHUTTING_DOWN, exc
            assert wait_until(lambda: client.core.lost, 10)
            # While the node is gone, and until reconnect(), new work fails at once.
            with pytest.raises(NodeLostError):
                client.query([b"before"]).result(5)
            again = start_node(endpoint, *POOL)
            t0 = time.monotonic()
            with pytest.raises(NodeLostError):
                client.stats().result(5)
            assert time.monotonic() - t0 < 2
            welcome = client.reconnect()
            assert welcome.incarnation != first.incarnation
            # The old node's handle means nothing to the new one.
            res = client.release([held.handle]).result(5)
            assert res[held.handle.to_bytes(8, "big")].code == ErrorCode.UNKNOWN_HANDLE
            assert client.query([b"before"]).result(5)[b"before"].presence.value == "MISS"
            round_trip(client, reg, b"after", LAYOUT, 5)  # regions registered before are announced again
            assert_clean(client)
            reg.close()
    finally:
        node.stop()
        if again is not None:
            assert again.stop() == 0, again.output


# --------------------------------------------------------------------------- a client that stops reading


def test_client_that_stops_reading(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL, *LIVENESS)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SNDTIMEO, 5000)
    agent = Agent(f"slow-reader-{time.monotonic_ns()}")
    try:
        with Client(node.endpoint, name="responsive") as client:
            reg = Registrar(client)
            round_trip(client, reg, b"k", LAYOUT, 1)
            raw.connect(node.endpoint)
            raw.send(encode(Hello(1, (1, 2), "slow", agent.name, agent.metadata(), ()), 1))
            assert raw.poll(10_000)
            assert isinstance(decode(raw.recv()), Welcome)
            rss_before = rss_kib(node.proc.pid)
            keys = tuple(f"k{i}".encode() * 8 for i in range(32))
            bad_deposit = (DepositItem(b"x", (SrcSpan("L0", "kv", 7, 0, SLOT),)),)  # region 7 was never announced
            worst = 0.0
            sent = 0
            for i in range(2, 30_002):
                kind = i % 10
                if kind == 0:
                    msg: Any = StatsRequest(i)
                elif kind == 1:
                    msg = Deposit(i, bad_deposit)
                else:
                    msg = Query(i, keys)
                raw.send(encode(msg, 2))  # never read a reply
                sent += 1
                if i % 3000 == 0:
                    t0 = time.monotonic()
                    st = stats(client)
                    worst = max(worst, time.monotonic() - t0)
                    assert st["operations_pending"] == 0, st["operations_pending"]
            t0 = time.monotonic()
            round_trip(client, reg, b"k2", LAYOUT, 2)
            worst = max(worst, time.monotonic() - t0)
            assert worst < 5.0, worst  # generous: the machine is shared
            st = stats(client)
            assert st["clients"] == 2 and st["operations_pending"] == 0, st
            growth = rss_kib(node.proc.pid) - rss_before
            assert growth < 256 * 1024, f"the node grew by {growth} KiB for a client that does not read"
            print(f"\nslow reader: {sent} requests unread; worst stats/round trip {worst * 1000:.0f} ms; node RSS +{growth} KiB")
            raw.close(0)
            # Silent from now on: dropped after the grace period.
            assert wait_until(lambda: stats(client)["clients"] == 1, 15)
            assert stats(client)["counters"].get("clients_expired") == 1
            assert_clean(client)
            reg.close()
    finally:
        raw.close(0)
        ctx.term()
