"""The Prometheus text format (version 0.0.4) of a ``MetricsSnapshot``, written directly.

``render`` turns one published snapshot into the bytes the exporter serves for it, once per
snapshot; ``render_exporter`` adds the exporter's own families (open connections, drops by
reason), which change between snapshots. No ``prometheus_client``: it would build an object
per sample on every scrape. Names follow Prometheus conventions; docs/metrics.md lists them all.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Any

from kvcr_node.counters import Count
from kvcr_node.metrics import HistogramSnapshot, MetricsSnapshot


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)  # exact, however large a counter grows
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(value)


class _Text:
    """Builds one exposition: ``# HELP``, ``# TYPE`` and the samples of each family in turn."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def _head(self, name: str, kind: str, doc: str) -> None:
        self.parts.append(f"# HELP {name} {_escape_help(doc)}\n# TYPE {name} {kind}\n")

    def _sample(self, name: str, labels: Iterable[tuple[str, str]], value: float) -> None:
        text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
        self.parts.append(f"{name}{{{text}}} {_number(value)}\n" if text else f"{name} {_number(value)}\n")

    def family(self, kind: str, name: str, doc: str, labels: Iterable[str] = (),
               rows: Iterable[tuple[Any, ...]] = ()) -> None:
        """A counter (``name`` gets ``_total``) or gauge: one sample per row of label values, then the value."""
        if kind == "counter":
            name += "_total"
        self._head(name, kind, doc)
        names = tuple(labels)
        for *values, n in rows:
            self._sample(name, zip(names, (str(v) for v in values), strict=True), n)

    def info(self, name: str, doc: str, values: dict[str, str]) -> None:
        name += "_info"
        self._head(name, "gauge", doc)
        self._sample(name, sorted(values.items()), 1)

    def histogram(self, name: str, doc: str, rows: Iterable[tuple[tuple[tuple[str, str], ...], HistogramSnapshot]]) -> None:
        """Cumulative ``_bucket`` samples (``le``), ``_count`` and ``_sum`` per (labels, histogram) row."""
        self._head(name, "histogram", doc)
        for labels, h in rows:
            total = 0
            for bound, n in zip((*(repr(b) for b in h.bounds), "+Inf"), h.counts, strict=True):
                total += n
                self._sample(f"{name}_bucket", (*labels, ("le", bound)), total)
            self._sample(f"{name}_count", labels, total)
            self._sample(f"{name}_sum", labels, h.sum)

    def encode(self) -> bytes:
        return "".join(self.parts).encode()


