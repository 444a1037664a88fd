"""Every event the node counts, declared once, and the tallies that count them.

The ``stats`` reply shows ``counters`` (``Count``), ``protocol_errors`` (by ``ErrorCode``),
``outcomes`` and, under ``leases``, the lease counters (``LeaseCount``); the metrics
exporter serves some of them (architecture §4). The parts count members of these enums,
never strings, so a misspelt counter is a type error; names are written out only at the
edge (``snapshot``, the Prometheus labels). A tally lists only what was counted, as the
``stats`` reply always has.
"""

from __future__ import annotations

import enum

from kvcr_io.tally import Tally
from kvcr_protocol import ErrorCode


class Count(enum.Enum):
    """The node's event counters (``stats`` ``counters``), by the name the reply shows."""

    HELLOS = "hellos"
    """Client sessions opened (``hello`` answered ``welcome``)."""
    SESSIONS_RESUMED = "sessions_resumed"
    """Client sessions ended by their client's next ``hello`` presenting their resume token
    (spec section 5.2): their puts freed at once."""
    RESUMES_UNMATCHED = "resumes_unmatched"
    """``hello`` resume tokens that named no live session of the sender's agent, ignored (the
    node restarted, the session had ended, or the token was guessed or another's)."""
    CLIENTS_EXPIRED = "clients_expired"
    """Client sessions closed for silence past ``client_grace_ms``."""
    PEERS_EXPIRED = "peers_expired"
    """Peer sessions closed for silence past ``client_grace_ms``."""
    CAPACITY_EVENTS = "capacity_events"
    """Pools whose reclaimable slots fell under the low watermark, each told to the clients."""
    INTERNAL_ERRORS = "internal_errors"
    """Unexpected failures the node counted, logged and survived."""
    SEND_DROPPED = "send_dropped"
    """Frames the ROUTER socket could not take at once (the peer's queue was full)."""
    AUTH_ACCEPTED = "auth_accepted"
    """CURVE connections whose key is allowed."""
    AUTH_REFUSED = "auth_refused"
    """CURVE connections refused: the key is not allowed."""
    AUTH_HANDSHAKE_FAILED = "auth_handshake_failed"
    """CURVE handshakes that failed before a key was known."""
    PEER_HELLOS = "peer_hellos"
    """Peer sessions opened by target nodes (source side)."""
    LINKS_FOLDED = "links_folded"
    """Links found (by the source's proof) to reach a source another link reaches, whose
    spelling became an alias of that link (target side; spec section 5.3, "Twin links")."""
    LINK_ALIASES_DROPPED = "link_aliases_dropped"
    """Aliases of links forgotten past ``max_peers`` aliases (their next request opens a link)."""
    PEER_FORGETS_UNKNOWN = "peer_forgets_unknown"
    """``peer_forget`` for an agent this peer session did not hold (answered ack all the same)."""
    PEER_CLIENTS_FORGOTTEN = "peer_clients_forgotten"
    """Announced clients forgotten on a target's ``peer_forget``."""
    PEER_CLIENTS_EVICTED = "peer_clients_evicted"
    """Announced clients forgotten beyond ``max_peer_clients`` (least recently used)."""
    WRITES_DEFERRED = "writes_deferred"
    """Peer writes (or their items) submitted later than the turn that decoded them."""
    WRITES_INLINE = "writes_inline"
    """Peer writes whose READY keys were submitted in the turn that decoded them."""
    UNCERTAIN_RESOLVED = "uncertain_resolved"
    """Uncertain remote writes the source later confirmed over."""
    NOTIFY_FAILED = "notify_failed"
    """Notifications this node could not send for a source below version 3."""
    NOTIFIED_FOR_SOURCE = "notified_for_source"
    """Notifications this node sent a client for a source below version 3."""
    UNREGIONS_HELD = "unregions_held"
    """``unregions`` whose ack waited for a remote write that may still reach the regions."""
    LINK_FAILURES = "link_failures"
    """Links to a source that could not be opened."""
    REMOTE_WRITES = "remote_writes"
    """Writes asked of sources (target side)."""
    PEER_FORGETS_SENT = "peer_forgets_sent"
    """``peer_forget`` sent to sources for clients that left."""
    LEASE_ASKS_REFUSED = "lease_asks_refused"
    """Lease asks to a source refused here: too many or too many bytes queued on its link."""
    LEASE_ASKS_LATE = "lease_asks_late"
    """Answers to lease asks that came after the ask had timed out."""
    LEASE_ASKS_TIMED_OUT = "lease_asks_timed_out"
    """Lease asks a source did not answer in time."""
    PEER_CLIENT_REFUSED = "peer_client_refused"
    """Client announcements (``peer_client``) a source refused."""
    WRITES_RETRIED = "writes_retried"
    """Writes announced again and retried once after the source forgot the client."""
    PEER_RESTARTS = "peer_restarts"
    """Sources seen with a new incarnation."""
    LINKS_CLOSED_IDLE = "links_closed_idle"
    """Links closed after ``peer_idle_ms`` unused."""
    SOURCE_LEASES_DEAD = "source_leases_dead"
    """Leases at a source taken as gone with it (no session for ``peer_dead_ms``)."""
    UNCERTAIN_WRITES = "uncertain_writes"
    """Remote writes that passed their deadline unanswered."""
    PROBES_SENT = "probes_sent"
    """Probes sent for uncertain writes."""
    PEER_LIMIT_REFUSALS = "peer_limit_refusals"
    """Links refused at ``max_peers`` with no idle link to close (``PEER_LIMIT``)."""
    LINKS_EVICTED = "links_evicted"
    """Idle links closed to make room under ``max_peers``."""
    EVENTS_PUBLISHED = "events_published"
    """Inventory event batches published (spec section 15)."""
    EVENTS_REPLAYS = "events_replays"
    """Event replays answered to the end."""
    EVENTS_REPLAYS_REFUSED = "events_replays_refused"
    """Event replay requests refused (malformed, or out of the ring)."""
    EVENTS_REPLAYS_BUSY = "events_replays_busy"
    """Event replay requests refused for the requester limit or one already in progress."""
    EVENTS_REPLAY_CUT = "events_replay_cut"
    """Event replays cut short (a requester that did not take its answer)."""
    OBJECTS_CONDEMNED = "objects_condemned"
    """Objects whose bytes the node found changed since they were stored, and dropped (spec
    section 6.12, "Integrity")."""
    SUSPECTS = "suspects"
    """Keys readers reported (``suspect``) as read with bytes that did not match their digests."""
    SUSPECTS_CONFIRMED = "suspects_confirmed"
    """Reported keys whose object the node found changed, and dropped."""
    SUSPECTS_UNFOUNDED = "suspects_unfounded"
    """Reported keys whose object the node found intact, and kept."""
    SUSPECTS_REFUSED = "suspects_refused"
    """Reported keys answered ``BUSY``: checking them would have overspent a read budget, or
    too many reports waited on sources."""
    SUSPECTS_PASSED_ON = "suspects_passed_on"
    """Reported keys read from a source's pools, passed on to that source to check."""
    DELIVER_MISMATCHES = "deliver_mismatches"
    """Keys of the node's own delivers failed ``DIGEST_MISMATCH``: the spans it sent had changed."""


