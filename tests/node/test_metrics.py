"""Metrics in process: what the request path counts, on the node's fake clock, and the snapshot.

The node's loop never runs (``kvcr_testing.nodes.NodeDriver``): the test hands it requests,
moves its clock between receipt and completion, and reads the published snapshot, so
latency histograms are checked bucket by bucket without any timing. A real HTTP scrape of
the same node (loopback) is parsed with ``prometheus_client``'s text parser.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcr_node.buckets import TokenBucket
from kvcr_node.cli import _parser, build_config
from kvcr_node.config import ConfigError, NodeConfig, from_mapping
from kvcr_node.exporter import READS_PER_CONNECTION, MetricsExporter, request_line
from kvcr_node.metrics import LATENCY_BUCKETS_S, Histogram, MetricsSnapshot, PoolSnapshot
from kvcr_node.metrics_text import Dropped, render
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import (
    Completion,
    Deliver,
    DeliverItem,
    Deposit,
    DepositItem,
    DstSpan,
    Error,
    ErrorCode,
    KeyStatus,
    Query,
    QueryReply,
    SrcSpan,
    deliver_columns,
)
from kvcr_testing.health import wait_until
from kvcr_testing.nodes import TRANSFER_TIMEOUT_S, ClientAgent, NodeDriver, node_driver
from kvcr_testing.patterns import pattern
from kvcr_testing.scrape import get, scrape

SLOT = 4096
SPANS = 4
SLOTS = 16
"""Pool slots: four objects of ``SPANS`` spans fill it."""


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/metrics.sock", name="metrics", log_level="WARNING",
                      pools=(PoolSpec("kv", SLOT, SLOTS, "dram"),), client_grace_ms=600_000, metrics_port=0)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    """Region 1: source bytes for four objects; region 2: a destination as large."""
    a = ClientAgent("metrics-client", pattern(4 * SPANS * SLOT, 31), np.zeros(4 * SPANS * SLOT, np.uint8))
    yield a
    a.close()


@pytest.fixture
def driver(ipc_dir: Path, agent: ClientAgent) -> Iterator[NodeDriver]:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        yield d


def deposit_item(k: int) -> DepositItem:
    return DepositItem(f"k{k}".encode(), tuple(SrcSpan(f"L{j}", "kv", 1, (k * SPANS + j) * SLOT, SLOT) for j in range(SPANS)))


def deliver_item(k: int, spans: range = range(SPANS)) -> DeliverItem:
    return DeliverItem(f"k{k}".encode(), tuple(DstSpan(f"L{j}", 2, (k * SPANS + j) * SLOT, SLOT) for j in spans))


def results(replies: list[Any]) -> list[tuple[KeyStatus, int]]:
    (reply,) = [m for m in replies if isinstance(m, Completion)]
    return [(r.status, r.code) for r in reply.results]


def snapshot(d: NodeDriver) -> MetricsSnapshot:
    publisher = d.node.publisher
    assert publisher is not None
    publisher.publish()
    assert publisher.latest is not None
    return publisher.latest


def latency(s: MetricsSnapshot, kind: str) -> tuple[int, float]:
    (h,) = [h for k, h in s.latency if k == kind]
    return h.count, h.sum


def bucket_of(h: Any) -> float:
    """The upper bound of the one bucket a single-observation histogram counted in."""
    (index,) = [i for i, n in enumerate(h.counts) if n]
    return (*h.bounds, float("inf"))[index]


def test_deposits_queries_and_delivers_are_counted_with_their_latency(driver: NodeDriver, agent: ClientAgent) -> None:
    d = driver
    before = snapshot(d)
    assert (before.lookups, before.hits, latency(before, "deposit")) == (0, 0, (0, 0.0))
    d.receive(b"c", Deposit(2, (deposit_item(0), deposit_item(1))))
    d.clock.advance(0.002)  # the READ ends 2 ms after the deposit arrived (node time)
    d.finish_transfers(agent)
    assert results(d.sent(b"c")) == [(KeyStatus.STORED, 0)] * 2
    replies = d.receive(b"c", Query(3, (b"k0", b"k1", b"absent")))
    assert isinstance(replies[0], QueryReply)
    first = d.receive(b"c", Deliver(4, (deliver_item(0),)))
    d.clock.advance(0.03)
    d.finish_transfers(agent)
    assert results(first + d.sent(b"c")) == [(KeyStatus.OK, 0)]

    s = snapshot(d)
    assert (s.lookups, s.hits) == (3, 2)
    (pool,) = s.pools
    assert (pool.name, pool.memory, pool.slots, pool.free, pool.objects) == ("kv", "dram", SLOTS, SLOTS - 2 * SPANS, 2)
    assert (pool.deposited_keys, pool.deposited_bytes) == (2, 2 * SPANS * SLOT)
    assert (pool.delivered_keys, pool.delivered_bytes) == (1, SPANS * SLOT)
    assert pool.used_bytes == 2 * SPANS * SLOT
    # Latencies on the node's clock: each in the bucket its fake duration falls in.
    hist = dict(s.latency)
    assert (hist["deposit"].count, bucket_of(hist["deposit"])) == (1, 0.0025)
    assert hist["deposit"].sum == pytest.approx(0.002)
    assert (hist["query"].count, bucket_of(hist["query"])) == (1, LATENCY_BUCKETS_S[0])
    assert (hist["deliver"].count, bucket_of(hist["deliver"])) == (1, 0.05)
    assert (s.first_layer.count, bucket_of(s.first_layer)) == (1, 0.05)
    assert s.first_layer.sum == pytest.approx(0.03)
    assert hist["fetch"].count == 0
    assert ("deposit", "stored", "", 2) in s.results and ("deliver", "ok", "", 1) in s.results


def test_failures_and_refusals_appear_with_their_code(driver: NodeDriver, agent: ClientAgent) -> None:
    d = driver
    d.receive(b"c", Deposit(2, tuple(deposit_item(k) for k in range(4))))
    d.finish_transfers(agent)
    assert results(d.sent(b"c")) == [(KeyStatus.STORED, 0)] * 4
    # The pool is full: a fifth object evicts the least recently used (k0); one larger
    # than the whole pool fails CAPACITY.
    d.receive(b"c", Deposit(3, (DepositItem(b"k4", deposit_item(0).spans),)))
    d.finish_transfers(agent)
    assert results(d.sent(b"c")) == [(KeyStatus.STORED, 0)]
    huge = DepositItem(b"huge", tuple(SrcSpan(f"L{j}", "kv", 1, (j % SLOTS) * SLOT, SLOT) for j in range(SLOTS + 1)))
    assert results(d.receive(b"c", Deposit(4, (huge,)))) == [(KeyStatus.FAILED, ErrorCode.CAPACITY)]
    # A key not stored, and a span of the wrong size: failed, each with its code.
    bad = DeliverItem(b"k1", (DstSpan("L0", 2, 0, 2 * SLOT),))
    assert results(d.receive(b"c", Deliver(5, (deliver_item(9), bad)))) == [
        (KeyStatus.FAILED, ErrorCode.NOT_FOUND), (KeyStatus.FAILED, ErrorCode.SIZE_MISMATCH)]
    # A whole request refused: a frame from a stranger that is not msgpack.
    d.receive_frames([b"stranger", b"\xc1"])
    assert isinstance(d.sent(b"stranger", 1)[0], Error)

    s = snapshot(d)
    failures = {(op, code): n for op, status, code, n in s.results if status == "failed"}
    assert failures == {("deposit", "CAPACITY"): 1, ("deliver", "NOT_FOUND"): 1, ("deliver", "SIZE_MISMATCH"): 1}
    (pool,) = s.pools
    assert pool.evictions == 1 and pool.deposited_keys == 5
    assert sum(n for _, n in s.protocol_errors) == 1
    assert dict(s.claims) == {"handles": 0, "operations": 0, "leases": 0}

    # The same, over HTTP, as Prometheus reads it.
    port = d.node.metrics_port
    assert port is not None
    got = scrape(port)
    assert got[("kvcr_operation_failures_total", (("code", "NOT_FOUND"), ("operation", "deliver")))] == 1
    assert got[("kvcr_operation_failures_total", (("code", "CAPACITY"), ("operation", "deposit")))] == 1
    assert got[("kvcr_operation_failures_total", (("code", "SIZE_MISMATCH"), ("operation", "deliver")))] == 1
    assert got[("kvcr_evictions_total", (("memory", "dram"), ("pool", "kv")))] == 1
    assert got[("kvcr_deposited_bytes_total", (("memory", "dram"), ("pool", "kv")))] == 5 * SPANS * SLOT
    assert got[("kvcr_pool_capacity_bytes", (("memory", "dram"), ("pool", "kv")))] == SLOTS * SLOT
    assert got[("kvcr_pool_used_bytes", (("memory", "dram"), ("pool", "kv")))] == SLOTS * SLOT
    refused = sum(v for (name, _), v in got.items() if name == "kvcr_protocol_errors_total")
    assert refused == 1


def test_the_first_layer_of_a_plan_lands_before_the_whole_deliver(driver: NodeDriver, agent: ClientAgent) -> None:
    d = driver
    d.receive(b"c", Deposit(2, (deposit_item(0),)))
    d.finish_transfers(agent)
    d.sent(b"c")
    block = deliver_columns((deliver_item(0),), groups=range(SPANS))  # one span per group
    d.receive(b"c", Deliver(3, (), columns=(block,)))
    d.clock.advance(0.003)
    metrics = d.node.metrics
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S
    while not sum(metrics.first_layer.counts):
        assert time.monotonic() < deadline, "group 0 never landed"
        d.node.transfers.poll()
        agent.agent.progress()
    d.clock.advance(0.2)
    d.finish_transfers(agent)
    assert results(d.sent(b"c")) == [(KeyStatus.OK, 0)]
    s = snapshot(d)
    assert (s.first_layer.count, s.first_layer.sum) == (1, pytest.approx(0.003))
    count, total = latency(s, "deliver")
    assert count == 1 and total >= 0.003
    (pool,) = s.pools
    assert (pool.delivered_keys, pool.delivered_bytes) == (1, SPANS * SLOT)


def test_an_unknown_path_is_404_and_the_node_goes_on(driver: NodeDriver) -> None:
    port = driver.node.metrics_port
    assert port is not None
    with pytest.raises(urllib.error.HTTPError) as err:
        get(port, "/admin/../../etc/passwd")
    assert err.value.code == 404
    assert "kvcr_node_info" in get(port)
    assert isinstance(driver.receive(b"c", Query(9, (b"x",)))[0], QueryReply)


def test_the_port_closes_when_the_node_stops(ipc_dir: Path) -> None:
    with node_driver(config(ipc_dir)) as d:
        port = d.node.metrics_port
        assert port is not None and "kvcr_node_info" in get(port)
    with pytest.raises(urllib.error.URLError):
        get(port)


def test_histogram_buckets_are_upper_inclusive() -> None:
    h = Histogram((0.001, 0.01))
    for value in (0.0005, 0.001, 0.002, 0.01, 5.0):
        h.observe(value)
    assert h.counts == [2, 2, 1]
    assert h.frozen().cumulative() == [("0.001", 2.0), ("0.01", 4.0), ("+Inf", 5.0)]


@pytest.mark.parametrize(("raw", "field"), [
    ({"metrics_port": -1}, "metrics_port"), ({"metrics_port": 65536}, "metrics_port"),
    ({"metrics_port": "9100"}, "metrics_port"), ({"metrics_port": True}, "metrics_port"),
    ({"metrics_address": "localhost"}, "metrics_address"), ({"metrics_address": ""}, "metrics_address"),
])
def test_bad_metrics_settings_name_their_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(raw)
    assert err.value.field == field


def test_metrics_settings_from_toml_and_flags() -> None:
    config = from_mapping({"metrics_port": 9464, "metrics_address": "::1"})
    assert (config.metrics_port, config.metrics_address) == (9464, "::1")
    assert NodeConfig().metrics_port is None
    flags = build_config(_parser().parse_args(["--metrics-port", "0", "--metrics-address", "0.0.0.0"]))
    assert (flags.metrics_port, flags.metrics_address) == (0, "0.0.0.0")


def test_a_node_serves_metrics_without_prometheus_client(ipc_dir: Path) -> None:
    """Engine environments install kvcr without its dependencies: the node imports no metrics
    package, with or without a metrics port (the exporter writes the text format itself)."""
    script = f"""
