"""What the node tells others of its agent and pools, so that they can move bytes with it.

A client's read or write grant names the node's agent and the registration of every pool
(``GrantNode``, spec section 6.12); a ``peer_hello`` to a source names them too, with the
link's token (spec section 5.3). Both describe the same regions: pool ``i`` of
``welcome.pools`` is region ``i``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence

from kvcr_io.agent import Agent
from kvcr_node.memory import PoolMemory
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import GrantNode, PeerHello, Region
from kvcr_protocol.columns import U32, pack

LINK_TOKEN_BYTES = 16


class Introductions:
    """The node's agent and pools as grants and peer hellos describe them."""

    def __init__(
        self, agent: Agent, pools: Sequence[PoolSpec], memories: Mapping[str, PoolMemory], name: str,
        incarnation: int, versions: tuple[int, ...], grace_ms: int,
    ) -> None:
        self.agent = agent
        self.specs = tuple(pools)
        self.regions = tuple(
            Region(i, mem.kind, mem.nixl_device, mem.address, mem.spec.size)
            for i, mem in enumerate(memories[spec.name] for spec in self.specs)
        )
        """Every pool's registration, in ``welcome.pools`` order (region id = pool index)."""
        self.name = name
        self.incarnation = incarnation
        self.versions = versions
        self.grace_ms = grace_ms
        """The grace period a grant states (0: none, the node has no heartbeats)."""
        self._link_secret = secrets.token_bytes(32)
        """Keys the tokens of our links to sources (``peer_hello``); never leaves this process."""

    def grant_node(self, session: object) -> GrantNode:
        """What a read grant tells a client's agent (spec section 6.12): the node's agent and
        the registration of every pool, its grace period and the pools' slot sizes."""
        # Slot sizes too: a target passes this on to its clients, who have no welcome of ours.
        sizes = pack([spec.slot_size for spec in self.specs], U32)
        return GrantNode(self.agent.name, self.agent.metadata(), self.regions, self.grace_ms, sizes)

    def peer_hello(self, hello_id: int, endpoint: str) -> PeerHello:
        """Our ``peer_hello`` to ``endpoint`` (spec section 5.3): versions, identity, agent
        metadata, our pools as regions, so sources can write into them (fetch), and the
        link's token: a digest of our secret and the endpoint as spelled, the same at every
        reconnect of that link, which nobody who only knows our incarnation can forge."""
        link = hmac.new(self._link_secret, endpoint.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()[:LINK_TOKEN_BYTES]
        return PeerHello(hello_id, self.versions, self.name, self.incarnation, self.agent.name, self.agent.metadata(),
                         self.regions, link)
