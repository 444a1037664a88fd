"""What a node reports about itself: statistics, table sizes and the accounting check.

Read-only over the other parts: ``snapshot`` is what ``stats`` answers (and what
operators and soaks read); ``check_invariants`` is the store's invariants plus the
node's (claims match handles and operations; no code sent out of place, spec section 10.1).

The check walks every object and slot, O(objects), on the node's loop: 250 ms at 50,000
objects here, seconds for a million. So a ``stats`` runs it only when it asks (``audit``,
spec section 5.2, "Statistics"): a monitor polling ``stats`` costs the node its counters,
never its cache's size. A session below ``AUDIT_VERSION`` cannot ask, and gets the check on
every ``stats`` as it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcr_io import package_version
from kvcr_node.agents import RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Counters, ProtocolErrors
from kvcr_node.inventory import Inventory
from kvcr_node.leases import Leases
from kvcr_node.metrics import Metrics
from kvcr_node.operations import Operations
from kvcr_node.outbox import Outbox
from kvcr_node.records import Session
from kvcr_node.replays import Replays
from kvcr_node.sessions import Sessions
from kvcr_node.store import Store
from kvcr_node.target import Target
from kvcr_node.transfers import Transfers
from kvcr_protocol import AUDIT_VERSION, ProjectionCache, Role, StatsReply, StatsRequest

if TYPE_CHECKING:
    from kvcr_node.journal import Journal
    from kvcr_node.puts import Puts
    from kvcr_node.tiering import Tiering


class Stats:
    """The ``stats`` handler, ``snapshot`` and ``check_invariants``."""

    def __init__(
        self, config: NodeConfig, incarnation: int, versions: Sequence[int], store: Store, sessions: Sessions,
        operations: Operations, target: Target, leases: Leases, transfers: Transfers, agents: RemoteAgents,
        projections: ProjectionCache, outbox: Outbox, counters: Counters,
        protocol_errors: ProtocolErrors, metrics: Metrics,
    ) -> None:
        self.config = config
        self.incarnation = incarnation
        self.versions = versions
        self.store = store
        self.sessions = sessions
        self.operations = operations
        self.target = target
        self.leases = leases
        self.transfers = transfers
        self.agents = agents
        self.projections = projections
        self.outbox = outbox
        self.counters = counters
        self.protocol_errors = protocol_errors
        self.metrics = metrics
        self.version = package_version()
        """Read once: the installed distribution's metadata costs a lookup on the progress thread."""
        self.memory = {spec.name: spec.memory for spec in config.pools}
        self.inventory: Inventory | None = None
        """The inventory event stream's state, when the node publishes one."""
        self.replays: Replays | None = None
        """Its replay requesters and their answers in progress."""
        self.puts: Puts | None = None
        """The node's puts (spec section 6.13), once wired."""
        self.recovery: dict[str, Any] | None = None
        """What the node took back at its start from its state directory (architecture §8)."""
        self.journal: Journal | None = None
        self.tiering: Tiering | None = None
        """The disk tier at work (architecture §9), when the node has disk pools."""

    def on_stats(self, session: Session, msg: StatsRequest) -> None:
        audit = msg.audit or session.version < AUDIT_VERSION
        self.outbox.reply(session, StatsReply(msg.id, self.snapshot(audit=audit)))

    def snapshot(self, *, audit: bool = False) -> dict[str, Any]:
        """Statistics; with ``audit``, also the accounting check's breaches under
        ``invariants`` (O(objects)). Without it ``invariants`` is absent: not checked."""
        store = self.store.stats()
        policy = self.store.policy
        sessions = list(self.sessions)
        return {
            "node": self.config.name,
            "version": self.version,
            "incarnation": self.incarnation,
            "protocol_version": self.versions[-1],
            "pools": {name: {**pool, "memory": self.memory.get(name, "dram")} for name, pool in self.store.pool_stats().items()},
            "objects": store["objects"],
            "ready": store["ready"],
            "writing": store["writing"],
            "condemned": store["condemned_claimed"],
            "evictions": store["evictions"],
            "lookups": {"keys": self.metrics.lookups, "hits": self.metrics.hits},
            "claims": {
                "total": store["claims"],
                "handles": len(self.operations.handles),
                "operations": self.operations.claims,
                "leases": self.leases.claims,
            },
            "leases": self.leases.stats(),
            "puts": self.puts.put_stats() if self.puts is not None else {},
            "clients": sum(1 for s in sessions if s.role is Role.CLIENT),
            "operations_pending": sum(len(s.ops) for s in sessions),
            "transfers": self.transfers.stats(),
            "peers": self.target.links.stats(),
            "peer_sessions": sum(1 for s in sessions if s.role is Role.PEER),
            "outcomes": self.operations.outcome_counts(),
            "protocol_errors": self.protocol_errors.snapshot(),
            "counters": self.counters.snapshot(),
            "projection_cache": {"size": len(self.projections), "hits": self.projections.hits, "misses": self.projections.misses},
            "policy": {"name": policy.name, "failures": getattr(policy, "failures", 0)},
            "tables": self.table_sizes(),
            **({"invariants": self.check_invariants()} if audit else {}),
            **({"recovery": self.recovery} if self.recovery is not None else {}),
            **({"journal": self.journal.stats()} if self.journal is not None else {}),
            **({"disk_tier": self.tiering.stats()} if self.tiering is not None else {}),
        }

    def table_sizes(self) -> dict[str, int]:
        """Entries in the node's per-session and per-peer tables, for soaks and operators."""
        sessions = self.sessions
        peers = [s.peer for s in (*sessions, *sessions.retired) if s.peer is not None]
        clients = sessions.clients()
        return {
            "sessions": len(sessions),
            "retired_sessions": len(sessions.retired),
            "handles": len(self.operations.handles),
            "waiters": len(self.operations.waiters),
            **self.target.links.sizes(),
            "peer_clients": sum(len(s.clients) for s in peers),
            **self.agents.sizes(),
            "hints": sum(len(s.hints) for s in clients),
            "hinted_keys": sum(s.hinted_keys for s in clients),
            "withdrawals": sum(len(s.withdrawals) for s in clients),
            "reserved_writes": len(self.target.reservations),
            "suspects_at_sources": sum(s.suspects_at_sources for s in clients),
            **self.leases.sizes(),
            **(self.puts.sizes() if self.puts is not None else {}),
            **(self.inventory.sizes() if self.inventory is not None else {}),
            **(self.replays.sizes() if self.replays is not None else {}),
            **({"journal_held": len(self.journal.held)} if self.journal is not None else {}),
        }

    def check_invariants(self) -> list[str]:
        """The store's invariants plus the node's: claims match handles and live operations."""
        breaches = self.store.check_invariants()
        # Objects being copied to the disk tier are claimed by it (architecture §9).
        copying = len(self.tiering.tier.demoting) if self.tiering is not None else 0
        breaches.extend(self.operations.check_invariants(self.leases.claims + copying))
        if self.tiering is not None:
            breaches.extend(self.tiering.tier.check_invariants())
        breaches.extend(self.leases.check_invariants())
        if self.puts is not None:
            breaches.extend(self.puts.check_invariants())
        for what, n in self.outbox.undeclared_codes.items():
            breaches.append(f"sent a code spec section 10.1 does not list ({what}) {n} times")
        return breaches