import sys, urllib.request
sys.modules["prometheus_client"] = None  # any import of it fails
from kvcr_node.config import NodeConfig
from kvcr_node.node import Node
node = Node(NodeConfig(endpoint="ipc://{ipc_dir}/bare.sock", log_level="WARNING"))
node.request_stop()
node.run()
node = Node(NodeConfig(endpoint="ipc://{ipc_dir}/bare2.sock", log_level="WARNING", metrics_port=0))
with urllib.request.urlopen(f"http://127.0.0.1:{{node.metrics_port}}/metrics", timeout=10) as reply:
    print("served:", reply.status, reply.headers["Content-Type"], "kvcr_node_info" in reply.read().decode())
node.request_stop()
node.run()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "served: 200 text/plain; version=0.0.4; charset=utf-8 True" in done.stdout, done.stdout
    assert not list(ipc_dir.glob("bare*.sock"))


def test_errors_of_hostile_frames_are_counted_not_fatal(driver: NodeDriver) -> None:
    before = sum(n for _, n in snapshot(driver).protocol_errors)
    driver.receive_frames([b"c", b"\xc1"])
    replies = driver.sent(b"c")
    assert isinstance(replies[0], Error)
    assert sum(n for _, n in snapshot(driver).protocol_errors) == before + 1


