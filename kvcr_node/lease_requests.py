"""Lease requests a target sends its sources on their links (spec section 6.11).

``LeaseRequests`` is the part of ``Links`` (``kvcr_node.links``) that sends ``lease``,
``renew`` and ``unlease`` (and readers' reports passed on, ``suspect``: spec section 6.12)
on a link once its session is up, matches their answers, gives
up those a source leaves unanswered (releasing what a late answer leased), bounds what
they may hold per link, and tracks the leases each source holds for this node, telling
the ``LeaseOwner`` when a source loses them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_node.counters import Count, Counters
from kvcr_node.peers import Answer, Ask, LeaseOwner, LinkState, PeerLink
from kvcr_protocol import Ack, Completion, Error, ErrorCode, Lease, LeaseReply, Message, ReleaseLease, encode
from kvcr_protocol.versions import LEASES_VERSION

ASK_BYTES_PER_LINK = 16 << 20
"""Bytes of lease requests one link may have sent unanswered (those given up included,
until their late answer or the connection's end). A source that stops reading leaves them
in the socket's queue: this bounds what it costs the node, and a request past it answers
UNREACHABLE at once, unsent (spec section 6.11)."""
ASKS_PER_LINK = 1024
"""Lease requests one link may hold at once, queued, sent or given up; one more answers
UNREACHABLE at once."""
ASK_REPLIES = (LeaseReply, Ack, Error, Completion)
"""What answers a request sent with ``ask``: ``lease``/``renew`` (``lease_reply``),
``unlease`` (``ack``), a reader's report passed on (``suspect``: ``complete``), or ``error``."""
LATE_RELEASE_S = 2.0
"""How long the release of a lease a source granted after its request was given up waits."""


class LinkError(Exception):
    """A link to a source could not be opened; the keys that needed it fail with ``code``."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class LeaseRequests:
    """Lease requests on links, and the leases sources hold for this node (mixed into ``Links``)."""

    by_endpoint: dict[str, PeerLink]
    counters: Counters
    clock: Callable[[], float]
    lease_owner: LeaseOwner | None
    _ids: itertools.count[int]

    def open(self, endpoint: str) -> PeerLink:
        raise NotImplementedError

    if TYPE_CHECKING:  # ``TwinLinks``' (a stub here would hide it: this part comes first in ``Links``)

        def link_of(self, endpoint: str) -> PeerLink | None: ...

    def ask(
        self, endpoint: str, build: Callable[[int], Message], answer: Answer, wait_s: float, incarnation: int = 0,
    ) -> None:
        """Send the source at ``endpoint`` a lease request (``build`` makes it for a message id)
        once its session is up; ``answer`` gets the reply within ``wait_s``, or None and why
        none came: the link cannot open, no session or no answer came in time, the link holds
        as many requests as it may (``ASKS_PER_LINK``, ``ASK_BYTES_PER_LINK``), the source
        speaks no leases (``PEER_UNSUPPORTED``), the connection was lost before it answered,
        or the source is no longer ``incarnation`` (``PEER_RESTARTED``)."""
        try:
            link = self.open(endpoint)
        except LinkError as exc:
            answer(None, exc.code)
            return
        ask = Ask(build, answer, self.clock() + wait_s, incarnation)
        if len(link.asks) + len(link.asks_queued) + len(link.abandoned) >= ASKS_PER_LINK:
            self.counters.inc(Count.LEASE_ASKS_REFUSED)
            answer(None, ErrorCode.PEER_UNREACHABLE)
        elif link.state is LinkState.READY:
            self._send_ask(link, ask)
        else:
            link.asks_queued.append(ask)

    def _send_ask(self, link: PeerLink, ask: Ask) -> None:
        if link.version < LEASES_VERSION:
            ask.answer(None, ErrorCode.PEER_UNSUPPORTED)  # spec section 6.11: no silent lease that is not one
            return
        if ask.incarnation and ask.incarnation != link.incarnation:
            ask.answer(None, ErrorCode.PEER_RESTARTED)  # it names the lease ids of a predecessor
            return
        assert ask.build is not None
        ask_id = next(self._ids)
        msg = ask.build(ask_id)
        frame = encode(msg, link.version)
        if link.ask_bytes + len(frame) > ASK_BYTES_PER_LINK:
            # The source has not read what was sent before: nothing more joins the queue.
            self.counters.inc(Count.LEASE_ASKS_REFUSED)
            ask.answer(None, ErrorCode.PEER_UNREACHABLE)
            return
        try:
            link.sock.send(frame, _NOBLOCK)
        except zmq.Again:
            ask.answer(None, ErrorCode.PEER_UNREACHABLE)
            return
        ask.build, ask.size, ask.grants = None, len(frame), isinstance(msg, Lease)
        link.asks[ask_id] = ask
        link.ask_bytes += ask.size

    def _late_answer(self, link: PeerLink, msg: LeaseReply | Ack | Error | Completion) -> bool:
        """An answer to a request given up: its bytes are off the queue; a lease it granted
        is released at once (spec section 6.11). False: it answers no such request."""
        late = link.abandoned.pop(msg.id, None)
        if late is None:
            return False
        size, grants = late
        link.ask_bytes -= size
        self.counters.inc(Count.LEASE_ASKS_LATE)
        if grants and isinstance(msg, LeaseReply) and msg.lease:
            lease = msg.lease
            self.ask(link.endpoint, lambda i: ReleaseLease(i, lease), _ignore, LATE_RELEASE_S, link.incarnation)
        return True

    def hold_lease(self, endpoint: str, lease: int) -> int:
        """The source at ``endpoint`` holds ``lease`` for us: its link stays open meanwhile.
        Returns the source's incarnation (whose lease id it is)."""
        link = self.link_of(endpoint)
        if link is None:
            return 0
        link.leases.add(lease)
        return link.incarnation

    def incarnation(self, endpoint: str) -> int:
        """The incarnation of the source at ``endpoint`` as last welcomed (0: none yet)."""
        link = self.link_of(endpoint)
        return link.incarnation if link is not None else 0

    def version(self, endpoint: str) -> int:
        """The version the session with the source at ``endpoint`` agreed on (0: none yet)."""
        link = self.link_of(endpoint)
        return link.version if link is not None and link.state is LinkState.READY else 0

    def release_lease(self, endpoint: str, lease: int) -> None:
        link = self.link_of(endpoint)
        if link is not None:
            link.leases.discard(lease)
            link.last_used = self.clock()

    def _lose_asks(self, link: PeerLink, code: ErrorCode) -> None:
        """The connection is gone: the lease requests sent on it get no answer (``code`` says
        why), and those given up no late one; their bytes left with it."""
        asks, link.asks = link.asks, {}
        link.abandoned.clear()
        link.ask_bytes = 0
        for ask in asks.values():
            ask.answer(None, code)

    def _fail_asks(self, link: PeerLink, code: ErrorCode) -> None:
        """Every lease request on ``link`` gets no answer (``code`` says why); what the source
        held for us is lost with its session."""
        self._lose_asks(link, code)
        queued, link.asks_queued = link.asks_queued, []
        for ask in queued:
            ask.answer(None, code)
        self._lose_leases(link, code)

    def _lose_leases(self, link: PeerLink, code: ErrorCode) -> None:
        if link.leases:
            link.leases.clear()
            if self.lease_owner is not None:
                self.lease_owner.source_lost(link, code)

    def _give_up_asks(self, link: PeerLink, now: float) -> None:
        """Lease requests past their deadline on a live connection (a source that does not
        answer, frozen or hostile) answer None now and free what they hold; their frames'
        bytes stay counted until a late answer or the connection's end (spec section 6.11)."""
        late = [ask_id for ask_id, ask in link.asks.items() if ask.deadline <= now]
        for ask_id in late:
            ask = link.asks.pop(ask_id)
            link.abandoned[ask_id] = (ask.size, ask.grants)
            self.counters.inc(Count.LEASE_ASKS_TIMED_OUT)
            ask.answer(None, ErrorCode.PEER_UNREACHABLE)



def _ignore(reply: Message | None, code: ErrorCode | None) -> None:
    """An answer nobody waits for (the release of a lease granted too late)."""
