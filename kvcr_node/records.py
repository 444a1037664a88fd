"""The records the parts of a node share: client and peer sessions, withdrawals, operations.

Plain data: the module that owns each table changes its records (``kvcr_node.sessions``
the sessions, ``kvcr_node.operations`` the operations; architecture §1).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcr_node.transfers import Transfer
from kvcr_protocol import KeyResult, KeyStatus, Region

Hint = tuple[str, frozenset[bytes]]
"""A hint: the source endpoint, and the keys it may hold."""

RECENT_WRITES = 4096
"""Completed peer writes a source remembers, to answer probes with DONE."""


@dataclass
class Withdrawal:
    """An ``unregions`` whose ack waits: a source may still write into its regions.

    The regions are withdrawn at once (new spans in them fail), and put back if the
    client aborts the request.
    """

    regions: tuple[int, ...]
    """The region ids the request names."""
    records: dict[int, Region]
    """Those the session had announced, as they were."""


@dataclass
class ClientSession:
    """One client that said hello on the node's ROUTER socket."""

    identity: bytes
    name: str
    agent: str
    version: int
    agent_md: bytes = b""
    regions: dict[int, Region] = field(default_factory=dict)
    regions_version: int = 0
    """Bumped whenever ``regions`` or ``agent_md`` change, so peers get them again."""
    handles: set[int] = field(default_factory=set)
    ops: dict[int, Operation] = field(default_factory=dict)
    closing: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    events: int = 0
    """Capacity events sent in this session (their ids count from 1)."""
    withdrawals: dict[int, Withdrawal] = field(default_factory=dict)
    """``unregions`` requests whose ack is held, by request id (spec section 5.2)."""
    hints: dict[str, Hint] = field(default_factory=dict)
    """This session's hints by request id (spec section 5.2): no other session sees them."""
    hinted_keys: int = 0
    """Keys summed over ``hints`` (bounded by the node's ``max_hinted_keys_per_session``)."""

    def forget_hints(self) -> None:
        """Drop every hint (bye or expiry: hints end with their session)."""
        self.hints.clear()
        self.hinted_keys = 0


@dataclass
class PeerSession(ClientSession):
    """A target node that opened a peer session with this (source) node.

    ``regions`` are the target's pools; ``clients`` the regions of the target's clients
    that this node may write into, by their agent name.
    """

    incarnation: int = 0
    clients: collections.OrderedDict[str, dict[int, Region]] = field(default_factory=collections.OrderedDict)
    """Announced client agent -> its regions, least recently used first (bounded by the node)."""
    done: collections.OrderedDict[int, None] = field(default_factory=collections.OrderedDict)

    def remember_done(self, op_id: int) -> None:
        self.done[op_id] = None
        while len(self.done) > RECENT_WRITES:
            self.done.popitem(last=False)


@dataclass
class Operation:
    """One batch request in progress: a result slot per item, transfers, waits."""

    session: ClientSession
    id: int
    kind: str
    deadline: float
    results: list[KeyResult | None]
    transfers: list[Transfer] = field(default_factory=list)
    waiting: dict[bytes, list[int]] = field(default_factory=dict)
    """Keys still WRITING that items wait on (key -> item indices)."""
    resume: Callable[[int], None] | None = None
    """Continues one waiting item once its key is READY (or gone)."""
    report: Callable[[tuple[KeyResult, ...]], None] | None = None
    """Sends the results when they do not go back as a client's ``complete`` (a peer write's
    ``write_done``); called once, when the operation settles."""
    aborted: bool = False
    agent: str = ""
    """The agent whose memory the transfers touch (the client's, or a peer write's target)."""
    regions: dict[int, Region] = field(default_factory=dict)
    """The regions destination spans are checked against."""
    exact: bool = False
    """Destination names must equal the stored layout (a peer write without ``!partial``)."""
    remote: int = 0
    """Remote writes sent to peers for this operation and not yet answered."""
    broken: str | None = None
    """Why handling it failed unexpectedly: items no transfer or write covers then fail
    ``INTERNAL`` with this reason once nothing of the operation runs any more."""

    def set(self, index: int, result: KeyResult) -> None:
        if self.results[index] is None:
            self.results[index] = result

    def fail(self, index: int, code: int, reason: str) -> None:
        self.set(index, KeyResult(KeyStatus.FAILED, code, reason))

    @property
    def settled(self) -> bool:
        """Every item has a result (or the op is broken) and no transfer of it can touch memory any more."""
        return (
            not self.waiting
            and not self.remote
            and not any(t.running for t in self.transfers)
            and (self.broken is not None or all(r is not None for r in self.results))
        )

    def fail_unresolved(self, code: int) -> None:
        """Fail every item that has no result yet (a broken op, once nothing of it runs)."""
        for i, result in enumerate(self.results):
            if result is None:
                self.fail(i, code, self.broken or "failed")
