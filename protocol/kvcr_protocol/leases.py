"""Leases (version 4, spec section 6.11): the messages, and what a lease holds, key by key, as columns.

A lease reserves objects from a lookup through every delivery of them: while it lasts, a
leased object cannot be evicted or removed, so a request an engine admitted on its
answers does not fail half-loaded. A ``lease_reply`` says per key what the lease holds
(``LeaseStatus``), as one byte per key plus the tier the key is held in, like query
columns (spec section 6.9).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from kvcr_protocol.columns import check_code_columns
from kvcr_protocol.declare import F_CODE, F_REASON, F_REQUEST_ID, Message, _fields, message
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.grants import LeaseGrant
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import KEYS, NAME, U32_MAX
from kvcr_protocol.wire import Bool, Field, Opt, Packed, Record, RecordType, Seq, UInt


class LeaseStatus(enum.IntEnum):
    """What a lease holds of one key; the value is its code in a ``status`` column."""

    MISS = 0
    """Not held here, and no hint names a source that holds it."""
    LEASED = 1
    """Held here under the lease, in the tier the reply names."""
    LEASED_REMOTE = 2
    """Held under the lease by the source the session's hint names (tier ``remote``)."""
    PENDING = 3
    """Being written (WRITING) here or at the source: not held; ask again once it is READY."""
    LEASE_LIMIT = 4
    """Held, but leasing it would pass a lease limit of the node or the source: not held,
    treat it as a miss."""
    ADVISORY = 5
    """The hinted source may hold it but speaks no leases (a version below 4): nothing is
    reserved, as with a query's ``FETCHABLE``."""
    UNREACHABLE = 6
    """The hinted source could not be asked in time: not held."""


HELD: frozenset[LeaseStatus] = frozenset({LeaseStatus.LEASED, LeaseStatus.LEASED_REMOTE})
"""The statuses of keys a lease holds."""
_VALID = bytes(range(len(LeaseStatus)))
_BY_CODE: tuple[LeaseStatus, ...] = tuple(LeaseStatus)


@dataclass(frozen=True, slots=True)
class LeaseColumns(Record):
    """A lease's answers as columns: ``status`` one ``LeaseStatus`` code per key, ``tier``
    one index per key into the table ``tiers``."""

    status: bytes
    tier: bytes
    tiers: tuple[str, ...]
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("status", Packed(1, "max_keys")), Field("tier", Packed(1, "max_keys")),
        Field("tiers", Seq(NAME, "max_tiers")),
    )

    def __len__(self) -> int:
        return len(self.status)

    def __iter__(self) -> Iterator[LeaseStatus]:
        return (_BY_CODE[code] for code in self.status)

    def status_of(self, index: int) -> LeaseStatus:
        return _BY_CODE[self.status[index]]

    def tier_of(self, index: int) -> str:
        return self.tiers[self.tier[index]]

    def held_count(self) -> int:
        """How many keys the lease holds (here or at a source)."""
        return self.status.count(LeaseStatus.LEASED) + self.status.count(LeaseStatus.LEASED_REMOTE)

    def check(self, limits: Limits) -> None:
        check_code_columns(self.status, self.tier, self.tiers, _VALID, "status")


# ------------------------------------------------------------------------ messages

_F_LEASE = Field("lease", UInt())
_F_TTL = Field("ttl_ms", UInt(U32_MAX), 0)


@message("lease", since=4)
class Lease(Message):
    """Client -> node (or target -> source): hold these keys until the lease ends.

    ``request_id`` names the session's hint for keys not held here; ``ttl_ms`` 0 asks for
    the node's default time to live. ``read`` (version 5) asks for a read grant of the keys
    held here (spec section 6.12), ``node_md`` for what the client's agent needs to use it.
    """

    id: int
    keys: tuple[bytes, ...]
    request_id: str | None = None
    ttl_ms: int = 0
    read: bool = False
    node_md: bool = False
    FIELDS = _fields(
        Field("keys", KEYS), F_REQUEST_ID, _F_TTL,
        Field("read", Bool(), False, since=5, must_understand=True),
        Field("node_md", Bool(), False, since=5, must_understand=True),
    )


@message("lease_reply", reply=True, since=4)
class LeaseReply(Message):
    """Node -> client: the lease (0: none, nothing is held) and its granted time to live;
    for a ``lease``, what it holds per key (``columns``, in key order); none for a ``renew``.

    Version 5: ``held`` says the lease has held every key it held when granted, without a
    break, up to this reply; ``grant`` the slots a ``read`` lease lets the client READ.
    """

    id: int
    lease: int
    ttl_ms: int
    columns: LeaseColumns | None = None
    held: bool = False
    grant: LeaseGrant | None = None
    FIELDS = _fields(
        _F_LEASE, Field("ttl_ms", UInt(U32_MAX)), Field("columns", Opt(RecordType(LeaseColumns)), None),
        Field("held", Bool(), False, since=5, must_understand=True),
        Field("grant", Opt(RecordType(LeaseGrant)), None, since=5, must_understand=True),
    )

    def check(self, limits: Limits) -> None:
        if self.grant is not None and (self.columns is None or len(self.grant) != len(self.columns)):
            have = 0 if self.columns is None else len(self.columns)
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"a grant of {len(self.grant)} keys for {have} answers", "grant")


@message("renew", since=4)
class RenewLease(Message):
    """Client -> node: keep lease ``lease`` for ``ttl_ms`` more from now (0: its own time to live)."""

    id: int
    lease: int
    ttl_ms: int = 0
    FIELDS = _fields(_F_LEASE, _F_TTL)


@message("unlease", since=4)
class ReleaseLease(Message):
    """Client -> node: end lease ``lease`` now; what it held may be evicted again."""

    id: int
    lease: int
    FIELDS = _fields(_F_LEASE)


@message("lease_end", since=4)
class LeaseEnded(Message):
    """Node -> client (or source -> target): the node ended (part of) lease ``lease``.

    Not a reply: ``id`` counts the session's events. ``code`` says why (``LEASE_EXPIRED``,
    ``PEER_RESTARTED``, ``PEER_UNREACHABLE``, ``SHUTTING_DOWN``); ``keys`` are those no
    longer held, or empty when the whole lease ended.
    """

    id: int
    lease: int
    code: int
    reason: str = ""
    keys: tuple[bytes, ...] = ()
    FIELDS = _fields(_F_LEASE, F_CODE, F_REASON, Field("keys", KEYS, ()))


LEASE_MESSAGES: tuple[type[Message], ...] = (Lease, LeaseReply, RenewLease, ReleaseLease, LeaseEnded)
