"""Prometheus metrics of a real ``kvcr-node`` process, scraped over HTTP (loopback).

Each scrape is parsed with ``prometheus_client``'s text parser. After known deposits,
queries and delivers (with known hits, misses and failures) the counters moved by exactly
those amounts, the latency histograms counted them, the byte counters equal the spans'
sizes, and failures carry their code. Two nodes show their link, the bytes the source
wrote for the target, and an uncertain write until it resolves; CURVE refusals are counted
by reason. Eight busy scrapers while the node works change nothing it answers; an unknown path is
404; the port closes when the node stops.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_client import Client, CurveKeys, ErrorCode, KeyStatus, NodeError, Presence
from kvcr_io.keys import write_keypair
from kvcr_protocol.events import END_SEQ_FRAME, encode_replay_request
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, StoredObject, plain_layout
from kvcr_testing.nodes import NodeProcess, frozen
from kvcr_testing.patterns import KiB, assert_bytes_equal
from kvcr_testing.remote import FAILED, Dest, expect, warm_link
from kvcr_testing.scrape import PUBLISHED_S, SCRAPE_TIMEOUT_S, get, metrics_port, moved, sample, scrape, settled

SLOT = 4 * KiB
SLOTS = 64
LAYOUT = plain_layout(4, size=SLOT)
POOL = (("memory", "dram"), ("pool", "kv"))
UNCERTAIN_DEADLINE_MS = 1000
REFUSAL_S = 5.0
BUSY_SCRAPERS = 8


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory("--pool", f"kv:{SLOT}:{SLOTS}", "--metrics-port", "0")


@pytest.fixture
def client(node: NodeProcess) -> Iterator[Client]:
    with Client(node.endpoint, name="itest-metrics") as c:
        yield c


@pytest.fixture
def reg(client: Client) -> Iterator[Registrar]:
    r = Registrar(client)
    yield r
    r.close()


def test_counters_move_by_exactly_the_operations_done(node: NodeProcess, client: Client, reg: Registrar) -> None:
    port = metrics_port(node)
    before = settled(port, lambda s: sample(s, "kvcr_clients") == 1)
    objects = [StoredObject(client, reg, f"k{i}".encode(), LAYOUT, seed=i) for i in range(3)]
    keys = [o.key for o in objects]
    presences = client.query([*keys, b"absent-1", b"absent-2"]).result(RESULT_TIMEOUT_S)
    assert [presences[k].presence for k in keys] == [Presence.HIT] * 3
    # Two keys in one deliver, one key in a deliver of two layer groups.
    res = client.deliver({o.key: o.spans for o in objects[:2]}).result(RESULT_TIMEOUT_S)
    assert all(res[o.key].status is KeyStatus.OK for o in objects[:2])
    planned = client.deliver({keys[2]: objects[2].spans}, plan=[LAYOUT.names[:1], LAYOUT.names[1:]])
    assert planned.result(RESULT_TIMEOUT_S)[keys[2]].status is KeyStatus.OK
    for o in objects:
        assert_bytes_equal(o.dst, o.src, "delivered")
    # Failures: a key the node lacks; an object larger than the pool.
    missing = client.deliver({b"absent-1": objects[0].spans}).result(RESULT_TIMEOUT_S)[b"absent-1"]
    assert missing.code == ErrorCode.NOT_FOUND
    huge = Layout([(f"L{i}", "kv", SLOT) for i in range(SLOTS + 1)])
    src = np.zeros(huge.nbytes, np.uint8)
    refused = client.deposit({b"huge": huge.source_spans(reg(src))}).result(RESULT_TIMEOUT_S)[b"huge"]
    assert refused.code == ErrorCode.CAPACITY

    after = settled(port, lambda s: sample(s, "kvcr_request_duration_seconds_count", ("operation", "deliver")) == 3)
    delta = moved(before, after)
    assert sample(delta, "kvcr_query_lookups_total") == 5
    assert sample(delta, "kvcr_query_hits_total") == 3
    assert sample(delta, "kvcr_deposited_keys_total", *POOL) == 3
    assert sample(delta, "kvcr_deposited_bytes_total", *POOL) == 3 * LAYOUT.nbytes
    assert sample(delta, "kvcr_delivered_keys_total", *POOL) == 3
    assert sample(delta, "kvcr_delivered_bytes_total", *POOL) == 3 * LAYOUT.nbytes
    # Four deposits (the refused one too), one query, three delivers (the failed one too); the
    # first landed transfer of each deliver that moved bytes is timed once per request.
    for operation, n in (("deposit", 4), ("query", 1), ("deliver", 3)):
        assert sample(delta, "kvcr_request_duration_seconds_count", ("operation", operation)) == n, operation
        assert sample(delta, "kvcr_request_duration_seconds_bucket", ("le", "+Inf"), ("operation", operation)) == n
    assert sample(delta, "kvcr_deliver_first_layer_seconds_count") == 2
    assert sample(delta, "kvcr_operation_failures_total", ("code", "NOT_FOUND"), ("operation", "deliver")) == 1
    assert sample(delta, "kvcr_operation_failures_total", ("code", "CAPACITY"), ("operation", "deposit")) == 1
    assert sample(delta, "kvcr_key_results_total", ("code", ""), ("operation", "deposit"), ("status", "stored")) == 3
    # Gauges: what the pool holds now.
    assert sample(after, "kvcr_pool_capacity_bytes", *POOL) == SLOTS * SLOT
    assert sample(after, "kvcr_pool_used_bytes", *POOL) == 3 * LAYOUT.nbytes
    assert sample(after, "kvcr_pool_objects", *POOL) == sample(after, "kvcr_objects") == 3
    assert sample(after, "kvcr_claims", ("kind", "handles")) == 0
    # The node's own stats agree.
    st = assert_clean(client)
    assert st["objects"] == 3


def test_scraping_under_load_changes_nothing_the_node_answers(node: NodeProcess, client: Client, reg: Registrar) -> None:
    port = metrics_port(node)
    stop = threading.Event()
    scrapes: list[int] = []
    failures: list[BaseException] = []

    def scraper() -> None:
        while not stop.is_set():
            try:
                scrape(port)
                scrapes.append(1)
            except BaseException as exc:  # reported below, in the test's thread
                failures.append(exc)
                return

    # Busy scrapers, fewer than the connection limit: each is served (the accept rate shared), none refused.
    threads = [threading.Thread(target=scraper, name=f"scraper-{i}", daemon=True) for i in range(BUSY_SCRAPERS)]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(10):
            o = StoredObject(client, reg, f"load{round_}".encode(), LAYOUT, seed=100 + round_)
            assert client.deliver({o.key: o.spans}).result(RESULT_TIMEOUT_S)[o.key].status is KeyStatus.OK
            assert_bytes_equal(o.dst, o.src, f"round {round_}")
            assert client.query([o.key, b"nothing"]).result(RESULT_TIMEOUT_S)[o.key].presence is Presence.HIT
        assert wait_until(lambda: len(scrapes) >= 3 * BUSY_SCRAPERS, PUBLISHED_S)
    finally:
        stop.set()
        for thread in threads:
            thread.join(SCRAPE_TIMEOUT_S)
    assert not failures, failures
    st = assert_clean(client)
    assert st["objects"] == 10 and st["counters"].get("internal_errors", 0) == 0
    after = settled(port, lambda s: sample(s, "kvcr_query_lookups_total") == 20)
    assert sample(after, "kvcr_query_hits_total") == 10
    assert sample(after, "kvcr_delivered_bytes_total", *POOL) == 10 * LAYOUT.nbytes
    assert sample(after, "kvcr_metrics_connections_dropped_total", ("reason", "limit")) == 0


def test_an_unknown_path_is_404_and_the_node_goes_on(node: NodeProcess, client: Client) -> None:
    port = metrics_port(node)
    for path in ("/", "/metrics/../admin", "/favicon.ico", "/%00"):
        with pytest.raises(urllib.error.HTTPError) as err:
            get(port, path)
        assert err.value.code == 404, path
    # Not HTTP at all: the server drops it, the node serves on.
    with socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S) as raw:
        raw.sendall(b"\x00\xff garbage\r\n\r\n")
        raw.recv(4096)
    assert "kvcr_node_info" in get(port)
    assert stats(client)["invariants"] == []


def test_the_port_closes_when_the_node_stops(node: NodeProcess, client: Client) -> None:
    port = metrics_port(node)
    assert "kvcr_node_info" in get(port)
    client.close()
    assert node.stop() == 0
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_taken_port_fails_the_start_naming_the_setting(node: NodeProcess, node_factory: Callable[..., NodeProcess]) -> None:
    port = metrics_port(node)
    with pytest.raises(RuntimeError, match=r"metrics_port: cannot serve on 127\.0\.0\.1 port \d+"):
        node_factory("--pool", f"kv:{SLOT}:{SLOTS}", "--metrics-port", str(port))


def test_two_nodes_report_their_link_and_an_uncertain_write(sites: Any) -> None:
    """A (target) delivers a key B (source) holds: A shows the link ready, B counts the bytes
    it wrote out for A's client. With B frozen past A's deadline the write is uncertain in
    A's metrics until B's late answer resolves it."""
    metrics = ("--metrics-port", "0")
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", "60000", *metrics)}), ("b", {"args": metrics}))
    port_a, port_b = metrics_port(a.node), metrics_port(b.node)
    layout = plain_layout(2)
    src = b.deposit(b"k", layout, seed=5)
    warm_link(a, b, b"k", layout, src, "r")
    after_a = settled(port_a, lambda s: sample(s, "kvcr_peer_links", ("state", "ready")) == 1)
    assert sample(after_a, "kvcr_request_duration_seconds_count", ("operation", "deliver")) == 1
    assert sample(after_a, "kvcr_delivered_bytes_total", *POOL) == 0  # A's pools moved nothing
    after_b = settled(port_b, lambda s: sample(s, "kvcr_peer_sessions") == 1)
    assert sample(after_b, "kvcr_delivered_bytes_total", *POOL) == layout.nbytes
    assert sample(after_b, "kvcr_delivered_keys_total", *POOL) == 1
    assert sample(after_b, "kvcr_key_results_total", ("code", ""), ("operation", "write"), ("status", "ok")) == 1

    with frozen(b.node):
        dst = Dest(a, layout, range(2), seed=50)
        out = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=UNCERTAIN_DEADLINE_MS)
        expect(out.result(UNCERTAIN_DEADLINE_MS / 1000 + RESULT_TIMEOUT_S)[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        uncertain = settled(port_a, lambda s: sample(s, "kvcr_uncertain_writes") == 1)
        assert sample(uncertain, "kvcr_uncertain_writes_begun_total") == 1
        assert a.stats()["counters"]["uncertain_writes"] == 1 and "writes_uncertain" not in a.stats()["counters"]
        assert sample(uncertain, "kvcr_operation_failures_total", ("code", "DESTINATION_UNCERTAIN"),
                      ("operation", "deliver")) == 1
    resolved = settled(port_a, lambda s: sample(s, "kvcr_uncertain_writes") == 0)
    assert sample(resolved, "kvcr_uncertain_writes_resolved_total") == 1


def test_auth_refusals_are_counted_by_reason(node_factory: Callable[..., NodeProcess], tmp_path: Path) -> None:
    server, alice, mallory = (write_keypair(tmp_path / name) for name in ("server", "alice", "mallory"))
    allow = tmp_path / "allow"
    allow.write_text(alice[0].read_text())
    node = node_factory("--pool", f"kv:{SLOT}:{SLOTS}", "--metrics-port", "0", "--curve-secret-key", str(server[1]),
                        "--curve-public-key", str(server[0]), "--curve-allow", str(allow))
    port = metrics_port(node)

    def keys(pair: tuple[Path, Path]) -> CurveKeys:
        return CurveKeys(server_public=server[0].read_text().strip(), public=pair[0].read_text().strip(),
                         secret=pair[1].read_text().strip())

    with Client(node.endpoint, name="alice", curve=keys(alice)) as client:
        with pytest.raises(NodeError) as err:
            Client(node.endpoint, name="mallory", curve=keys(mallory), timeout=REFUSAL_S)
        assert err.value.code == ErrorCode.UNAUTHORIZED
        with pytest.raises(NodeError):
            Client(node.endpoint, name="plain", timeout=REFUSAL_S)
        s = settled(port, lambda s: sample(s, "kvcr_auth_refusals_total", ("reason", "handshake_failed")) >= 1
                    and sample(s, "kvcr_auth_refusals_total", ("reason", "not_allowed")) == 1)
        assert sample(s, "kvcr_clients") == 1
        assert_clean(client)


def test_event_stream_counts_batches_and_replays(node_factory: Callable[..., NodeProcess], ipc_dir: Path) -> None:
    """The inventory event stream's batches and replay requests, served and refused, as the node counts them."""
    endpoint = f"ipc://{ipc_dir}/events.sock"
    node = node_factory("--pool", f"kv:{SLOT}:{SLOTS}", "--metrics-port", "0", "--events-endpoint", endpoint)
    port = metrics_port(node)
    with Client(node.endpoint, name="itest-metrics-events") as client:
        reg = Registrar(client)
        for i in range(3):
            StoredObject(client, reg, f"ev{i}".encode(), LAYOUT, seed=i)
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint + ".replay")
            for request in ([b"", b"\x00" * 7], encode_replay_request(0)):  # one malformed, one valid
                sock.send_multipart(request)
                while True:
                    assert sock.poll(int(SCRAPE_TIMEOUT_S * 1000)), "no replay answer"
                    if sock.recv_multipart()[1] == END_SEQ_FRAME:
                        break
            sock.close(0)
        finally:
            ctx.destroy(linger=0)  # closes the socket too, should an assertion leave it open
        st = stats(client)
        published = st["counters"]["events_published"]
        assert published >= 2  # the start's cleared, then the deposits' stored events
        after = settled(port, lambda s: sample(s, "kvcr_event_replays_total", ("result", "served")) == 1)
        assert sample(after, "kvcr_event_replays_total", ("result", "refused")) == 1
        assert sample(after, "kvcr_event_batches_published_total") == published
        assert sample(after, "kvcr_event_replays_total", ("result", "cut")) == 0
        assert sample(after, "kvcr_event_replays_total", ("result", "busy")) == 0
        reg.close()
        assert_clean(client)
