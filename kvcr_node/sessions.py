"""Per-client state on a node: identity, NIXL agent, regions, handles, operations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcr_node.transfers import Transfer
from kvcr_protocol import KeyResult, KeyStatus, Region


@dataclass
class ClientSession:
    """One client that said hello on the node's ROUTER socket."""

    identity: bytes
    name: str
    agent: str
    version: int
    regions: dict[int, Region] = field(default_factory=dict)
    handles: set[int] = field(default_factory=set)
    ops: dict[int, Operation] = field(default_factory=dict)
    closing: bool = False


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
    aborted: bool = False

    def set(self, index: int, result: KeyResult) -> None:
        if self.results[index] is None:
            self.results[index] = result

    def fail(self, index: int, code: int, reason: str) -> None:
        self.set(index, KeyResult(KeyStatus.FAILED, code, reason))

    @property
    def settled(self) -> bool:
        """Every item has a result and no transfer of this op can touch memory any more."""
        return not self.waiting and all(t.state != "PROC" for t in self.transfers) and all(
            r is not None for r in self.results
        )