def test_the_metrics_page_lists_every_metric_served(driver: NodeDriver) -> None:
    port = driver.node.metrics_port
    assert port is not None
    readme = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    served = set()
    for family in text_string_to_metric_families(get(port)):
        for sample in family.samples:
            name = sample.name
            if family.type == "histogram":
                name = family.name
            served.add(name)
    assert {"kvcr_node_info", "kvcr_query_hits_total", "kvcr_request_duration_seconds"} <= served
    missing = sorted(name for name in served if f"`{name}`" not in readme)
    assert not missing, f"docs/metrics.md's table lacks {missing}"


def test_a_disk_tier_is_served_and_listed(ipc_dir: Path, tmp_path: Path) -> None:
    """With disk pools (architecture §9): each in the pool families with ``memory="disk"``,
    the tier's moves by outcome and its copies, every name on docs/metrics.md."""
    disk = PoolSpec("kv-disk", SLOT, 2 * SLOTS, f"disk:{tmp_path}")
    with node_driver(config(ipc_dir, disk_pools=(disk,))) as d:
        s = snapshot(d)
        assert ("kv-disk", "disk", 2 * SLOTS) in [(p.name, p.memory, p.slots) for p in s.pools]
        assert dict(s.disk_tier)["demoted"] == 0 and s.disk_copies == 0 and ("disk_tier", 0) in s.claims
        port = d.node.metrics_port
        assert port is not None
        families = {f.name: f for f in text_string_to_metric_families(get(port))}
        moves = families["kvcr_disk_tier_moves"]
        assert {sample.labels["outcome"] for sample in moves.samples} == {
            "demoted", "demotions_failed", "promoted", "promotions_failed", "mismatched", "dropped"}
        assert families["kvcr_disk_tier_copies"].samples[0].value == 0
        assert {(s.labels["direction"], s.value) for s in families["kvcr_disk_tier_moved_bytes"].samples} == {
            ("demoted", 0), ("promoted", 0)}
        transfers = families["kvcr_disk_tier_transfer_seconds"]
        assert {s.labels["op"] for s in transfers.samples if s.name.endswith("_count")} == {"write", "read"}
        assert families["kvcr_disk_tier_recovered"].samples[0].value == 0
        dropped = {s.labels["reason"]: s.value for s in families["kvcr_disk_tier_recovery_dropped"].samples}
        assert dropped == dict.fromkeys(["torn", "corrupt", "malformed", "foreign", "pool_lost", "slot_reused",
                                         "digest_mismatch"], 0)
        readme = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
        served = {sample.name for f in families.values() if f.type != "histogram" for sample in f.samples}
        assert not sorted(name for name in served if f"`{name}`" not in readme)