class LeaseCount(enum.Enum):
    """What ``kvcr_node.leases`` counts (``stats`` ``leases``, beside its gauges)."""

    GRANTED = "granted"
    """Leases granted that hold at least one key."""
    RENEWED = "renewed"
    """Leases renewed."""
    RELEASED = "released"
    """Leases released by their session."""
    UNKNOWN_LEASE = "unknown_lease"
    """Renewals and releases naming no lease of the session."""
    REFUSED_LEASE_LIMIT = "refused_lease_limit"
    """Lease requests refused at ``max_leases_per_session``."""
    KEYS_REFUSED_LIMIT = "keys_refused_limit"
    """Keys a lease did not take for a session or pool limit."""
    ENDED_WITH_SESSION = "ended_with_session"
    """Leases ended because their session did."""
    CARRIED_OVER = "carried_over"
    """Leases carried over to a reconnected peer's new session (same incarnation)."""
    EXPIRED = "expired"
    """Leases that reached their expiry unrenewed."""
    TAKEN_BACK = "taken_back"
    """Leases ended so that a session within its share could lease (a holder over its share
    gave the pool's lease budget back, spec section 6.11)."""
    ASKED_SOURCES = "asked_sources"
    """Lease asks sent to a hinted source."""
    LOST_AT_SOURCE = "lost_at_source"
    """Holds a source no longer keeps (the client is told which keys)."""
    RESUMED_AT_SOURCE = "resumed_at_source"
    """Holds asked again of a source whose link came back."""
    READ_GRANTS = "read_grants"
    """Leases answered with a read grant (spec section 6.12)."""


class Counters(Tally[Count]):
    """The node's event counters, shown by ``Count`` value."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda count: count.value)


class LeaseCounters(Tally[LeaseCount]):
    """The lease counters, shown by ``LeaseCount`` value."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda count: count.value)


class ProtocolErrors(Tally[ErrorCode]):
    """Requests refused with an ``error``, shown by the code's name (spec section 10)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda code: code.name)
