"""What one session with the node owns, in one place (spec section 5.2).

A ``SessionScope`` is made when a hello is sent and dropped whole when the next one is sent
or the client closes: the token its planned delivers' notifications carry, its leases, the
keys their grants let this client READ, the node's and sources' agents as loaded for it,
and what its node refused (puts, integrity reports). Nothing in it outlives the session,
so nothing is cleared by hand, and "the same session" is ``scope is current``: a reply for
an older session (a lease answered after a reconnect) finds its scope gone and adds nothing.
What does outlive a session stays with its part: node agents still loaded while a READ of
an older session runs on them (``Grants``), counters (``kvcr_client.counters``). The records
a scope holds are declared here too (a granted key, an agent as loaded, its pools), so that
the parts that fill them import this module and it imports none of them.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvcr_client.leases import LeaseHandle
from kvcr_client.readplans import RemoteSpans
from kvcr_protocol import MemoryKind

PRUNE_SLACK = 1024
"""Granted keys of ended leases tolerated in a scope's table before it is swept."""


def new_token() -> int:
    """A notification token: nonzero, and unlike the last session's (a late notification of
    an old session matches nothing)."""
    return secrets.randbits(32) or 1


@dataclass(frozen=True, slots=True)
class GrantedKey:
    """One key a lease lets this client READ: its stored span names, per span its pool (an
    index into the pools of ``agent``, the node's or a source's) and slot, and where that
    slot is (``remote``: address, slot size, memory kind, device; worked out once, when the
    grant arrives, so that planning a READ costs one lookup per span)."""

    lease: LeaseHandle
    names: tuple[str, ...]
    pools: bytes
    slots: tuple[int, ...]
    agent: NodeAgent
    remote: RemoteSpans
    digests: bytes = b""
    """One u64 per stored span (``kvcr_io.digests``), 0 where unchecked; empty: none."""

    @property
    def peer(self) -> str:
        """The remote agent its READs name."""
        return self.agent.name


@dataclass(frozen=True, slots=True)
class NodePool:
    """Where one of the node's pools is, as its registration says."""

    kind: MemoryKind
    device: int
    address: int
    slot_size: int


@dataclass(frozen=True, slots=True)
class NodeAgent:
    """The node's agent (or a source's) as loaded into ours for one session (it lives in
    that session's ``SessionScope``); ``grace_s``, the shortest grace period its grants'
    validity depends on."""

    name: str
    pools: tuple[NodePool, ...]
    grace_s: float


@dataclass(eq=False)
class SessionScope:
    """One session's state on the client side; ``SessionScope()`` for each hello."""

    token: int = field(default_factory=new_token)
    """Carried by this session's planned delivers (``progress`` notifications)."""
    leases: dict[int, LeaseHandle] = field(default_factory=dict)
    """The leases the node granted this session, by id, until they end."""
    granted: dict[bytes, GrantedKey] = field(default_factory=dict)
    """Key -> the grant that lets this client READ it (spec section 6.12)."""
    sweep_at: int = PRUNE_SLACK
    """``granted``'s size at which keys of ended leases are swept out."""
    node: NodeAgent | None = None
    """The node's agent, loaded from the first grant that carried it."""
    node_loading: Future[None] | None = None
    """The node's agent being loaded (``kvcr_client.agent_loads``): what needs it waits on this."""
    sources: dict[tuple[str, int], NodeAgent] = field(default_factory=dict)
    """Sources' agents loaded for this session, by (endpoint, incarnation), least recently used first."""
    sources_loading: dict[tuple[str, int], Future[None]] = field(default_factory=dict)
    """Sources' agents being loaded, by (endpoint, incarnation)."""
    puts_refused: bool = False
    """The node refused ``put`` (it grants no writes): deposit instead."""
    reports_refused: bool = False
    """The node refused ``suspect`` (it predates it): report nothing more."""


class CurrentScope:
    """The scope of the session last opened; called, it returns it. ``renew`` replaces it
    whole (a hello goes, or the client closes) and returns the one that ended. The parts
    that keep state for a session hold this, never the client."""

    def __init__(self) -> None:
        self.scope = SessionScope()

    def __call__(self) -> SessionScope:
        return self.scope

    def renew(self) -> SessionScope:
        ended, self.scope = self.scope, SessionScope()
        return ended
