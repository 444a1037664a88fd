"""``MetricsPublisher``: the progress thread builds the metrics snapshot the exporter serves, and publishes it.

At most every ``METRICS_PUBLISH_INTERVAL_S`` (real time) the loop copies the counts into one
immutable ``MetricsSnapshot`` and publishes it by assigning one reference: the exporter's
HTTP thread reads that reference and nothing else, so a scrape costs the progress thread
nothing and never sees a table mid-change (architecture §4). Building one is O(pools +
codes + links + sessions), never O(objects): no accounting check here.
"""

from __future__ import annotations

import collections
import time

from kvcr_io import package_version
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Counters, ProtocolErrors
from kvcr_node.leases import Leases
from kvcr_node.links import Links
from kvcr_node.metrics import Metrics, MetricsSnapshot, PoolSnapshot
from kvcr_node.operations import Operations
from kvcr_node.peers import LinkState, WriteStage
from kvcr_node.sessions import Sessions
from kvcr_node.store import Store
from kvcr_node.tiering import Tiering
from kvcr_node.transfers import Transfers
from kvcr_protocol import Role

METRICS_PUBLISH_INTERVAL_S = 0.5
"""How stale a scrape may be; also how often an idle node with an exporter wakes to publish."""


class MetricsPublisher:
    """Builds snapshots from the node's parts (progress thread) and holds the latest one."""

    def __init__(
        self, config: NodeConfig, incarnation: int, protocol_version: int, metrics: Metrics, store: Store,
        operations: Operations, sessions: Sessions, leases: Leases, links: Links, transfers: Transfers,
        counters: Counters, protocol_errors: ProtocolErrors,
    ) -> None:
        self.config = config
        self.incarnation = incarnation
        self.protocol_version = protocol_version
        self.version = package_version()
        self.metrics = metrics
        self.store = store
        self.operations = operations
        self.sessions = sessions
        self.leases = leases
        self.links = links
        self.transfers = transfers
        self.counters = counters
        self.protocol_errors = protocol_errors
        self.memory = {spec.name: spec.memory for spec in config.pools}
        self.tiering: Tiering | None = None
        """The disk tier at work, when the node has disk pools (the node sets it)."""
        self.latest: MetricsSnapshot | None = None
        """The snapshot the exporter serves (replaced whole, never changed)."""
        self._next = 0.0

    def due_in(self) -> float:
        """Seconds until the next snapshot is due (0 when due now)."""
        return max(0.0, self._next - time.monotonic())

    def maybe_publish(self) -> None:
        """Publish a new snapshot if the last one is ``METRICS_PUBLISH_INTERVAL_S`` old."""
        if time.monotonic() >= self._next:
            self.publish()

    def publish(self) -> None:
        """Build a snapshot now and publish it (one reference assigned)."""
        self._next = time.monotonic() + METRICS_PUBLISH_INTERVAL_S
        self.latest = self.build()

    def build(self) -> MetricsSnapshot:
        """A snapshot of everything the exporter serves, as of now."""
        m, store = self.metrics, self.store
        stats = store.stats()
        evictions, objects, writing = stats["evictions"], stats["objects"], stats["writing"]
        assert isinstance(evictions, dict) and isinstance(objects, int) and isinstance(writing, int)
        pools = tuple(
            PoolSnapshot(
                name, self.memory[name], p["slot_size"], p["total"], p["free"], p["evictable"], p["objects"],
                evictions.get(name, 0), m.deposited_keys[name], m.deposited_bytes[name], m.delivered_keys[name],
                m.delivered_bytes[name],
            )
            for name, p in store.pool_stats().items()
        )
        tiering = self.tiering
        tier = tiering.tier if tiering is not None else None
        if tier is not None:  # the disk pools beside the memory ones (architecture §9)
            pools += tuple(
                PoolSnapshot(name, "disk", p["slot_size"], p["total"], p["free"], p["evictable"], p["objects"],
                             0, 0, 0, 0, 0)
                for name, p in tier.disk.pool_stats().items())
        results = [(kind.value, status.value.lower(), code.name if code is not None else "", n)
                   for (kind, status, code), n in self.operations.outcomes.items()]
        states = collections.Counter(link.state.value for link in self.links)
        sessions = list(self.sessions)
        peers = sum(1 for s in sessions if s.role is Role.PEER)
        return MetricsSnapshot(
            node=self.config.name, version=self.version, incarnation=self.incarnation,
            protocol_version=self.protocol_version, lookups=m.lookups, hits=m.hits, pools=pools,
            objects=objects, writing=writing,
            claims=(("handles", len(self.operations.handles)), ("operations", self.operations.claims),
                    ("leases", self.leases.claims), *((("disk_tier", len(tier.demoting)),) if tier is not None else ())),
            leases=len(self.leases.table), clients=len(sessions) - peers, peer_sessions=peers,
            operations_pending=sum(len(s.ops) for s in sessions), transfers_inflight=len(self.transfers.inflight),
            latency=tuple((kind, h.frozen()) for kind, h in m.latency.items()), first_layer=m.first_layer.frozen(),
            results=tuple(sorted(results)), protocol_errors=tuple(sorted(self.protocol_errors.snapshot().items())),
            links=tuple((state.value, states[state.value]) for state in LinkState),
            uncertain_writes=sum(1 for link in self.links for w in link.writes.values()
                                 if w.state is WriteStage.UNCERTAIN),
            counters=tuple(sorted(self.counters.snapshot().items())),
            disk_tier=tuple(sorted(tier.counts.items())) if tier is not None else (),
            disk_copies=len(tier.disk) if tier is not None else 0,
            disk_bytes=tuple(tier.moved_bytes.items()) if tier is not None else (),
            disk_latency=tuple((op, h.frozen()) for op, h in tiering.latency.items()) if tiering is not None else (),
            disk_recovery=tiering.recovery_figures() if tiering is not None else (),
        )
