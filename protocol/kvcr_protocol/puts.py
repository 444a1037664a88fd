"""Write grants (version 5, spec section 6.13): a client WRITEs new objects into slots the node reserved.

A ``put`` carries what a ``deposit`` carries (keys, spans, pools, where the bytes lie in
client memory) and is checked and admitted as one; but the node moves nothing. It
reserves ``WRITING`` slots for the keys it can take and answers ``put_reply``: the put's
id and time to live, a ``KeyResult`` per key (``OK``: reserved, write it), and the slots
as a ``LeaseGrant`` (one row per key; reserved keys only). The client WRITEs from its own
agent and then sends ``commit`` (the objects become ``READY``, answered ``complete`` as a
deposit is) or ``unput`` (the slots are freed). Messages of their own, so sessions below
version 5 never see them.
"""

from __future__ import annotations

from kvcr_protocol.columns import DepositColumns
from kvcr_protocol.declare import F_PARENTS, Message, _check_items, _fields, check_parents, message, message_keys
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.grants import LeaseGrant
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import U32_MAX, DepositItem, KeyResult
from kvcr_protocol.wire import Bool, Field, Opt, RecordType, Seq, UInt

_F_PUT = Field("put", UInt())


@message("put", since=5)
class Put(Message):
    """Client -> node: reserve slots for these objects; the client writes them itself.

    The items as a deposit's (records, or ``columns``); ``ttl_ms`` 0 asks for the node's
    default time to live; ``node_md`` asks for the node's agent with the reply's grant.
    """

    id: int
    items: tuple[DepositItem, ...]
    no_evict: bool = False
    optional: bool = False
    ttl_ms: int = 0
    columns: tuple[DepositColumns, ...] = ()
    node_md: bool = False
    parents: tuple[bytes, ...] = ()
    """As a deposit's (spec section 6.4, "Parents")."""
    FIELDS = _fields(
        Field("items", Seq(RecordType(DepositItem), "max_keys")), Field("no_evict", Bool(), False),
        Field("optional", Bool(), False), Field("ttl_ms", UInt(U32_MAX), 0),
        Field("columns", Seq(RecordType(DepositColumns), "max_keys"), ()), Field("node_md", Bool(), False),
        F_PARENTS,
    )

    def check(self, limits: Limits) -> None:
        _check_items(self.items, self.columns, limits)
        if self.parents:
            check_parents(message_keys(self.items, self.columns), self.parents)


@message("put_reply", reply=True, since=5)
class PutReply(Message):
    """Node -> client, reply to ``put``: the put (0: nothing reserved, nothing to commit),
    its granted time to live, one result per key in key order, and the reserved slots."""

    id: int
    put: int
    ttl_ms: int
    results: tuple[KeyResult, ...]
    grant: LeaseGrant | None = None
    FIELDS = _fields(
        _F_PUT, Field("ttl_ms", UInt(U32_MAX)), Field("results", Seq(RecordType(KeyResult), "max_keys")),
        Field("grant", Opt(RecordType(LeaseGrant)), None),
    )

    def check(self, limits: Limits) -> None:
        if self.grant is not None and len(self.grant) != len(self.results):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"a grant of {len(self.grant)} keys for {len(self.results)} results", "grant")


@message("commit", since=5)
class Commit(Message):
    """Client -> node: every WRITE of put ``put`` is done; make its objects ``READY``."""

    id: int
    put: int
    FIELDS = _fields(_F_PUT)


@message("unput", since=5)
class Unput(Message):
    """Client -> node: abandon put ``put``; no WRITE of it can land any more: free its slots."""

    id: int
    put: int
    FIELDS = _fields(_F_PUT)


PUT_MESSAGES: tuple[type[Message], ...] = (Put, PutReply, Commit, Unput)
