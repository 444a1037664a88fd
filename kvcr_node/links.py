"""The target side of cross-node delivery: links to source nodes and the writes sent on them.

``Links`` owns every link (one DEALER socket and its monitor per source endpoint), the
writes queued, sent or uncertain on each, their probes, and the ids of the messages it
sends. It opens links on demand (at most ``max_peers``, least recently used idle ones
closed to make room), says ``peer_hello``, announces clients (and, version 5, tells
sources when they left: ``peer_forget``), sends writes, reads what
sources answer, and on each check sends heartbeats, turns writes whose deadline passed
uncertain, probes them, and closes links idle for ``peer_idle_ms`` (spec sections 5.3
and 12). Two spellings of one source's endpoint share one link (``kvcr_node.twin_links``,
spec section 5.3 "Twin links"). What a write means for its operation (results, fills,
handles) is the node's: ``Links`` reports every write that ends, or turns uncertain, to
its ``LinkOwner``.
"""

from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_node import logs
from kvcr_node.agents import RemoteAgents
from kvcr_node.client_forgets import ClientForgets
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters, ProtocolErrors
from kvcr_node.lease_requests import ASK_REPLIES, LeaseRequests, LinkError
from kvcr_node.peers import LeaseOwner, LinkOwner, LinkState, PeerLink, RemoteWrite, WriteStage
from kvcr_node.records import Operation, Session
from kvcr_node.store import ObjectEntry
from kvcr_node.twin_links import TwinLinks
from kvcr_node.write_deadlines import WriteDeadlines
from kvcr_protocol import (
    Ack,
    Bye,
    DeliverColumns,
    DeliverItem,
    Error,
    ErrorCode,
    Heartbeat,
    KeyResult,
    LeaseEnded,
    Message,
    PeerClient,
    PeerHello,
    PeerWelcome,
    ProbeReply,
    Progress,
    Refuse,
    RemoteProtocolError,
    WriteDone,
    WriteNotify,
    WriteRequest,
    decode,
    encode,
)
from kvcr_protocol.operations import SOURCE_CODES
from kvcr_protocol.versions import COLUMNS_VERSION, GRANTS_VERSION, PARTIAL_LAYOUT_VERSION

log = logging.getLogger("kvcr.node")

BYE_LINGER_MS = 100
"""How long a closed link's socket may still try to deliver its ``bye``."""
RECONNECT_MAX_MS = 1000
"""ZeroMQ retries a link's connection at 100 ms, doubling up to this: a source that stays
unreachable costs its link a retry a second, not ten, until the link closes idle."""
WRITE_POLL_S = 0.05
"""With writes outstanding, the loop wakes at least this often to look at their deadlines."""
TRANSPORTS = ("tcp://", "ipc://")
"""Transports a link may use (spec section 12: sources are other nodes' ROUTER endpoints)."""
_BAD_ENDPOINT_ERRNOS = frozenset({errno.EPROTONOSUPPORT, errno.EINVAL, errno.ENAMETOOLONG, errno.ENOENT, zmq.ENOCOMPATPROTO})
"""ZeroMQ connect errors that mean the endpoint itself is wrong (others: the node cannot connect now)."""


def _close_quietly(sock: zmq.Socket[bytes] | None, monitor: zmq.Socket[bytes] | None) -> None:
    """Close what was opened for a link that could not be made."""
    if sock is not None:
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        sock.close(0)
    if monitor is not None:
        monitor.close(0)