def render(s: MetricsSnapshot) -> bytes:
    """The text exposition of one snapshot (docs/metrics.md)."""
    t = _Text()

    def counter(name: str, doc: str, labels: Iterable[str], rows: Iterable[tuple[Any, ...]]) -> None:
        t.family("counter", name, doc, labels, rows)

    def gauge(name: str, doc: str, labels: Iterable[str], rows: Iterable[tuple[Any, ...]]) -> None:
        t.family("gauge", name, doc, labels, rows)

    t.info("kvcr_node", "The node: name, kvcr version, incarnation, newest protocol version.", {
        "node": s.node, "version": s.version, "incarnation": f"{s.incarnation:x}",
        "protocol_version": str(s.protocol_version)})
    counter("kvcr_query_lookups", "Keys named in queries.", (), [(s.lookups,)])
    counter("kvcr_query_hits", "Keys queries answered hit (READY on this node).", (), [(s.hits,)])
    by_pool = ("pool", "memory")
    counter("kvcr_deposited_keys", "Objects committed by deposits, per pool they have spans in.", by_pool,
            [(p.name, p.memory, p.deposited_keys) for p in s.pools])
    counter("kvcr_deposited_bytes", "Bytes committed by deposits.", by_pool,
            [(p.name, p.memory, p.deposited_bytes) for p in s.pools])
    counter("kvcr_delivered_keys", "Keys delivered whole (to clients, or for peers).", by_pool,
            [(p.name, p.memory, p.delivered_keys) for p in s.pools])
    counter("kvcr_delivered_bytes", "Bytes written out of the pool by transfers that succeeded.", by_pool,
            [(p.name, p.memory, p.delivered_bytes) for p in s.pools])
    t.histogram("kvcr_request_duration_seconds", "Seconds from a request's receipt to its reply.",
                [((("operation", kind),), h) for kind, h in s.latency])
    t.histogram("kvcr_deliver_first_layer_seconds",
                "Seconds from a deliver's receipt to its first landed transfer (layer group 0, or the whole transfer).",
                [((), s.first_layer)])
    gauge("kvcr_pool_capacity_bytes", "Bytes of pool memory.", by_pool,
          [(p.name, p.memory, p.slots * p.slot_size) for p in s.pools])
    gauge("kvcr_pool_used_bytes", "Bytes of the pool's slots allocated to objects.", by_pool,
          [(p.name, p.memory, p.used_bytes) for p in s.pools])
    gauge("kvcr_pool_evictable_bytes", "Bytes of slots held by objects no claim keeps.", by_pool,
          [(p.name, p.memory, p.evictable * p.slot_size) for p in s.pools])
    gauge("kvcr_pool_slots", "Slots in the pool.", by_pool, [(p.name, p.memory, p.slots) for p in s.pools])
    gauge("kvcr_pool_free_slots", "Slots free.", by_pool, [(p.name, p.memory, p.free) for p in s.pools])
    gauge("kvcr_pool_objects", "Objects with spans in the pool.", by_pool, [(p.name, p.memory, p.objects) for p in s.pools])
    counter("kvcr_evictions", "Objects evicted, per pool they had spans in.", by_pool,
            [(p.name, p.memory, p.evictions) for p in s.pools])
    if s.disk_tier:
        counter("kvcr_disk_tier_moves", "Copies to the disk tier and read backs from it, by outcome: demoted, "
                "demotions_failed, promoted, promotions_failed, mismatched (read back changed: dropped), dropped.",
                ("outcome",), s.disk_tier)
        gauge("kvcr_disk_tier_copies", "Objects with a copy in the disk tier.", (), [(s.disk_copies,)])
        counter("kvcr_disk_tier_moved_bytes", "Bytes copied to the disk tier (demoted) and read back from it "
                "(promoted, committed).", ("direction",), s.disk_bytes)
        t.histogram("kvcr_disk_tier_transfer_seconds", "Seconds a transfer of copies to the disk tier (write) "
                    "or of read backs from it (read) takes, from its post to its end.",
                    [((("op", op),), h) for op, h in s.disk_latency])
        recovery = dict(s.disk_recovery)
        gauge("kvcr_disk_tier_recovered", "Copies the node took back from its disk pools' journal at start.", (),
              [(recovery.get("recovered", 0),)])
        gauge("kvcr_disk_tier_recovery_dropped", "Records of the disk pools' journal dropped at start, by reason.",
              ("reason",), [(name[len("dropped_"):], n) for name, n in s.disk_recovery if name.startswith("dropped_")])
    gauge("kvcr_objects", "Objects stored (READY or WRITING).", (), [(s.objects,)])
    gauge("kvcr_objects_writing", "Objects whose bytes are still arriving.", (), [(s.writing,)])
    gauge("kvcr_claims", "Claims held on objects, by kind.", ("kind",), s.claims)
    gauge("kvcr_leases", "Leases held.", (), [(s.leases,)])
    gauge("kvcr_clients", "Client sessions.", (), [(s.clients,)])
    gauge("kvcr_peer_sessions", "Sessions of target nodes with this node.", (), [(s.peer_sessions,)])
    gauge("kvcr_operations_pending", "Operations in progress.", (), [(s.operations_pending,)])
    gauge("kvcr_transfers_inflight", "NIXL transfers in flight.", (), [(s.transfers_inflight,)])
    counter("kvcr_key_results", "Per-key results sent, by operation, status and error code.",
            ("operation", "status", "code"), s.results)
    counter("kvcr_operation_failures", "Keys that failed, by operation and error code.", ("operation", "code"),
            [(op, code, n) for op, status, code, n in s.results if status == "failed"])
    counter("kvcr_protocol_errors", "Requests refused with an error, by code.", ("code",), s.protocol_errors)
    gauge("kvcr_peer_links", "Links to source nodes, by state.", ("state",), s.links)
    gauge("kvcr_uncertain_writes", "Remote writes past their deadline that the source has not confirmed over.", (),
          [(s.uncertain_writes,)])
    counter("kvcr_uncertain_writes_begun", "Remote writes that passed their deadline unanswered.", (),
            [(s.counter(Count.UNCERTAIN_WRITES),)])
    counter("kvcr_uncertain_writes_resolved", "Uncertain remote writes the source later confirmed over.", (),
            [(s.counter(Count.UNCERTAIN_RESOLVED),)])
    counter("kvcr_auth_refusals", "Connections refused by CURVE authentication, by reason.", ("reason",),
            [("not_allowed", s.counter(Count.AUTH_REFUSED)), ("handshake_failed", s.counter(Count.AUTH_HANDSHAKE_FAILED))])
    counter("kvcr_internal_errors", "Unexpected failures the node counted and survived.", (),
            [(s.counter(Count.INTERNAL_ERRORS),)])
    counter("kvcr_event_batches_published", "Inventory event batches published (spec section 15).", (),
            [(s.counter(Count.EVENTS_PUBLISHED),)])
    counter("kvcr_event_replays", "Event replay requests, by result.", ("result",),
            [("served", s.counter(Count.EVENTS_REPLAYS)), ("refused", s.counter(Count.EVENTS_REPLAYS_REFUSED)),
             ("cut", s.counter(Count.EVENTS_REPLAY_CUT)), ("busy", s.counter(Count.EVENTS_REPLAYS_BUSY))])
    return t.encode()


class Dropped(enum.Enum):
    """Why the exporter closed a connection without serving it (``kvcr_metrics_connections_dropped_total``)."""

    LIMIT = "limit"
    """``metrics_max_connections`` were open: answered 503 at once."""
    TIMEOUT = "timeout"
    """No whole request, or the reply not taken, within ``CONNECTION_TIMEOUT_S``."""
    TRICKLE = "trickle"
    """The request head came in more than ``READS_PER_CONNECTION`` pieces."""


def _exporter_template() -> str:
    """The exporter's own families with ``{}`` for each value: open connections, then drops by reason."""
    t = _Text()
    t.family("gauge", "kvcr_metrics_connections", "Connections open to the metrics port.", (), [(0,)])
    t.family("counter", "kvcr_metrics_connections_dropped", "Metrics connections closed unserved, by reason.",
             ("reason",), [(reason.value, 0) for reason in Dropped])
    lines = "".join(t.parts).replace("{", "{{").replace("}", "}}").splitlines(keepends=True)
    return "".join(line if line.startswith("#") else line.removesuffix(" 0\n") + " {}\n" for line in lines)


_EXPORTER_TEMPLATE = _exporter_template()


def render_exporter(open_connections: int, dropped: dict[Dropped, int]) -> bytes:
    """The exporter's own families: what it refused and dropped, and what is open (this scrape's one too).
    One ``str.format`` per scrape: these change between snapshots."""
    return _EXPORTER_TEMPLATE.format(open_connections, *(dropped[reason] for reason in Dropped)).encode()