# --------------------------------------------------------------------------- the exporter in process


def hostile_snapshot() -> MetricsSnapshot:
    """Label values with quotes, backslashes and newlines, counters past 2**53, every histogram bucket used."""
    h = Histogram()
    for value in (0.00005, 0.0003, 0.002, 0.7, 40.0):
        h.observe(value)
    weird = 'we"ird\\p\nool'
    pools = (PoolSnapshot("kv", "dram", SLOT, SLOTS, 10, 3, 7, 2, 11, 45056, 5, 20480),
             PoolSnapshot(weird, "hbm:0", 65536, 8, 8, 0, 0, 0, 0, 0, 0, 0))
    return MetricsSnapshot(
        node='n"ode\\x\ny', version="1.2.3", incarnation=0xABC123, protocol_version=5, lookups=2**60 + 1, hits=3,
        pools=pools, objects=7, writing=1, claims=(("handles", 1), ("operations", 2), ("leases", 0)), leases=4,
        clients=2, peer_sessions=1, operations_pending=3, transfers_inflight=2,
        latency=tuple((kind, h.frozen()) for kind in ("query", "deposit", "deliver", "fetch")),
        first_layer=Histogram().frozen(), results=(("deliver", "failed", "NOT_FOUND", 2), ("deposit", "stored", "", 5)),
        protocol_errors=(("BAD_REQUEST", 3),), links=(("connecting", 0), ("ready", 1), ("down", 2)),
        uncertain_writes=1, counters=(("auth_refused", 1), ("events_replays", 4), ("uncertain_writes", 2)))


