"""Sources' read grants passed on to clients (spec section 6.12, "Across nodes").

A client's read lease of keys its hint sends to a source asks that source for a grant too
(``!read`` on the target's own peer-session ``lease``; ``!node_md`` while this node has no
agent of the source's incarnation cached). The source's rows name its own pools; the
target passes them on to the client with a source table (``LeaseGrant.source`` and
``sources``) so the client READs from the source's agent directly. ``SourceGrants`` owns
the sources' agents as last granted (one per endpoint, for the incarnation that sent it)
and lays out what a client gets (``Session.grant_sources``: which it was given already).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcr_node.grants import Row
from kvcr_node.records import Session
from kvcr_protocol import DEFAULT_LIMITS, GrantNode, GrantSource, LeaseGrant, ProtocolError, packed_grant_columns
from kvcr_protocol.columns import U32, pack

MAX_SOURCE_AGENTS = 1024
"""Sources' agents kept at most (one per endpoint); the oldest goes first, and its next
lease asks for its agent again."""
SourceRow = tuple[str, int, Row]
"""A key's row at a source: the source's endpoint and incarnation, and the row there."""


class SourceGrants:
    """The sources' agents (endpoint -> incarnation and ``GrantNode``) and the rows they grant."""

    def __init__(self) -> None:
        self.agents: dict[str, tuple[int, GrantNode]] = {}

    def sizes(self) -> dict[str, int]:
        """For the node's ``tables``: sources' agents cached (at most ``MAX_SOURCE_AGENTS``)."""
        return {"source_grant_agents": len(self.agents)}

    def wants_node(self, endpoint: str, incarnation: int) -> bool:
        """Whether a lease asked of the source should ask for its agent (``!node_md``)."""
        cached = self.agents.get(endpoint)
        return cached is None or cached[0] != incarnation

    def rows(self, endpoint: str, incarnation: int, grant: LeaseGrant | None, count: int) -> dict[int, tuple[Row, bytes]]:
        """The rows of a source's grant to this node, by position in the keys asked (``count``
        of them), each with the source's digests of its spans (empty: none); none when there
        is no grant, no agent of that incarnation to read them with, or rows that name pools
        its agent lacks. A source passes on no one else's."""
        if grant is None or grant.source:
            return {}
        node = grant.node
        if node is not None:
            if len(node.slot_size) == 4 * len(node.pools) and all(r.region == i for i, r in enumerate(node.pools)):
                self.agents.pop(endpoint, None)
                if len(self.agents) >= MAX_SOURCE_AGENTS:
                    del self.agents[next(iter(self.agents))]
                self.agents[endpoint] = (incarnation, node)
        cached = self.agents.get(endpoint)
        if cached is None or cached[0] != incarnation:
            return {}
        pools = len(cached[1].pools)
        out: dict[int, tuple[Row, bytes]] = {}
        at = 0
        try:
            for k, names, pool, slots in grant.keys(DEFAULT_LIMITS):
                digests = grant.digest[8 * at:8 * (at + len(names))]
                at += len(names)
                if k < count and max(pool, default=0) < pools:
                    out[k] = ((names, bytes(pool), pack(slots, U32)), digests)
        except ProtocolError:
            return {}
        return out

    def columns(
        self, session: Session, local: Sequence[Row], remote: Mapping[int, SourceRow], node: GrantNode | None,
        max_spans: int = DEFAULT_LIMITS.max_spans,
    ) -> LeaseGrant:
        """The grant a client gets: its local rows, and the sources' rows in place of 0 for
        the keys held there, within ``max_spans`` in all; each source's agent goes with the
        first grant of it to the session, or with every one that asked for the node's
        (``!node_md``: the client has nothing cached)."""
        rows = list(local)
        spans = sum(len(row[0]) for row in rows if row is not None)
        source = [0] * len(rows)
        table: dict[tuple[str, int], int] = {}
        given = session.grant_sources
        sources: list[GrantSource] = []
        for i in sorted(remote):
            endpoint, incarnation, row = remote[i]
            cached = self.agents.get(endpoint)
            if row is None or rows[i] is not None or cached is None or cached[0] != incarnation:
                continue
            if spans + len(row[0]) > max_spans:
                continue
            spans += len(row[0])
            name = (endpoint, incarnation)
            if name not in table:
                send = node is not None or name not in given
                sources.append(GrantSource(endpoint, incarnation, cached[1] if send else None))
                given.add(name)
                table[name] = len(sources)
            rows[i] = row
            source[i] = table[name]
        return packed_grant_columns(rows, node, source, tuple(sources))
