"""Clients that left, told to the sources that knew them (``peer_forget``, spec section 5.3,
version 5).

``ClientForgets`` is the part of ``Links`` (``kvcr_node.links``) that, when a client's
session ends, stops announcing it on every link and sends each source that may know it a
``peer_forget`` once no write for the client runs there any more.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvcr_node.counters import Count, Counters
from kvcr_node.peers import LinkState, PeerLink
from kvcr_protocol import Message, PeerForget
from kvcr_protocol.versions import CLIENT_GONE_VERSION


class ClientForgets:
    """Departed clients and the ``peer_forget`` messages for them (mixed into ``Links``)."""

    counters: Counters
    _ids: itertools.count[int]

    def __iter__(self) -> Iterator[PeerLink]:
        raise NotImplementedError

    def _send(self, link: PeerLink, msg: Message) -> bool:
        raise NotImplementedError

    def forget_client(self, agent: str) -> None:
        """A client's session ended: no link announces it any more (it is announced afresh if
        it returns), and each source that may know it is told so, once nothing of the client
        can still run there (``peer_forget``, spec section 5.3, version 5)."""
        for link in self:
            known = link.clients_sent.pop(agent, None) is not None
            for announce_id in [i for i, a in link.announcing.items() if a == agent]:
                del link.announcing[announce_id]
                known = True
            if known or any(w.agent == agent and w.client is not None for w in (*link.writes.values(), *link.queued)):
                link.forgets.add(agent)
                self._send_forgets(link)

    def _send_forgets(self, link: PeerLink) -> None:
        """Send ``peer_forget`` for each client that left and that no write on ``link`` names
        any more (sent, queued or uncertain: the message follows every write for the client
        on the connection), once the session is up (spec section 5.3). A session below
        version 5 carries none: the source bounds its table itself (``max_peer_clients``)."""
        if not link.forgets or link.state is not LinkState.READY or link.closed:
            return
        if link.version < CLIENT_GONE_VERSION:
            for agent in link.forgets:
                link.clients_sent.pop(agent, None)  # a queued write of the client announced it again
            link.forgets.clear()
            return
        running = {w.agent for w in (*link.writes.values(), *link.queued) if w.client is not None}
        for agent in sorted(link.forgets - running):
            if not self._send(link, PeerForget(next(self._ids), agent)):
                return  # the socket is full: the next check tries again
            link.forgets.discard(agent)
            link.clients_sent.pop(agent, None)
            self.counters.inc(Count.PEER_FORGETS_SENT)
