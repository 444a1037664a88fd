"""What the progress thread counts for the metrics exporter, and the snapshot it publishes.

The counting is plain ints and fixed-bucket arrays owned by the progress thread: an
observation is one ``bisect`` and one increment, with no lock and no Prometheus object on
the request path. Counts kept elsewhere already (operation outcomes, refusals by code, the
node's event counters, the store's evictions) are not counted again here: the publisher
(``kvcr_node.metrics_publisher``) copies them into the snapshot. The exporter thread
(``kvcr_node.exporter``) only ever reads a published ``MetricsSnapshot`` (architecture §4).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvcr_node.counters import Count

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
"""Upper bounds of the latency buckets (seconds): 100 us (a local query) to the default
30 s operation deadline."""

TIMED_REQUESTS = ("query", "deposit", "deliver", "fetch")
"""Requests whose time from receipt to reply is observed."""


class Histogram:
    """Counts per fixed bucket (the last counts values above every bound) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are upper-inclusive: a value equal to a bound falls in its bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def frozen(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment: per-bucket (not cumulative) counts and the sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(``le`` label, observations at or under it) per bucket, ``+Inf`` last."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*(repr(b) for b in self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


class Metrics:
    """The counts the request path adds to (progress thread only), timed on the node's clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lookups = 0
        """Keys named in queries."""
        self.hits = 0
        """Of those, keys answered ``hit`` (READY here)."""
        self.deposited_keys: collections.Counter[str] = collections.Counter()
        """Pool -> objects committed with spans in it."""
        self.deposited_bytes: collections.Counter[str] = collections.Counter()
        self.delivered_keys: collections.Counter[str] = collections.Counter()
        """Pool -> keys delivered whole from it (to clients, or to a target's client for a peer)."""
        self.delivered_bytes: collections.Counter[str] = collections.Counter()
        """Pool -> bytes written out of it by transfers that succeeded."""
        self.latency = {kind: Histogram() for kind in TIMED_REQUESTS}
        """Request kind -> seconds from receipt to reply."""
        self.first_layer = Histogram()
        """Seconds from a deliver's receipt to the end of its first transfer that landed: the
        first group of a layer plan, the whole transfer of a deliver without one."""

    def request_done(self, kind: str, received: float) -> None:
        """A request of ``kind`` received at ``received`` (node clock) is answered now."""
        histogram = self.latency.get(kind)
        if histogram is not None:
            histogram.observe(max(0.0, self.clock() - received))

    def first_landed(self, received: float) -> None:
        self.first_layer.observe(max(0.0, self.clock() - received))

    def deposited(self, pools: Iterable[tuple[str, int]], slot_size: Callable[[str], int]) -> None:
        """One object committed: ``pools`` are its (pool, slots) pairs."""
        for pool, slots in pools:
            self.deposited_keys[pool] += 1
            self.deposited_bytes[pool] += slots * slot_size(pool)

    def delivered_key(self, pools: Iterable[tuple[str, int]]) -> None:
        for pool, _ in pools:
            self.delivered_keys[pool] += 1


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool's capacity and use, and what moved in and out of it."""

    name: str
    memory: str
    slot_size: int
    slots: int
    free: int
    evictable: int
    objects: int
    evictions: int
    deposited_keys: int
    deposited_bytes: int
    delivered_keys: int
    delivered_bytes: int

    @property
    def used_bytes(self) -> int:
        return (self.slots - self.free) * self.slot_size


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the exporter serves, copied by the progress thread; never changed after."""

    node: str
    version: str
    incarnation: int
    protocol_version: int
    lookups: int
    hits: int
    pools: tuple[PoolSnapshot, ...]
    objects: int
    writing: int
    claims: tuple[tuple[str, int], ...]
    """(kind, claims held): handles, operations, leases."""
    leases: int
    clients: int
    peer_sessions: int
    operations_pending: int
    transfers_inflight: int
    latency: tuple[tuple[str, HistogramSnapshot], ...]
    first_layer: HistogramSnapshot
    results: tuple[tuple[str, str, str, int], ...]
    """(operation, status, code or "", keys) per key result sent."""
    protocol_errors: tuple[tuple[str, int], ...]
    links: tuple[tuple[str, int], ...]
    """(state, links) for every link state."""
    uncertain_writes: int
    counters: tuple[tuple[str, int], ...]
    """The node's event counters (auth refusals, internal errors, ...), by name (``Count`` values)."""
    disk_tier: tuple[tuple[str, int], ...] = ()
    """The disk tier's moves by outcome (``DiskTier.counts``); empty without disk pools."""
    disk_copies: int = 0
    """Copies the disk tier holds."""
    disk_bytes: tuple[tuple[str, int], ...] = ()
    """Bytes copied to the disk tier (``demoted``) and read back (``promoted``)."""
    disk_latency: tuple[tuple[str, HistogramSnapshot], ...] = ()
    """Seconds per transfer of the disk tier, by ``write`` and ``read``."""
    disk_recovery: tuple[tuple[str, int], ...] = ()
    """Copies taken back at start (``recovered``), and records dropped (``dropped_REASON``)."""

    def counter(self, count: Count) -> int:
        return dict(self.counters).get(count.value, 0)
