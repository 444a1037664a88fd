"""What one client holds across its operations, and what can be read of it.

``ClientState`` owns a client's session core (``ClientCore``), its ``RegionTable``, the
completion queue ``poll_completed`` drains, the session's scope (token, leases, grants:
``kvcr_client.session_scope``), its counters and the parts that act on them (``Grants``,
``Sender``); it opens each session (``_hello``) and drops the last one's scope whole. The
requests themselves are ``LeaseRequests`` and ``Operations``, built on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

from kvcr_client import spans as _spans
from kvcr_client.completions import Completions
from kvcr_client.core import ClientCore
from kvcr_client.counters import Count, Counters
from kvcr_client.grants import Grants, GrantsView
from kvcr_client.puts import Puts
from kvcr_client.regions import RegionTable
from kvcr_client.results import GroupDone, OpHandle
from kvcr_client.sender import Sender
from kvcr_client.session_scope import CurrentScope
from kvcr_client.spans import Destination, Span
from kvcr_client.uncertain import UncertainDestinations
from kvcr_protocol import PoolInfo, Welcome

DEFAULT_MAX_COMPLETED = 8192
"""Completed operations kept for ``poll_completed`` at most; older ones are dropped and counted."""


class ClientState:
    """A client's session core, tables and counters, and the views of them."""

    core: ClientCore
    core_class: ClassVar[type[ClientCore]] = ClientCore
    """The session core a client runs on; a subclass may name a subclass of it (tests do, to lose notifications)."""
    _puts: Puts
    """The client's puts (made by ``Operations``, whose ``deposit`` they fall back to)."""

    def __init__(self, core: ClientCore, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        self.core = core
        self._regions = RegionTable(core)
        self._completions = Completions(max_completed)
        self._scope = CurrentScope()
        """What the session owns (``kvcr_client.session_scope``): its notification token (spec
        section 6.10), its live leases by id (so that the node's ``lease_end`` reaches their
        handles), its grants; replaced whole at each hello and at close."""
        self._counters = Counters()
        self._uncertain = UncertainDestinations()
        """Destination spans a READ past its deadline may still write: no deliver into them,
        no deposit or put from them, until it ended (``kvcr_client.uncertain``)."""
        self._grants = Grants(core, self._counters, self._scope, self._uncertain.hold)
        """The slots leases granted this session, read by ``deliver`` (spec section 6.12)."""
        self._send = Sender(core, self._regions, self._completions, self._grants)

    def poll_completed(self) -> list[OpHandle[Any] | GroupDone]:
        """The operations that completed since the last call, for engines that poll once per step.

        A deliver with a layer plan also reports each group as it ends for every key
        (``GroupDone``: delivered or failed), in group order, before its handle.

        The first call says that the engine polls: completions are queued from then on,
        only for handles nobody waited on (``result``) or awaited, and at most
        ``max_completed`` of them (the oldest are dropped beyond, counted in
        ``completed_dropped``). An engine that waits on or awaits its handles, and never
        calls this, keeps no queue at all.
        """
        self._completions.polling = True
        self.core.poll()
        return self._completions.drain()

    @property
    def completed_dropped(self) -> int:
        """Completions dropped from the full ``poll_completed`` queue (``max_completed``)."""
        return self._completions.dropped

    def tables(self) -> dict[str, int]:
        """Sizes of the client's tables (for monitoring, and churn tests that check nothing grows)."""
        return {**self.core.tables(), "completed": len(self._completions), "regions": len(self._regions),
                "leases": len(self._scope().leases), "granted_keys": len(self._grants),
                "agent_loads": self._grants.loads.pending, "uncertain_held": len(self._uncertain),
                "uncertain_node": self._uncertain.node_held}

    def grants(self) -> GrantsView:
        """What this client READs itself in its current session (spec section 6.12): the
        node's agent as loaded, the sources', agents of ended sessions still loaded, and each
        key under a live lease's read grant (its lease, the agent its READs name, whether
        digests check it). A snapshot, taken in a turn of the I/O lock."""
        grants = self._grants
        return self.core.locked(grants.view)

    def counters(self) -> dict[str, int]:
        """What this client counted, every counter by name (``kvcr_client.counters.Count``):
        delivers read under grants, spans checked against digests, mismatches, puts and
        their fallbacks."""
        return {count.value: self._counters[count] for count in Count}

    @property
    def grant_reads(self) -> int:
        """Delivers this client served by READs under read grants (spec section 6.12)."""
        return self._counters[Count.GRANT_READS]

    @property
    def pools(self) -> dict[str, PoolInfo]:
        welcome = self.core.welcome
        return {p.name: p for p in welcome.pools} if welcome else {}

    @property
    def node(self) -> Welcome | None:
        """The node's welcome: its name, incarnation, version and pools."""
        return self.core.welcome

    def destination(self, spans: Sequence[Span]) -> Destination:
        """Destination spans checked once, for delivering into the same memory again and again.

        ``deliver`` takes a ``Destination`` wherever it takes a sequence of ``Span``, and
        then does no per-span work. It stays valid while its regions stay registered.
        """
        return _spans.destination(spans, self, self._regions.by_id)

    def _hello(self, timeout_s: float) -> Future[Any]:
        """Open a session (again), announcing every registered region."""
        self._end_session()
        # The previous session ends at once, its puts freed, unless a WRITE of a put may
        # still land (spec section 5.2): then it ends as the node finds it gone.
        return self.core.hello(self._regions.wires(), timeout_s, resume=self._puts.quiet())

    def _end_session(self) -> None:
        """The session's scope goes whole: a new token (a late notification of the old session
        matches nothing), its leases (their handles say NODE_LOST), its grants."""
        self._grants.retire(self._scope.renew())
