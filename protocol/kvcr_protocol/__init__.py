"""kvcr_protocol: the pure, sans-I/O control protocol of kvcr.

Importing this package imports no sockets, NIXL, threads or asyncio. Messages are typed
frozen dataclasses (``messages``); ``codec`` turns them into msgpack frames and back,
validating every field; ``versions`` negotiates; ``projection`` maps named span subsets
onto stored layouts; ``descriptors`` checks spans against announced regions.
"""

from kvcr_protocol.codec import decode, encode, peek_id
from kvcr_protocol.descriptors import Extent, check_span_sizes, resolve_span
from kvcr_protocol.endpoints import IPC_PATH_MAX, endpoint_problem
from kvcr_protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError, code_of
from kvcr_protocol.limits import DEFAULT_LIMITS, Limits
from kvcr_protocol.messages import *  # noqa: F403 - the message catalogue is the API
from kvcr_protocol.messages import ALL_MESSAGES, MESSAGE_BY_TAG
from kvcr_protocol.operations import ANY_REQUEST, REQUEST_CODES, RequestCodes
from kvcr_protocol.projection import Projection, ProjectionCache, compute_projection
from kvcr_protocol.versions import (
    BASE_VERSION,
    CURRENT_VERSION,
    PARTIAL_LAYOUT_VERSION,
    SUPPORTED_VERSIONS,
    negotiate,
    supported_up_to,
)

__all__ = [
    "ALL_MESSAGES",
    "ANY_REQUEST",
    "BASE_VERSION",
    "CURRENT_VERSION",
    "DEFAULT_LIMITS",
    "IPC_PATH_MAX",
    "MESSAGE_BY_TAG",
    "PARTIAL_LAYOUT_VERSION",
    "REQUEST_CODES",
    "SUPPORTED_VERSIONS",
    "ErrorCode",
    "Extent",
    "Limits",
    "LocalProtocolError",
    "Projection",
    "ProjectionCache",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestCodes",
    "check_span_sizes",
    "code_of",
    "compute_projection",
    "decode",
    "encode",
    "endpoint_problem",
    "negotiate",
    "peek_id",
    "resolve_span",
    "supported_up_to",
]
