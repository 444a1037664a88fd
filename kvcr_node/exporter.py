"""``/metrics`` over HTTP for Prometheus: a server thread that serves the latest snapshot.

The thread never touches node state: each scrape turns the ``MetricsSnapshot`` the progress
thread last published (one reference, read once) into metric families (architecture §4).
``prometheus_client`` is imported here only, when a metrics port is configured, so a node
runs without it otherwise (engine environments install kvcr without its dependencies).
Names follow Prometheus conventions; the README lists them all.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvcr_node.config import ConfigError
from kvcr_node.metrics import MetricsSnapshot

log = logging.getLogger("kvcr.node")

METRICS_PATH = "/metrics"
STOP_TIMEOUT_S = 5.0
"""How long shutdown waits for the server thread to end."""
_POLL_INTERVAL_S = 0.2
"""How often the server thread looks for a shutdown request."""

Read = Callable[[], MetricsSnapshot | None]


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow scraper holds up no other."""

    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: a scrape every few seconds is not news."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SnapshotCollector:
    """A ``prometheus_client`` collector over the latest published snapshot."""

    def __init__(self, read: Read) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        snap = self.read()
        if snap is None:
            return
        yield from families(snap)


def families(s: MetricsSnapshot) -> Iterator[Any]:
    """The metric families of one snapshot (README, "Metrics")."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )

    def counter(name: str, doc: str, labels: Iterable[str] = (), rows: Iterable[tuple[Any, ...]] = ()) -> Any:
        family = CounterMetricFamily(name, doc, labels=list(labels))
        for *values, n in rows:
            family.add_metric([str(v) for v in values], n)
        return family

    def gauge(name: str, doc: str, labels: Iterable[str] = (), rows: Iterable[tuple[Any, ...]] = ()) -> Any:
        family = GaugeMetricFamily(name, doc, labels=list(labels))
        for *values, n in rows:
            family.add_metric([str(v) for v in values], n)
        return family

    yield InfoMetricFamily("kvcr_node", "The node: name, kvcr version, incarnation, newest protocol version.", value={
        "node": s.node, "version": s.version, "incarnation": f"{s.incarnation:x}",
        "protocol_version": str(s.protocol_version)})
    yield counter("kvcr_query_lookups", "Keys named in queries.", rows=[(s.lookups,)])
    yield counter("kvcr_query_hits", "Keys queries answered hit (READY on this node).", rows=[(s.hits,)])
    by_pool = ("pool", "memory")
    yield counter("kvcr_deposited_keys", "Objects committed by deposits, per pool they have spans in.", by_pool,
                  [(p.name, p.memory, p.deposited_keys) for p in s.pools])
    yield counter("kvcr_deposited_bytes", "Bytes committed by deposits.", by_pool,
                  [(p.name, p.memory, p.deposited_bytes) for p in s.pools])
    yield counter("kvcr_delivered_keys", "Keys delivered whole (to clients, or for peers).", by_pool,
                  [(p.name, p.memory, p.delivered_keys) for p in s.pools])
    yield counter("kvcr_delivered_bytes", "Bytes written out of the pool by transfers that succeeded.", by_pool,
                  [(p.name, p.memory, p.delivered_bytes) for p in s.pools])
    latency = HistogramMetricFamily("kvcr_request_duration_seconds", "Seconds from a request's receipt to its reply.",
                                    labels=["operation"])
    for kind, h in s.latency:
        latency.add_metric([kind], h.cumulative(), h.sum)
    yield latency
    first = HistogramMetricFamily(
        "kvcr_deliver_first_layer_seconds",
        "Seconds from a deliver's receipt to its first landed transfer (layer group 0, or the whole transfer).")
    first.add_metric([], s.first_layer.cumulative(), s.first_layer.sum)
    yield first
    yield gauge("kvcr_pool_capacity_bytes", "Bytes of pool memory.", by_pool,
                [(p.name, p.memory, p.slots * p.slot_size) for p in s.pools])
    yield gauge("kvcr_pool_used_bytes", "Bytes of the pool's slots allocated to objects.", by_pool,
                [(p.name, p.memory, p.used_bytes) for p in s.pools])
    yield gauge("kvcr_pool_evictable_bytes", "Bytes of slots held by objects no claim keeps.", by_pool,
                [(p.name, p.memory, p.evictable * p.slot_size) for p in s.pools])
    yield gauge("kvcr_pool_slots", "Slots in the pool.", by_pool, [(p.name, p.memory, p.slots) for p in s.pools])
    yield gauge("kvcr_pool_free_slots", "Slots free.", by_pool, [(p.name, p.memory, p.free) for p in s.pools])
    yield gauge("kvcr_pool_objects", "Objects with spans in the pool.", by_pool,
                [(p.name, p.memory, p.objects) for p in s.pools])
    yield counter("kvcr_evictions", "Objects evicted, per pool they had spans in.", by_pool,
                  [(p.name, p.memory, p.evictions) for p in s.pools])
    yield gauge("kvcr_objects", "Objects stored (READY or WRITING).", rows=[(s.objects,)])
    yield gauge("kvcr_objects_writing", "Objects whose bytes are still arriving.", rows=[(s.writing,)])
    yield gauge("kvcr_claims", "Claims held on objects, by kind.", ("kind",), s.claims)
    yield gauge("kvcr_leases", "Leases held.", rows=[(s.leases,)])
    yield gauge("kvcr_clients", "Client sessions.", rows=[(s.clients,)])
    yield gauge("kvcr_peer_sessions", "Sessions of target nodes with this node.", rows=[(s.peer_sessions,)])
    yield gauge("kvcr_operations_pending", "Operations in progress.", rows=[(s.operations_pending,)])
    yield gauge("kvcr_transfers_inflight", "NIXL transfers in flight.", rows=[(s.transfers_inflight,)])
    yield counter("kvcr_key_results", "Per-key results sent, by operation, status and error code.",
                  ("operation", "status", "code"), s.results)
    yield counter("kvcr_operation_failures", "Keys that failed, by operation and error code.", ("operation", "code"),
                  [(op, code, n) for op, status, code, n in s.results if status == "failed"])
    yield counter("kvcr_protocol_errors", "Requests refused with an error, by code.", ("code",), s.protocol_errors)
    yield gauge("kvcr_peer_links", "Links to source nodes, by state.", ("state",), s.links)
    yield gauge("kvcr_uncertain_writes", "Remote writes past their deadline that the source has not confirmed over.",
                rows=[(s.uncertain_writes,)])
    yield counter("kvcr_uncertain_writes_begun", "Remote writes that passed their deadline unanswered.",
                  rows=[(s.counter("uncertain_writes"),)])
    yield counter("kvcr_uncertain_writes_resolved", "Uncertain remote writes the source later confirmed over.",
                  rows=[(s.counter("uncertain_resolved"),)])
    yield counter("kvcr_auth_refusals", "Connections refused by CURVE authentication, by reason.", ("reason",),
                  [("not_allowed", s.counter("auth_refused")), ("handshake_failed", s.counter("auth_handshake_failed"))])
    yield counter("kvcr_internal_errors", "Unexpected failures the node counted and survived.",
                  rows=[(s.counter("internal_errors"),)])
    yield counter("kvcr_event_batches_published", "Inventory event batches published (spec section 15).",
                  rows=[(s.counter("events_published"),)])
    yield counter("kvcr_event_replays", "Event replay requests, by result.", ("result",),
                  [("served", s.counter("events_replays")), ("refused", s.counter("events_replays_refused")),
                   ("cut", s.counter("events_replay_cut")), ("busy", s.counter("events_replays_busy"))])


class MetricsExporter:
    """The HTTP server thread: ``/metrics`` from the latest snapshot, 404 for any other path."""

    def __init__(self, address: str, port: int, read: Read) -> None:
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError as exc:
            raise ImportError(f"metrics_port: serving metrics needs the prometheus-client package ({exc})") from exc

        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(read))  # type: ignore[arg-type]
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == METRICS_PATH:
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"kvcr-node serves {METRICS_PATH} only\n".encode()]

        server_class = _Server6 if ":" in address else _Server
        try:
            self.server = make_server(address, port, app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError("metrics_port", f"cannot serve on {address} port {port}: {exc.strerror or exc}") from exc
        self.port: int = self.server.server_address[1]
        """The port bound (the one asked for, or a free one for 0)."""
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(_POLL_INTERVAL_S,), name="kvcr-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving, close the listening socket, and join the thread (bounded)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(STOP_TIMEOUT_S)
        if self.thread.is_alive():
            log.warning("the metrics server thread did not stop within %.0f s", STOP_TIMEOUT_S)
