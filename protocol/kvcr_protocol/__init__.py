"""kvcr_protocol: the pure, sans-I/O control protocol of kvcr.

Importing this package imports no sockets, NIXL, threads or asyncio. Messages are typed
frozen dataclasses (``messages``, carrying the ``records``); ``codec`` turns them into
msgpack frames and back, validating every field; ``versions`` negotiates; ``columns``
holds version 3's column encodings (span columns with layer plans, query columns);
``notify`` the NIXL notification payload; ``events`` the inventory event stream (spec
section 15, its own framing and version); ``leases`` version 4's lease messages and answers; ``plans`` a client's per-group completion; ``projection`` maps named span subsets onto
stored layouts; ``descriptors`` checks spans against announced regions; ``session_rules``
the rules of a session (what may be sent when, reply versions, unique ids), for both ends.
"""

from kvcr_protocol import session_rules
from kvcr_protocol.codec import decode, encode, peek_id
from kvcr_protocol.columns import (
    PREFIX_ALL,
    PRESENCE_BY_CODE,
    PRESENCE_CODE,
    DeliverColumns,
    DepositColumns,
    QueryColumns,
    SpanColumns,
    deliver_blocks,
    deliver_columns,
    deposit_blocks,
    deposit_columns,
    layout_runs,
    prefix_mask,
)
from kvcr_protocol.declare import message_keys
from kvcr_protocol.descriptors import Extent, check_span_sizes, resolve_columns, resolve_span
from kvcr_protocol.endpoints import IPC_PATH_MAX, canonical_endpoint, endpoint_problem
from kvcr_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError, code_of
from kvcr_protocol.grants import GrantNode, GrantSource, LeaseGrant, PackedRow, grant_columns, packed_grant_columns
from kvcr_protocol.integrity import Suspect
from kvcr_protocol.leases import (
    HELD,
    Lease,
    LeaseColumns,
    LeaseEnded,
    LeaseReply,
    LeaseStatus,
    ReleaseLease,
    RenewLease,
)
from kvcr_protocol.limits import DEFAULT_LIMITS, Limits
from kvcr_protocol.messages import *  # noqa: F403 - the message catalogue is the API
from kvcr_protocol.messages import ALL_MESSAGES, MESSAGE_BY_TAG, item_count, record_items
from kvcr_protocol.notify import (
    NOTIFICATION_SIZE,
    Notification,
    NotifyKind,
    WriteNotify,
    decode_notification,
    encode_notification,
    is_notification,
)
from kvcr_protocol.operations import ANY_REQUEST, REQUEST_CODES, RequestCodes
from kvcr_protocol.plans import GroupEvent, GroupLedger, GroupState, PlanProgress
from kvcr_protocol.projection import Projection, ProjectionCache, compute_projection
from kvcr_protocol.puts import Commit, Put, PutReply, Unput
from kvcr_protocol.session_rules import Role, SessionState
from kvcr_protocol.versions import (
    AUDIT_VERSION,
    BASE_VERSION,
    CLIENT_GONE_VERSION,
    COLUMNS_VERSION,
    CURRENT_VERSION,
    GRANTS_VERSION,
    LEASES_VERSION,
    PARTIAL_LAYOUT_VERSION,
    PROTOCOL_VERSIONS,
    negotiate,
    supported_up_to,
)

__all__ = [
    "ALL_MESSAGES",
    "ANY_REQUEST",
    "AUDIT_VERSION",
    "BASE_VERSION",
    "CLIENT_GONE_VERSION",
    "COLUMNS_VERSION",
    "CURRENT_VERSION",
    "DEFAULT_LIMITS",
    "GRANTS_VERSION",
    "HELD",
    "IPC_PATH_MAX",
    "LEASES_VERSION",
    "MESSAGE_BY_TAG",
    "NOTIFICATION_SIZE",
    "PARTIAL_LAYOUT_VERSION",
    "PREFIX_ALL",
    "PRESENCE_BY_CODE",
    "PRESENCE_CODE",
    "PROTOCOL_VERSIONS",
    "REQUEST_CODES",
    "Commit",
    "DeliverColumns",
    "DepositColumns",
    "ErrorCode",
    "Extent",
    "GrantNode",
    "GrantSource",
    "GroupEvent",
    "GroupLedger",
    "GroupState",
    "Lease",
    "LeaseColumns",
    "LeaseEnded",
    "LeaseGrant",
    "LeaseReply",
    "LeaseStatus",
    "Limits",
    "LocalProtocolError",
    "Notification",
    "NotifyKind",
    "PackedRow",
    "PlanProgress",
    "Projection",
    "ProjectionCache",
    "ProtocolError",
    "Put",
    "PutReply",
    "QueryColumns",
    "ReleaseLease",
    "RemoteProtocolError",
    "RenewLease",
    "RequestCodes",
    "Role",
    "SessionState",
    "SpanColumns",
    "Suspect",
    "Unput",
    "WriteNotify",
    "canonical_endpoint",
    "check_span_sizes",
    "code_of",
    "compute_projection",
    "decode",
    "decode_notification",
    "deliver_blocks",
    "deliver_columns",
    "deposit_blocks",
    "deposit_columns",
    "encode",
    "encode_notification",
    "endpoint_problem",
    "grant_columns",
    "is_notification",
    "item_count",
    "layout_runs",
    "message_keys",
    "negotiate",
    "packed_grant_columns",
    "peek_id",
    "prefix_mask",
    "record_items",
    "resolve_columns",
    "resolve_span",
    "session_rules",
    "supported_up_to",
]
