"""kvcr_client: embed in an inference engine to deposit and deliver KV cache through a kvcr node.

``Client`` blocks; ``AsyncClient`` is for asyncio. Both register buffers (numpy, CuPy,
torch) with their own NIXL agent, so the node moves bytes straight into and out of them.
"""

from kvcr_client.client import AsyncClient, Client, CurveKeys, Destination, RegionHandle, Span
from kvcr_client.errors import (
    ArgumentError,
    ClientClosed,
    ClientStateError,
    GroupFailed,
    KvcrError,
    NodeError,
    NodeLostError,
    OperationTimeout,
)
from kvcr_client.grants import GrantedView, GrantsView
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import (
    DeliverHandle,
    GroupDone,
    GroupFuture,
    KeyOutcome,
    KeyPresence,
    OpHandle,
    Presences,
    Results,
    StoreHandle,
)
from kvcr_protocol import ErrorCode, GroupState, KeyStatus, LeaseStatus, Presence

__all__ = [
    "ArgumentError", "AsyncClient", "Client", "ClientClosed", "ClientStateError", "CurveKeys", "DeliverHandle", "Destination", "ErrorCode",
    "GrantedView", "GrantsView", "GroupDone", "GroupFailed", "GroupFuture", "GroupState", "KeyOutcome", "KeyPresence",
    "KeyStatus", "KvcrError", "LeaseHandle", "LeaseStatus", "NodeError", "NodeLostError", "OpHandle", "OperationTimeout", "Presence", "Presences",
    "RegionHandle", "Results", "Span", "StoreHandle",
]
