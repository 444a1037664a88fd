"""Two spellings of one source's endpoint, one link (spec section 5.3, "Twin links").

``TwinLinks`` is the part of ``Links`` (``kvcr_node.links``) that, when a version-5 source
proves that a newly welcomed link reaches it as another link does (``peer_welcome.twins``,
checked with ``kvcr_protocol.twins``), folds the newer link into the older: its spellings
become aliases of the older link (at most ``max_peers``, oldest dropped first), its queued
writes and lease requests go there, and it closes once what was sent on it is over
(``draining``). An incarnation alone (statistics show it to anyone) proves nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters
from kvcr_node.peers import Ask, LinkState, PeerLink, RemoteWrite, WriteStage
from kvcr_protocol.twins import proves_twin
from kvcr_protocol.versions import GRANTS_VERSION

log = logging.getLogger("kvcr.node")


class TwinLinks:
    """Aliases of links, and the folding of twin links (mixed into ``Links``)."""

    config: NodeConfig
    counters: Counters
    clock: Callable[[], float]
    by_endpoint: dict[str, PeerLink]
    aliases: dict[str, str]
    draining: list[PeerLink]

    if TYPE_CHECKING:  # the other parts of ``Links`` (a stub here would hide them at run time)

        def submit(self, write: RemoteWrite) -> None: ...

        def _send_ask(self, link: PeerLink, ask: Ask) -> None: ...

        def retire(self, link: PeerLink) -> None: ...

    def _twin_of(self, link: PeerLink) -> PeerLink | None:
        """Another link, up, that the source proved reaches the same process as ``link`` (spec
        section 5.3, "Twin links"): in ``link``'s welcome when the other's hello reached the
        source first, else in the other's. An incarnation alone (statistics show it) is no proof."""
        if not link.token or link.version < GRANTS_VERSION:
            return None
        for other in self.by_endpoint.values():
            if (other is link or other.state is not LinkState.READY or other.incarnation != link.incarnation
                    or other.version < GRANTS_VERSION or not other.token):
                continue
            if proves_twin(link.twins, other.token, link.token) or proves_twin(other.twins, link.token, other.token):
                return other
        return None

    def _fold(self, link: PeerLink) -> bool:
        """Make ``link``'s spellings aliases of its twin, hand its queued requests over, and
        close it once what was sent on it is over; False (not now) while it has lease
        requests or leases at the source, which belong to its own peer session there."""
        twin = link.twin
        if twin is None or link.draining:
            return False
        if (twin.closed or self.by_endpoint.get(twin.endpoint) is not twin or twin.state is not LinkState.READY
                or twin.incarnation != link.incarnation):
            link.twin = None  # the twin went (closed, or its source restarted): nothing to fold into
            return False
        if link.leases or link.asks or link.abandoned:
            return False  # folded once they are over (``check``)
        link.twin = None
        spellings = [link.endpoint, *link.aliases]
        link.aliases.clear()
        if self.by_endpoint.get(link.endpoint) is link:
            del self.by_endpoint[link.endpoint]
        for spelling in spellings:
            self._alias(spelling, twin)
        twin.last_used = self.clock()
        queued, link.queued = link.queued, []
        for write in queued:
            if write.state is WriteStage.QUEUED:
                write.link = twin
                self.submit(write)
        asks, link.asks_queued = link.asks_queued, []
        for ask in asks:
            self._send_ask(twin, ask)
        self.counters.inc(Count.LINKS_FOLDED)
        log.info("the link to %s (%s) reaches the same source as %s: one link for both", link.node, link.endpoint,
                 twin.endpoint)
        if link.busy:
            # Writes sent on it run to their end there (answers, probes); nothing new joins them.
            link.draining = True
            self.draining.append(link)
        else:
            self.retire(link)
        return True

    def _alias(self, spelling: str, link: PeerLink) -> None:
        """Requests for ``spelling`` go through ``link`` from now on (at most ``max_peers``
        aliases: the oldest is dropped, and its next request opens a link that folds again)."""
        self.aliases.pop(spelling, None)
        self.aliases[spelling] = link.endpoint
        link.aliases.add(spelling)
        while len(self.aliases) > self.config.max_peers:
            oldest, endpoint = next(iter(self.aliases.items()))
            del self.aliases[oldest]
            owner = self.by_endpoint.get(endpoint)
            if owner is not None:
                owner.aliases.discard(oldest)
            self.counters.inc(Count.LINK_ALIASES_DROPPED)

    def link_of(self, endpoint: str) -> PeerLink | None:
        """The open link that requests for ``endpoint`` (as spelled) go through, if any."""
        link = self.by_endpoint.get(endpoint)
        if link is None and (target := self.aliases.get(endpoint)) is not None:
            link = self.by_endpoint.get(target)
        return link

    def canonical(self, endpoint: str) -> str:
        """The endpoint of the link requests for ``endpoint`` go through (itself when none other)."""
        return self.aliases.get(endpoint, endpoint)
