"""A client that overwrites a stored object through nothing but a read grant (spec section 14).

A grant loads the node's pool registrations into the client's agent, and a UCX key allows
WRITE as well as READ: ``forge`` leases a key, WRITEs other bytes over one of its spans in
the node's pool, and lets go. What readers then get is what the integrity tests check.
"""

from __future__ import annotations

import numpy as np

from kvcr_client import Client
from kvcr_io.agent import XferStatus
from kvcr_protocol import DEFAULT_LIMITS, Lease, LeaseReply, ReleaseLease
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S


def forge(endpoint: str, key: bytes, span: int, forged: np.ndarray) -> None:
    """Overwrite span ``span`` of ``key`` in the pool of the node at ``endpoint`` with
    ``forged``, as a hostile client would: it asks for the lease on the wire itself, loads
    the node's agent from the grant, and WRITEs where the grant says the span lies."""
    with Client(endpoint, name="forger") as forger:
        core = forger.core
        _, asked = core.request(lambda i: Lease(i, (key,), None, 0, True, True), lambda m: m, RESULT_TIMEOUT_S)
        reply = core.wait(asked, RESULT_TIMEOUT_S + 2)
        assert isinstance(reply, LeaseReply) and reply.grant is not None and reply.grant.node is not None, reply
        grant, node = reply.grant, reply.grant.node
        [(_, _, pools, slots)] = list(grant.keys(DEFAULT_LIMITS))
        pool = node.pools[pools[span]]
        assert forger.node is not None
        slot_size = forger.node.pools[pool.region].slot_size  # a grant's pool names its index in the welcome
        agent = core.agent
        peer = core.call(lambda: agent.add_remote(node.agent_md)).result()
        region = forger.register(forged)
        remote = [(pool.address + slots[span] * slot_size, len(forged), pool.device)]
        handle, _ = core.call(lambda: agent.start_listed(
            "WRITE", region.kind, [(region.address, len(forged), 0)], pool.kind, remote, peer)).result()
        assert wait_until(lambda: core.call(lambda: agent.state(handle)).result() is XferStatus.DONE,
                          RESULT_TIMEOUT_S), "the forged WRITE did not complete"
        core.call(lambda: agent.release(handle)).result()
        core.wait(core.request(lambda i: ReleaseLease(i, reply.lease), lambda m: m, RESULT_TIMEOUT_S)[1], RESULT_TIMEOUT_S + 2)
        forger.unregister(region)
