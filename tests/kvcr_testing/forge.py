"""A client that overwrites a stored object through nothing but a read grant (spec section 14).

A grant loads the node's pool registrations into the client's agent, and a UCX key allows
WRITE as well as READ: ``forge`` leases a key, WRITEs other bytes over one of its spans in
the node's pool, and lets go. What readers then get is what the integrity tests check.
"""

from __future__ import annotations

import numpy as np

from kvcr_client import Client
from kvcr_io.agent import XferStatus
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S


def forge(endpoint: str, key: bytes, span: int, forged: np.ndarray) -> None:
    """Overwrite span ``span`` of ``key`` in the pool of the node at ``endpoint`` with ``forged``."""
    with Client(endpoint, name="forger") as forger:
        lease = forger.lease([key]).result(RESULT_TIMEOUT_S)
        granted = forger._grants.keys[key]
        pool = granted.agent.pools[granted.pools[span]]
        region = forger.register(forged)
        remote = [(pool.address + granted.slots[span] * pool.slot_size, len(forged), pool.device)]
        agent = forger.core.agent
        handle, _ = forger.core.call(lambda: agent.start_listed(
            "WRITE", region.kind, [(region.address, len(forged), 0)], pool.kind, remote, granted.agent.name)).result()
        assert wait_until(lambda: forger.core.call(lambda: agent.state(handle)).result() is XferStatus.DONE,
                          RESULT_TIMEOUT_S), "the forged WRITE did not complete"
        forger.core.call(lambda: agent.release(handle)).result()
        lease.release().result(RESULT_TIMEOUT_S)
        forger.unregister(region)
