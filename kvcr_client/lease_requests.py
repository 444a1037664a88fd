"""The lease requests of a client (spec section 6.11): ``lease``, ``renew``, ``unlease``, and
the node's ``lease_end`` applied to the handles.

``LeaseRequests`` asks for leases and their read grants, keeps the live ones in the
session's scope (so that a ``lease_end`` reaches their ``LeaseHandle``), and hands grants to
``Grants``; a lease answered after its session ended adds nothing. It stands on the
client's state (``kvcr_client.client_state``); ``Operations`` adds the other requests.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from kvcr_client import checks
from kvcr_client.client_state import DEFAULT_MAX_COMPLETED, ClientState
from kvcr_client.core import ClientCore
from kvcr_client.errors import ArgumentError, NodeError
from kvcr_client.leases import LeaseHandle
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_client.results import OpHandle
from kvcr_protocol import ErrorCode, Lease, LeaseEnded, LeaseReply, Message, ReleaseLease, RenewLease
from kvcr_protocol.versions import GRANTS_VERSION, LEASES_VERSION


class LeaseRequests(ClientState):
    """Leases asked for, renewed and released."""

    def __init__(self, core: ClientCore, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        super().__init__(core, max_completed)
        core.hooks.on_lease_end = self._lease_ended

    def lease(
        self, keys: Iterable[bytes], request_id: str | None = None, ttl_ms: int = 0, read: bool = True,
    ) -> OpHandle[LeaseHandle]:
        """Hold ``keys`` from now through every delivery of them (spec section 6.11).

        The handle resolves to a ``LeaseHandle`` that says per key what is held: here
        (``LEASED``), at the source the hint for ``request_id`` names (``LEASED_REMOTE``), or
        not (``MISS``, ``PENDING``, ``LEASE_LIMIT``, ``ADVISORY``, ``UNREACHABLE``: treat as a
        miss). Held keys cannot be evicted until the lease is released, expires (``ttl_ms``,
        0: the node's default) or its session ends. Needs a node speaking version 4.

        ``read`` (version 5): ask for a read grant, so that a ``deliver`` of the held keys
        READs them from the node's pools with this client's agent (spec section 6.12); a
        node with ``client_transfers`` off, or below version 5, grants none, and they travel
        by the node as before.
        """
        request_id = checks.optional_request_id(request_id)
        ks = checks.keys(keys, "keys")
        ttl = checks.uint(ttl_ms, "ttl_ms", 0xFFFFFFFF)
        read = checks.flag(read, "read") and self.core.version >= GRANTS_VERSION
        node_md = read and self._grants.wants_node()
        self._need_leases()
        core = self.core
        asked_at = time.monotonic()
        current = self._scope
        scope = current()
        # The handle lives in its scope's table: it names the scope weakly, or an unreleased
        # lease would keep its closed client (and its NIXL agent) for the cyclic collector.
        scope_ref = weakref.ref(scope)

        def live() -> bool:
            return not core.closed and not core.lost and current() is scope_ref()

        granting: list[Future[frozenset[bytes]]] = []

        def convert(msg: Message) -> LeaseHandle:
            if not isinstance(msg, LeaseReply) or msg.columns is None:
                raise ValueError(f"expected lease_reply with columns, got {msg.TAG}")
            if len(msg.columns) != len(ks):
                raise ValueError(f"{len(msg.columns)} answers for {len(ks)} keys")
            handle = LeaseHandle(msg.lease, msg.ttl_ms, ks, msg.columns, asked_at, self.renew_lease, self.release_lease, live)
            handle.grant = msg.grant is not None
            if msg.lease:
                scope.leases[msg.lease] = handle
                if msg.grant is not None and live():
                    granting.append(self._grants.add(scope, handle, ks, msg.grant))
            return handle

        op_id, replied = core.request(lambda i: Lease(i, ks, request_id, ttl, read, node_md), convert, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "lease", _with_grants(replied, granting))

    def renew_lease(self, lease: LeaseHandle, ttl_ms: int = 0) -> OpHandle[int]:
        """Keep ``lease`` ``ttl_ms`` more from now (0: its own time to live); resolves to the
        granted time to live. A lease the node no longer holds fails ``NodeError(UNKNOWN_LEASE)``."""
        self._live_lease(lease)
        ttl = checks.uint(ttl_ms, "ttl_ms", 0xFFFFFFFF)
        asked_at = time.monotonic()

        def convert(msg: Message) -> int:
            if not isinstance(msg, LeaseReply):
                raise ValueError(f"expected lease_reply, got {msg.TAG}")
            lease.renewed(msg.ttl_ms, asked_at)
            return msg.ttl_ms

        op_id, fut = self.core.request(lambda i: RenewLease(i, lease.id, ttl), convert, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "renew", fut)

    def release_lease(self, lease: LeaseHandle) -> OpHandle[None]:
        """End ``lease`` now: what it held may be evicted again. A second release (or one of
        a lease that ended) is an ``ArgumentError``; the node frees nothing twice either."""
        self._live_lease(lease)
        lease.released = True
        lease.end(ErrorCode.OK, "released")
        self._scope().leases.pop(lease.id, None)
        self._grants.drop(lease)
        op_id, fut = self.core.request(lambda i: ReleaseLease(i, lease.id), checks.ack, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "unlease", fut)

    def _live_lease(self, lease: Any) -> None:
        if not isinstance(lease, LeaseHandle):
            raise ArgumentError("lease", f"expected a LeaseHandle, got {type(lease).__name__}")
        if lease.released:
            raise ArgumentError("lease", f"lease {lease.id} was released already")
        if lease.ended is not None or self._scope().leases.get(lease.id) is not lease:
            raise ArgumentError("lease", f"lease {lease.id} is not held (ended: {lease.ended!r} {lease.end_reason})".rstrip())

    def _need_leases(self) -> None:
        version = self.core.version
        if version and version < LEASES_VERSION:
            raise NodeError(ErrorCode.PEER_UNSUPPORTED, f"the session agreed on version {version}; leases need {LEASES_VERSION}")

    def _lease_ended(self, msg: LeaseEnded) -> None:
        """The node's ``lease_end`` (lock held): the handle learns what it no longer holds."""
        leases = self._scope().leases
        handle = leases.get(msg.lease)
        if handle is None:
            return
        handle.end(msg.code, msg.reason, msg.keys)
        if handle.ended is not None:
            del leases[msg.lease]
            self._grants.drop(handle)



def _with_grants(replied: Future[LeaseHandle], granting: list[Future[frozenset[bytes]]]) -> Future[LeaseHandle]:
    """The lease's handle once its grants are in place too: a grant that names an agent not
    yet loaded (the session's first) waits for the loader thread, never for the turn."""
    out: Future[LeaseHandle] = Future()

    def answered(done: Future[LeaseHandle]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        handle = done.result()
        if not granting:
            out.set_result(handle)
            return

        def granted(added: Future[frozenset[bytes]]) -> None:
            if added.exception() is None:
                handle.granted = added.result()
            out.set_result(handle)

        granting[0].add_done_callback(granted)

    replied.add_done_callback(answered)
    return out
