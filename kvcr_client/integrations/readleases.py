"""Read leases an engine integration takes in the client that loads (spec section 6.12).

A read grant belongs to the session whose lease asked for it: a ``deliver`` READs the
node's pools with the client's own agent only when that same client holds a ``read`` lease
with a grant on every key it delivers; otherwise the node delivers, as before. An
integration whose lookup lease lives in another session (vLLM's scheduler, its own process)
or that looks up without one (SGLang's ``batch_exists``) therefore takes a short read lease
of its own in the client that loads, right before the load, and releases it once the load
is over (docs/architecture.md, "Engines"). ``ReadLeases`` does that for one client:

- ``ask(keys)`` sends the lease without waiting, ``take`` waits for it (``wait_s`` at most);
  a lease that fails or comes late only means the node-driven path (a late one is released
  when it comes in);
- a node that answers a lease without a grant (``client_transfers = false``) is remembered
  for the session: its later loads take no lease and the node delivers; a node below
  version 5 is never asked;
- ``deliver`` runs a deliver and counts which path it took: ``granted`` (READs under
  grants, ``Client.grant_reads``) or ``node``.

A grant read never returns bytes its lease may not have held for: the client fails those
keys ``LEASE_EXPIRED`` or ``LEASE_LOST``, and the integration treats them as any key that
failed to load (the engine recomputes them). Pure: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvcr_client.errors import KvcrError
from kvcr_client.leases import LeaseHandle
from kvcr_client.operations import Operations
from kvcr_client.results import OpHandle
from kvcr_protocol import GRANTS_VERSION, Welcome

LEASE_WAIT_S = 5.0
"""How long a load waits for its read lease before it lets the node deliver instead."""

H = TypeVar("H")


class ReadLeases:
    """One client's read leases for its loads, and which path each deliver took."""

    def __init__(self, client: Operations, wait_s: float = LEASE_WAIT_S) -> None:
        self.client = client
        self.wait_s = wait_s
        self._no_grants: Welcome | None = None
        """The session (its welcome) whose node answered a lease without a grant."""
        self._late: list[OpHandle[LeaseHandle]] = []
        """Leases that came too late for their load: released once they are in."""
        self.granted = 0
        """Delivers served by READs under read grants."""
        self.node = 0
        """Delivers the node served (no grant, or not every key granted)."""

    def offered(self) -> bool:
        """Whether a read lease may get a grant in this session: version 5, and the node has
        not answered one without a grant."""
        welcome = self.client.node
        return welcome is not None and welcome.version >= GRANTS_VERSION and welcome is not self._no_grants

    def ask(self, keys: Sequence[bytes], request_id: str | None = None) -> OpHandle[LeaseHandle] | None:
        """Send a read lease for ``keys``, not waited for; None where no grant can come."""
        self.sweep()
        if not keys or not self.offered():
            return None
        try:
            return self.client.lease(keys, request_id=request_id, read=True)
        except KvcrError:
            return None

    def take(self, asked: OpHandle[LeaseHandle] | None) -> LeaseHandle | None:
        """The lease ``ask`` sent, once in; None when it failed or is not in within ``wait_s``."""
        if asked is None:
            return None
        try:
            lease = asked.result(self.wait_s)
        except KvcrError:
            return None
        except TimeoutError:
            self._late.append(asked)
            return None
        if lease.id and not lease.grant:
            self._no_grants = self.client.node  # client_transfers off: the node delivers from now on
        return lease

    def lease(self, keys: Sequence[bytes], request_id: str | None = None) -> LeaseHandle | None:
        """``ask`` then ``take``."""
        return self.take(self.ask(keys, request_id))

    def deliver(self, send: Callable[[], H]) -> tuple[H, bool]:
        """Run ``send`` (one ``deliver`` of this client); returns its handle and whether it
        READs under grants."""
        before = self.client.grant_reads
        handle = send()
        granted = self.client.grant_reads > before
        if granted:
            self.granted += 1
        else:
            self.node += 1
        return handle, granted

    @staticmethod
    def release(lease: LeaseHandle | None) -> None:
        """End ``lease`` (not waited for: the reply is read in the background)."""
        if lease is not None and lease.id and lease.ended is None:
            try:
                lease.release()
            except KvcrError:
                pass  # the session is over, and the lease with it

    def sweep(self) -> None:
        """Release the leases that came in too late."""
        if not self._late:
            return
        waiting = []
        for asked in self._late:
            if not asked.done():
                waiting.append(asked)
                continue
            try:
                self.release(asked.result(0))
            except (KvcrError, TimeoutError):
                continue
        self._late = waiting

    def close(self) -> None:
        """Forget leases still in flight (the client's close ends them with the session)."""
        self._late = []