def test_the_text_format_keeps_hostile_labels_and_exact_counters() -> None:
    s = hostile_snapshot()
    text = render(s).decode()
    assert f"kvcr_query_lookups_total {2**60 + 1}\n" in text  # an int, not a float that rounds it
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kvcr_query_lookups"].type == "counter"
    (info,) = families["kvcr_node_info"].samples
    assert info.labels == {"node": s.node, "version": "1.2.3", "incarnation": "abc123", "protocol_version": "5"}
    used = {(x.labels["pool"], x.labels["memory"]): x.value for x in families["kvcr_pool_used_bytes"].samples}
    assert used == {("kv", "dram"): (SLOTS - 10) * SLOT, (s.pools[1].name, "hbm:0"): 0}
    buckets = [(x.labels["le"], x.value) for x in families["kvcr_request_duration_seconds"].samples
               if x.name.endswith("_bucket") and x.labels["operation"] == "query"]
    assert buckets == [(le, float(n)) for le, n in s.latency[0][1].cumulative()]
    failures = [(x.labels, x.value) for x in families["kvcr_operation_failures"].samples]
    assert failures == [({"operation": "deliver", "code": "NOT_FOUND"}, 2)]
    assert all(f.documentation for f in families.values())


def test_the_text_is_rendered_once_per_snapshot(ipc_dir: Path) -> None:
    """The same bytes for every scrape of one snapshot; a new snapshot's at its first scrape."""
    first = hostile_snapshot()
    latest: list[MetricsSnapshot] = [first]
    exporter = MetricsExporter("127.0.0.1", 0, lambda: latest[0])
    try:
        assert exporter.body().startswith(render(first))
        cached = exporter._text
        assert exporter.body().startswith(render(first)) and exporter._text is cached
        latest[0] = second = dataclasses.replace(first, hits=99)
        assert b"kvcr_query_hits_total 99\n" in exporter.body() and exporter._text is not cached
        assert exporter._snapshot is second
    finally:
        exporter.close()


def test_a_head_sent_in_too_many_pieces_is_dropped(ipc_dir: Path) -> None:
    exporter = MetricsExporter("127.0.0.1", 0, hostile_snapshot)
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def reads() -> int:
                conns = list(exporter.conns.values())
                return conns[0].reads if conns else -1

            for i in range(READS_PER_CONNECTION):
                sock.sendall(b"G")
                assert wait_until(lambda i=i: reads() == i + 1, 5), (i, reads())  # one read per byte
            sock.sendall(b"E")
            assert sock.recv(4096) == b""  # closed unanswered
        assert wait_until(lambda: not exporter.conns, 5)
        assert exporter.dropped == {Dropped.LIMIT: 0, Dropped.TIMEOUT: 0, Dropped.TRICKLE: 1}
    finally:
        exporter.close()


def test_the_accept_rate_is_a_token_bucket() -> None:
    now = [100.0]
    bucket = TokenBucket(rate=8.0, burst=3, clock=lambda: now[0])  # times exact in binary
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.next_at() == 100.125
    now[0] += 0.0625
    assert not bucket.take()
    now[0] += 0.0625
    assert bucket.take() and not bucket.take()
    now[0] += 60  # idle for long: a burst again, never more
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    bucket.give_back()
    assert bucket.take() and not bucket.take()


@pytest.mark.parametrize(("head", "parsed"), [
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", ("GET", "/metrics", "HTTP/1.1")),
    (b"GET /metrics?name[]=x HTTP/1.0\n\n", ("GET", "/metrics", "HTTP/1.0")),
    (b"GET /metrics HTTP/2\r\n\r\n", None), (b"GET /metrics\r\n\r\n", None), (b"GET  /metrics HTTP/1.1\r\n\r\n", None),
    (b"G\xc3\xa9T /metrics HTTP/1.1\r\n\r\n", None), (b"\r\n\r\n", None),
])
def test_request_lines(head: bytes, parsed: tuple[str, str, str] | None) -> None:
    assert request_line(head) == parsed


@pytest.mark.parametrize("value", [0, -1, "16", True, 1.5])
def test_a_bad_connection_limit_names_its_field(value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"metrics_max_connections": value})
    assert err.value.field == "metrics_max_connections"


def test_the_connection_limit_from_toml_and_flags() -> None:
    assert NodeConfig().metrics_max_connections == 16
    assert from_mapping({"metrics_max_connections": 4}).metrics_max_connections == 4
    flags = build_config(_parser().parse_args(["--metrics-port", "0", "--metrics-max-connections", "2"]))
    assert flags.metrics_max_connections == 2