class Links(LeaseRequests, ClientForgets, TwinLinks, WriteDeadlines):
    """Every link of this node to a source node (the target side of spec section 12).

    The node makes it and hands it to ``Target``, which it then reports to (``owner``), and
    to ``Leases`` (``lease_owner``): the I/O stays here, and a test can hand either a fake.
    """

    def __init__(
        self, config: NodeConfig, context: zmq.Context[Any], poller: zmq.Poller,
        agents: RemoteAgents, hello: Callable[[int, str], PeerHello], versions: Sequence[int],
        counters: Counters, protocol_errors: ProtocolErrors, clock: Callable[[], float],
        curve: tuple[bytes, bytes, bytes] | None = None, *, owner: LinkOwner | None = None,
    ) -> None:
        self.owner = owner
        """Who each write's end is reported to (``Target``; the node sets it)."""
        self.config = config
        self.context = context
        self.poller = poller
        self.agents = agents
        self.hello = hello
        """Builds our ``peer_hello`` for a message id and the link's endpoint (as spelled)."""
        self.versions = versions
        self.counters = counters
        self.protocol_errors = protocol_errors
        self.clock = clock
        self.curve = curve
        """(the peers' server key, our public key, our secret key) when nodes use CurveZMQ."""
        self.by_endpoint: dict[str, PeerLink] = {}
        self.aliases: dict[str, str] = {}
        """Another spelling of a source's endpoint -> the endpoint of the link it goes through
        (spec section 5.3, "Twin links"); oldest first, at most ``max_peers``."""
        self.draining: list[PeerLink] = []
        """Links folded into a twin that still serve what was sent on them (no new request)."""
        self.socks: dict[Any, PeerLink] = {}
        """Each link's socket and monitor, as the poller reports them."""
        self._ids = itertools.count(1)
        """Ids of every message we send on links: hello, write, announce, probe, heartbeat, bye, leases."""
        self.lease_owner: LeaseOwner | None = None

    def __iter__(self) -> Iterator[PeerLink]:
        yield from self.by_endpoint.values()
        yield from self.draining

    @property
    def reports(self) -> LinkOwner:
        """``owner``, which every link's writes need (a write cannot exist before it is set)."""
        owner = self.owner
        if owner is None:
            raise RuntimeError("Links has no owner: the node sets Target as its owner before any write")
        return owner

    def __len__(self) -> int:
        return len(self.by_endpoint) + len(self.draining)

    # ------------------------------------------------------------------ writes

    def open(self, endpoint: str) -> PeerLink:
        """The link to the source at ``endpoint``, opened if need be.

        Raises ``LinkError`` (``BAD_ENDPOINT``, ``PEER_UNREACHABLE`` or ``PEER_LIMIT``, with
        the reason) when it cannot be opened; nothing it opened stays behind.
        """
        link = self.link_of(endpoint)
        if link is not None:
            link.last_used = self.clock()
            return link
        if not endpoint.startswith(TRANSPORTS):
            raise LinkError(ErrorCode.BAD_ENDPOINT, f"the source endpoint {endpoint!r} is not a tcp:// or ipc:// endpoint")
        if len(self) >= self.config.max_peers:
            self._make_room(endpoint)
        sock: zmq.Socket[bytes] | None = None
        monitor: zmq.Socket[bytes] | None = None
        try:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
            if self.curve is not None:
                # Peers authenticate us by our own key pair; they serve with curve_peer_key.
                server, public, secret = self.curve
                sock.setsockopt(zmq.CURVE_SERVERKEY, server)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            _close_quietly(sock, monitor)
            code = ErrorCode.BAD_ENDPOINT if exc.errno in _BAD_ENDPOINT_ERRNOS else ErrorCode.PEER_UNREACHABLE
            self.counters.inc(Count.LINK_FAILURES)
            raise LinkError(code, f"cannot connect to the source {endpoint!r}: {exc.strerror}") from exc
        except BaseException:
            _close_quietly(sock, monitor)
            raise
        link = PeerLink(endpoint, sock, monitor, last_used=self.clock())
        self.by_endpoint[endpoint] = link
        for s in link.fds:
            self.poller.register(s, zmq.POLLIN)
            self.socks[s] = link
        try:
            self._say_hello(link)
        except BaseException:
            self._close(link)
            raise
        return link

    def new_write(
        self, op: Operation, link: PeerLink, indices: list[int], items: tuple[DeliverItem, ...],
        agent: str, client: Session | None, partial: bool, *, columns: tuple[DeliverColumns, ...] = (),
        notify: WriteNotify | None = None, regions: frozenset[int] = frozenset(), fills: list[ObjectEntry] | None = None,
    ) -> RemoteWrite:
        """A write on ``link`` for the items ``indices`` of ``op``, whole (the fields
        ``RemoteWrite`` documents); ``submit`` sends it."""
        self.counters.inc(Count.REMOTE_WRITES)
        return RemoteWrite(link, next(self._ids), op, indices, items, agent, client, partial, op.deadline, fills=fills,
                           columns=columns, notify=notify, regions=regions)

    def submit(self, write: RemoteWrite) -> None:
        """Send ``write`` now if its link's session is up, else when it is."""
        if write.link.state is LinkState.READY:
            self._send_write(write)
        else:
            write.link.queued.append(write)

    def end_write(self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: Sequence[KeyResult] = ()) -> None:
        """``write`` is over: forget it here and report it to the owner."""
        was_uncertain = write.state is WriteStage.UNCERTAIN
        write.state = WriteStage.DONE
        link = write.link
        link.writes.pop(write.id, None)
        link.probes.pop(write.probe_id, None)
        link.last_used = self.clock()
        self.reports.write_over(write, code, reason, results, was_uncertain)

    def _send_write(self, write: RemoteWrite) -> None:
        link = write.link
        if write.partial and link.version < PARTIAL_LAYOUT_VERSION:
            # Spec section 12: a subset to a peer that lacks partial layouts fails at once; nothing is sent.
            self.end_write(write, ErrorCode.PEER_UNSUPPORTED, f"the source speaks version {link.version}, which cannot deliver a subset")
            return
        client = write.client
        if client is not None and link.clients_sent.get(client.agent) != client.regions_version:
            # The client's metadata reaches the source once per client and peer (and again
            # when its regions change).
            announce = PeerClient(next(self._ids), client.agent, client.agent_md, tuple(client.regions.values()))
            if self._send(link, announce):
                link.clients_sent[client.agent] = client.regions_version
                link.announcing[announce.id] = client.agent
                if not client.closing:
                    # The client came back under the same agent: the source must keep it.
                    link.forgets.discard(client.agent)
        remaining_ms = max(1, int((write.deadline - self.clock()) * 1000))
        if link.version >= COLUMNS_VERSION and write.columns:
            # The client's rows as they came, with their plans, and how to notify it (spec section 12).
            msg = WriteRequest(write.id, write.agent, (), remaining_ms, write.partial, write.columns, write.notify)
        else:
            # An older source: records without a plan, no notification (spec section 7).
            msg = WriteRequest(write.id, write.agent, write.records(), remaining_ms, write.partial)
        if self._send(link, msg):
            write.state = WriteStage.SENT
            link.writes[write.id] = write
        else:
            self.end_write(write, ErrorCode.PEER_UNREACHABLE, f"cannot send to {link.endpoint}")

    # ------------------------------------------------------------------ sessions with sources

    def _say_hello(self, link: PeerLink) -> None:
        link.hello_id = next(self._ids)
        link.state = LinkState.CONNECTING
        hello = self.hello(link.hello_id, link.endpoint)
        link.token = hello.link
        self._send(link, hello)

    def _send(self, link: PeerLink, msg: Message) -> bool:
        try:
            link.sock.send(encode(msg, link.version or self.versions[-1]), _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def drain(self, link: PeerLink) -> None:
        """Read the link's monitor events and every message its source sent."""
        monitor = link.monitor
        while cast(int, monitor.getsockopt(_EVENTS)) & _POLLIN:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if link.state is not LinkState.DOWN:
                    link.state = LinkState.DOWN
                    link.down_since = self.clock()
                    log.warning("lost peer %s (%s)", link.node or link.endpoint, link.endpoint)
                    # Answers to what was sent on this connection cannot come. The leases the
                    # source holds for us last until peer_dead_ms, or until it is back as
                    # another incarnation (spec section 6.11).
                    self._lose_asks(link, ErrorCode.PEER_UNREACHABLE)
            elif event["event"] == zmq.EVENT_CONNECTED and link.state is LinkState.DOWN:
                # Back: a new connection is a new session at the peer; say hello again.
                self._say_hello(link)
        sock = link.sock
        while not link.closed and cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            frame = sock.recv(_NOBLOCK)
            try:
                msg = decode(frame, link.version or self.versions[-1])
            except RemoteProtocolError as exc:
                self.protocol_errors.inc(exc.code)
                if (left_out := logs.limiter.admit(exc.code.name)) is not None:  # a broken peer cannot flood the log
                    log.warning("undecodable message from peer %s: %s %s", link.endpoint, exc.code.name, exc.reason[:200],
                                extra={"code": exc.code.name, "session": link.node or link.endpoint, "role": "source",
                                       "suppressed": left_out})
                continue
            try:
                self._on_message(link, msg)
            except Exception as exc:
                self._message_failed(link, msg, exc)
        if link.forgets:
            self._send_forgets(link)  # a write that held one back may have ended, or the session opened

    def _message_failed(self, link: PeerLink, msg: Message, exc: Exception) -> None:
        """Handling a source's message raised: count it; the write it answers (if any) fails ``INTERNAL``."""
        self.reports.internal_failure(f"peer {msg.TAG}", exc)
        write = link.writes.get(getattr(msg, "id", -1))
        if write is not None and write.state is not WriteStage.DONE:
            try:
                self.end_write(write, ErrorCode.INTERNAL, f"the node failed while handling the source's {msg.TAG}")
            except Exception as again:
                self.reports.internal_failure("ending a write", again)

    def _on_message(self, link: PeerLink, msg: Message) -> None:
        ask = link.asks.pop(msg.id, None) if isinstance(msg, ASK_REPLIES) else None
        if ask is not None:
            link.ask_bytes -= ask.size
            ask.answer(msg, None)
        elif link.abandoned and isinstance(msg, ASK_REPLIES) and self._late_answer(link, msg):
            pass
        elif isinstance(msg, LeaseEnded):
            if self.lease_owner is not None:
                link.leases.discard(msg.lease)
                self.lease_owner.source_lease_ended(link, msg)
        elif isinstance(msg, PeerWelcome) and msg.id == link.hello_id:
            self._on_welcome(link, msg)
        elif isinstance(msg, WriteDone):
            write = link.writes.get(msg.id)
            if write is not None:
                if len(msg.results) != len(write.indices):
                    self.end_write(write, ErrorCode.TRANSFER_FAILED, "the source answered with the wrong number of results")
                else:
                    write.done = msg.done_counts() if len(msg.done) == 4 * len(msg.results) else ()
                    self.end_write(write, None, "", msg.results)
        elif isinstance(msg, Progress):
            write = link.writes.get(msg.id)
            if write is not None:
                self.reports.write_progress(write, msg)
        elif isinstance(msg, Ack):
            link.announcing.pop(msg.id, None)
        elif isinstance(msg, (Refuse, Error)):
            self._on_refusal(link, msg)
        elif isinstance(msg, ProbeReply):
            self._on_probe_reply(link, msg)

    def _on_refusal(self, link: PeerLink, msg: Refuse | Error) -> None:
        write = link.writes.get(msg.id)
        agent = link.announcing.pop(msg.id, None)
        if agent is not None:
            # The source refused a client's announcement: the writes sent after it fail
            # there (agent not announced); announce again with the client's next write.
            self.counters.inc(Count.PEER_CLIENT_REFUSED)
            link.clients_sent.pop(agent, None)
            log.warning("peer %s refused client %s: %s", link.endpoint, agent, msg.reason)
        if write is not None and isinstance(msg, Refuse) and self._may_retry(link, write, msg):
            # The source forgot the client (max_peer_clients): announce it again, retry once.
            write.retried = True
            self.counters.inc(Count.WRITES_RETRIED)
            assert write.client is not None
            link.clients_sent.pop(write.client.agent, None)
            link.writes.pop(write.id, None)
            self._send_write(write)
        elif write is not None:
            # Spec section 10.1: the codes a source refuses a write with pass on; any other
            # (a bug or a hostile source) is a failed transfer.
            code = ErrorCode(msg.code) if msg.code in SOURCE_CODES else ErrorCode.TRANSFER_FAILED
            self.end_write(write, code, f"the source refused (code {msg.code}): {msg.reason}")
        elif msg.id == link.hello_id:
            log.warning("peer %s refused our hello: %s", link.endpoint, msg.reason)
            self._fail_queued(link, ErrorCode.PEER_UNSUPPORTED if msg.code == ErrorCode.UNSUPPORTED_VERSION else ErrorCode.PEER_UNREACHABLE,
                              f"the source refused the peer session: {msg.reason}")
        if isinstance(msg, Error) and msg.code == ErrorCode.BAD_STATE and link.state is LinkState.READY:
            # The source has no session for us any more (it dropped us as silent while
            # the connection stayed up): open a new one, or every later write fails too.
            self._say_hello(link)

    @staticmethod
    def _may_retry(link: PeerLink, write: RemoteWrite, msg: Refuse) -> bool:
        """Whether a refused write is one to send again: refused for its client's agent
        (BAD_STATE) although that client's announcement was not refused, not yet retried,
        and its client still there (spec section 5.3)."""
        client = write.client
        return (
            msg.code == ErrorCode.BAD_STATE and write.state is WriteStage.SENT and not write.retried
            and client is not None and not client.closing and client.agent in link.clients_sent
        )

    def _on_welcome(self, link: PeerLink, msg: PeerWelcome) -> None:
        restarted = link.incarnation not in (0, msg.incarnation)
        resumed = link.incarnation == msg.incarnation and bool(link.leases)
        if restarted:
            # A new incarnation: its predecessor's writes are void, and whatever it was
            # writing is over (it is gone).
            self.counters.inc(Count.PEER_RESTARTS)
            for write in list(link.writes.values()):
                self.end_write(write, ErrorCode.PEER_RESTARTED, "the source restarted")
            queued_asks, link.asks_queued = link.asks_queued, []  # asked of the new one below
            self._fail_asks(link, ErrorCode.PEER_RESTARTED)
            link.asks_queued = queued_asks
        link.incarnation = msg.incarnation
        link.version = msg.version
        link.node = msg.node
        link.state = LinkState.READY
        link.down_since = None
        link.clients_sent.clear()
        link.announcing.clear()
        old_agent = link.agent
        try:
            link.agent = self.agents.add(msg.agent_md)
        except Exception as exc:
            link.agent = ""
            log.warning("peer %s metadata refused: %s", link.endpoint, exc)
        if old_agent and old_agent != link.agent:
            self.agents.release(old_agent)  # the source restarted with another agent
        link.twins = msg.twins if msg.version >= GRANTS_VERSION else b""
        link.twin = self._twin_of(link)
        if link.twin is not None and self._fold(link):
            return  # its queued requests went to the twin, which has the session they need
        queued, link.queued = link.queued, []
        for write in queued:
            if write.state is WriteStage.QUEUED:
                self._send_write(write)
        # A new session knows only the clients announced on it (by the writes just sent):
        # the source forgot the others with the old session.
        link.forgets &= set(link.clients_sent)
        asks, link.asks_queued = link.asks_queued, []
        for ask in asks:
            self._send_ask(link, ask)
        for write in list(link.writes.values()):
            if write.state is WriteStage.UNCERTAIN:
                write.next_probe = 0.0
        if resumed and self.lease_owner is not None:
            self.lease_owner.source_resumed(link)

    def _fail_queued(self, link: PeerLink, code: ErrorCode, reason: str) -> None:
        queued, link.queued = link.queued, []
        for write in queued:
            self.end_write(write, code, reason)
        self._fail_asks(link, code)

    # ------------------------------------------------------------------ time

    def check(self, now: float) -> None:
        """Heartbeats, write deadlines, probes of uncertain writes, idle links closed."""
        idle_s = self.config.peer_idle_ms / 1000
        for link in list(self):
            if link.draining and not link.busy:
                self.retire(link)  # folded into its twin, and what was sent on it is over
                continue
            if link.twin is not None and self._fold(link):
                continue
            if not link.busy and now - link.last_used >= idle_s:
                # Nothing outstanding and unused for peer_idle_ms: close it (spec section 5.3).
                self.counters.inc(Count.LINKS_CLOSED_IDLE)
                self.retire(link)
                continue
            if link.state is LinkState.READY and link.next_heartbeat <= now and self.config.heartbeat_ms:
                # The source drops sessions silent for its client grace, ours included.
                link.next_heartbeat = now + self.config.heartbeat_ms / 1000
                self._send(link, Heartbeat(next(self._ids)))
            if link.asks_queued and link.state is not LinkState.READY:
                # No session with the source in time: the lease requests waiting for it end.
                late = [ask for ask in link.asks_queued if ask.deadline <= now]
                link.asks_queued = [ask for ask in link.asks_queued if ask.deadline > now]
                for ask in late:
                    ask.answer(None, ErrorCode.PEER_UNREACHABLE)
            if link.asks:
                self._give_up_asks(link, now)
            if link.leases and link.state is not LinkState.READY and link.down_since is not None \
                    and (now - link.down_since) * 1000 >= self.config.peer_dead_ms:
                # Without a session since it went down, for peer_dead_ms (reconnected to a
                # listener that never welcomes counts too): the source is taken as gone, and
                # its leases with it.
                self.counters.inc(Count.SOURCE_LEASES_DEAD, len(link.leases))
                self._lose_leases(link, ErrorCode.PEER_UNREACHABLE)
            self._check_writes(link, now)
            if link.forgets:
                self._send_forgets(link)

    def next_wakeup(self, now: float) -> float | None:
        """When ``check`` has something to do next (None: nothing while no message arrives)."""
        if not self.by_endpoint:
            return None  # asked once per loop turn: no link, no walk
        times: list[float] = []
        if self.config.heartbeat_ms:
            times.extend(link.next_heartbeat for link in self if link.state is LinkState.READY)
        if any(link.writes or link.queued or link.asks_queued or link.asks
               or (link.forgets and link.state is LinkState.READY) for link in self):
            times.append(now + WRITE_POLL_S)
        down = [link.down_since + self.config.peer_dead_ms / 1000 for link in self
                if link.leases and link.down_since is not None and link.state is not LinkState.READY]
        times.extend(down)
        if any(not link.busy for link in self.draining):
            times.append(now)  # folded, and nothing of it runs any more: close it now
        idle = [link.last_used for link in self if not link.busy]
        if idle:
            # Wake once when the longest-idle link is due to close, no more often.
            times.append(min(idle) + self.config.peer_idle_ms / 1000)
        return min(times) if times else None

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per source endpoint: its node, session state, version, writes and aliases (for ``stats``)."""
        return {
            # A folded link still draining keeps its own entry beside a new link of its spelling.
            link.endpoint + (" (draining)" if link.draining else ""): {
                "node": link.node, "state": link.state.value, "version": link.version,
                "incarnation": link.incarnation, "writes_outstanding": len(link.writes), "queued": len(link.queued),
                "uncertain": sum(1 for w in link.writes.values() if w.state is WriteStage.UNCERTAIN),
                "leases": len(link.leases), "lease_asks": len(link.asks), "lease_asks_abandoned": len(link.abandoned),
                "ask_bytes": link.ask_bytes, "aliases": sorted(link.aliases), "draining": link.draining,
            }
            for link in self
        }

    def sizes(self) -> dict[str, int]:
        """Entries in the tables links keep (soaks check they return to a bound)."""
        return {
            "links": len(self.by_endpoint),
            "links_draining": len(self.draining),
            "link_aliases": len(self.aliases),
            "link_sockets": len(self.socks),
            "probes": sum(len(link.probes) for link in self),
            "clients_sent": sum(len(link.clients_sent) for link in self),
            "announcing": sum(len(link.announcing) for link in self),
            "forgets": sum(len(link.forgets) for link in self),
            "lease_asks": sum(len(link.asks) + len(link.asks_queued) for link in self),
            "lease_asks_abandoned": sum(len(link.abandoned) for link in self),
            "source_leases": sum(len(link.leases) for link in self),
        }

    @property
    def filling(self) -> bool:
        """Whether a source may be writing into our pools right now (a fetch)."""
        return bool(self.by_endpoint) and any(w.fills for link in self for w in link.writes.values())

    # ------------------------------------------------------------------ closing

    def _make_room(self, endpoint: str) -> None:
        """At ``max_peers`` links: close the least recently used idle one, or refuse (PEER_LIMIT)."""
        idle = [link for link in self if not link.busy]
        if not idle:
            self.counters.inc(Count.PEER_LIMIT_REFUSALS)
            raise LinkError(ErrorCode.PEER_LIMIT, f"cannot open a link to {endpoint!r}: this node holds max_peers="
                            f"{self.config.max_peers} links to other sources, each with writes outstanding; retry later")
        self.counters.inc(Count.LINKS_EVICTED)
        self.retire(min(idle, key=lambda link: link.last_used))

    def retire(self, link: PeerLink) -> None:
        """Close a link that has no work left: say bye (spec section 5.3), close its sockets
        and release the source's agent."""
        ready = link.state is LinkState.READY
        if ready:
            self._send(link, Bye(next(self._ids)))
        log.info("closing the link to %s (%s)", link.node or link.endpoint, link.endpoint)
        self._close(link, BYE_LINGER_MS if ready else 0)
        if link.agent:
            self.agents.release(link.agent)

    def _close(self, link: PeerLink, linger_ms: int = 0) -> None:
        """Close a link's sockets and monitor and forget it; its poller entries go too."""
        if self.by_endpoint.get(link.endpoint) is link:
            del self.by_endpoint[link.endpoint]
        for alias in link.aliases:
            if self.aliases.get(alias) == link.endpoint:
                del self.aliases[alias]  # its spellings open links of their own again
        link.aliases.clear()
        if link.draining:
            self.draining.remove(link)
        for s in link.fds:
            if self.socks.pop(s, None) is not None:
                self.poller.unregister(s)
        link.close(linger_ms)

    def close_all(self) -> None:
        """At shutdown: close every link's sockets."""
        for link in list(self):
            self._close(link)
